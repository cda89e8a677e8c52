"""Error classification and configuration."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from tokenmesh.cli import build_parser
from tokenmesh.config import ConfigError, add_arguments, from_namespace
from tokenmesh.errors import classify_backend_message
from tokenmesh.mesh import MeshConfig, UpConfig
from tokenmesh.redaction import CAPTURE_ENV, capture_enabled
from tokenmesh.router import RouterConfig
from tokenmesh.v1 import worker_pb2
from tokenmesh.worker import WorkerConfig


@pytest.mark.parametrize(
    ("message", "error_class"),
    [
        # llama.cpp server
        (
            "request (401 tokens) exceeds the available context size (256 tokens), try increasing it",
            worker_pb2.ERROR_CLASS_INVALID_REQUEST,
        ),
        # vLLM
        (
            "This model's maximum context length is 2048 tokens. However, you requested 4000 tokens",
            worker_pb2.ERROR_CLASS_INVALID_REQUEST,
        ),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", worker_pb2.ERROR_CLASS_OUT_OF_MEMORY),
        ("Request for unknown model: 'x' has no available versions", worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND),
        ("Deadline Exceeded", worker_pb2.ERROR_CLASS_TIMEOUT),
        ("Stub process 'smollm2_0_0' is not healthy.", worker_pb2.ERROR_CLASS_UNAVAILABLE),
        ("something nobody has seen", worker_pb2.ERROR_CLASS_BACKEND),
    ],
)
def test_backend_messages_are_classified(message: str, error_class: int) -> None:
    assert classify_backend_message(message) == error_class


def parse(cls, service: str, argv: list[str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, service)
    return from_namespace(cls, parser.parse_args(argv))


def test_flags_override_env_which_overrides_defaults(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMESH_ROUTER_PORT", "6000")
    monkeypatch.setenv("TOKENMESH_ROUTER_WORKERS", "a:1, b:2")
    config = parse(RouterConfig, "router", [])
    assert (config.port, config.workers) == (6000, ("a:1", "b:2"))
    assert parse(RouterConfig, "router", ["--port", "7000"]).port == 7000
    assert config.stream_interval_ms == 0  # pacing is opt-in
    monkeypatch.setenv("TOKENMESH_ROUTER_STREAM_INTERVAL_MS", "20")  # what benchmarks/overhead.py's router reads
    assert parse(RouterConfig, "router", []).stream_interval_ms == 20


@pytest.mark.parametrize(
    ("cls", "kwargs", "needle"),
    [
        (RouterConfig, {"port": 70000}, "port must be 0..65535"),
        (RouterConfig, {"workers": ("nocolon",)}, "must be host:port"),
        (RouterConfig, {"default_max_tokens": 0}, "default_max_tokens"),
        # A paced stream silent for its interval would be failed over as stalled.
        (RouterConfig, {"stall_timeout_s": 1, "stream_interval_ms": 1000}, "below stall_timeout_s"),
        (RouterConfig, {"stream_interval_ms": -1}, "stream_interval_ms must be >= 0"),
        (WorkerConfig, {"threads": -1}, "threads must be >= 0"),
        (WorkerConfig, {"model_repository": "/does/not/exist"}, "is not a folder"),
        (WorkerConfig, {"triton_nice": 20}, "triton_nice must be 0..19"),
        (MeshConfig, {"triton_nice": -1}, "triton_nice must be 0..19"),
    ],
)
def test_invalid_settings_say_what_to_change(cls, kwargs, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        cls(**kwargs)


def test_the_embedded_mesh_nices_only_a_computing_engine() -> None:
    assert MeshConfig().engine_nice == 19  # the shipped SmolLM2 (llama.cpp)
    assert MeshConfig(model_repository="/any/repository").engine_nice == 0  # e.g. the synthetic model
    assert MeshConfig(model_repository="/any/repository", triton_nice=5).engine_nice == 5


def test_bad_env_value_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMESH_ROUTER_PORT", "many")
    with pytest.raises(ConfigError, match="TOKENMESH_ROUTER_PORT"):
        parse(RouterConfig, "router", [])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", True),
        ("TRUE", True),
        (" Yes ", True),
        ("1", True),
        ("on", True),
        ("false", False),
        ("False", False),
        ("NO", False),
        ("0", False),
        ("off", False),
    ],
)
def test_a_boolean_env_value_is_one_of_the_known_words_in_any_case(monkeypatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("TOKENMESH_WORKER_TRITON_TLS", value)
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerConfig, "worker")
    assert parser.parse_args([]).triton_tls is expected
    assert parser.parse_args(["--no-triton-tls"]).triton_tls is False  # the flag still wins


@pytest.mark.parametrize("value", ["ture", "2", "", "enabled", "y"])
def test_a_boolean_env_value_that_is_no_known_word_is_refused_naming_the_variable(monkeypatch, value: str) -> None:
    monkeypatch.setenv("TOKENMESH_WORKER_TRITON_TLS", value)
    with pytest.raises(ConfigError) as refused:
        parse(WorkerConfig, "worker", [])
    assert str(refused.value) == (
        f"TOKENMESH_WORKER_TRITON_TLS={value!r} is not valid: not a boolean: use one of "
        "true, 1, yes, on, false, 0, no, off (any case)"
    )


def test_the_content_capture_variable_takes_the_same_words_and_refuses_a_typo(monkeypatch) -> None:
    monkeypatch.delenv(CAPTURE_ENV, raising=False)
    assert capture_enabled() is False
    for value, expected in (("", False), ("TRUE", True), ("off", False)):
        monkeypatch.setenv(CAPTURE_ENV, value)
        assert capture_enabled() is expected
    monkeypatch.setenv(CAPTURE_ENV, "ture")
    with pytest.raises(ConfigError, match=f"^{CAPTURE_ENV}='ture' is not valid: not a boolean: use one of true,"):
        capture_enabled()


def test_a_router_whose_capture_variable_has_a_typo_exits_2_at_start_naming_it() -> None:
    env = {**os.environ, CAPTURE_ENV: "ture"}
    done = subprocess.run(
        [sys.executable, "-m", "tokenmesh", "router", "--port", "0", "--workers", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"tokenmesh router: error: {CAPTURE_ENV}='ture' is not valid: not a boolean")
    )


def test_up_takes_its_settings_from_flags_over_tokenmesh_up_variables_over_its_defaults(monkeypatch) -> None:
    for name in [n for n in os.environ if n.startswith("TOKENMESH_")]:
        monkeypatch.delenv(name)
    assert from_namespace(UpConfig, build_parser().parse_args(["up"])) == UpConfig()
    assert (UpConfig().gateway_port, UpConfig().metrics) == (8000, True)  # what the command starts
    assert (MeshConfig().gateway_port, MeshConfig().metrics) == (None, False)  # a Mesh built in code: neither
    monkeypatch.setenv("TOKENMESH_UP_WORKERS", "3")
    monkeypatch.setenv("TOKENMESH_UP_GATEWAY_PORT", "off")
    monkeypatch.setenv("TOKENMESH_UP_METRICS", "no")
    monkeypatch.setenv("TOKENMESH_UP_TRITON_NICE", "7")
    config = from_namespace(UpConfig, build_parser().parse_args(["up", "--workers", "4", "--port", "0"]))
    assert (config.workers, config.port, config.gateway_port, config.metrics, config.triton_nice) == (
        4,
        0,
        None,
        False,
        7,
    )
    config = from_namespace(UpConfig, build_parser().parse_args(["up", "--gateway-port", "0", "--metrics"]))
    assert (config.gateway_port, config.metrics) == (0, True)  # 0: a free port, as every port setting


def _up(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMESH_")}
    return subprocess.run(
        [sys.executable, "-m", "tokenmesh", "up", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


def test_up_check_config_prints_the_settings_and_starts_nothing() -> None:
    done = _up("--model", "synthetic", "--check-config", TOKENMESH_UP_WORKERS="3", TOKENMESH_UP_GATEWAY_PORT="off")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["workers = 3", "host = '127.0.0.1'", "port = 50051"]
    assert "gateway_port = None" in lines and "metrics = True" in lines
    assert any(line.startswith("model_repository = ") and "synthetic" in line for line in lines)
    assert not any(line.startswith("extra_env") for line in lines)  # set in code only: no setting
    assert "starting" not in done.stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {"TOKENMESH_UP_WORKERS": "0"}, "tokenmesh up: error: workers must be 1..64, got 0"),
        (
            ("--model", "synthetic", "--model-repository", "/x"),
            {},
            "tokenmesh up: error: give --model or --model-repository, not both",
        ),
        (
            (),
            {"TOKENMESH_UP_METRICS": "ture"},
            "tokenmesh: error: TOKENMESH_UP_METRICS='ture' is not valid: not a "
            "boolean: use one of true, 1, yes, on, false, 0, no, off (any case)",
        ),
    ],
)
def test_up_refuses_invalid_settings_with_exit_2_naming_them(
    args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    done = _up(*args, "--check-config", **env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == message
    assert not done.stdout


async def test_every_mesh_error_survives_the_wire_and_comes_back_as_itself() -> None:
    """Server side the interceptor maps each class to its code; client side from_rpc_error maps it back."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.support.mesh import behind_error_interceptor
    from tokenmesh.errors import ERRORS, FieldViolation, Internal, MeshError, from_rpc_error

    raised: list[MeshError] = []

    class Failing(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
        async def Check(self, request, context):  # noqa: N802
            raise raised[-1]

    async with behind_error_interceptor(Failing()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert len({cls.grpc_code for cls in ERRORS}) == len(ERRORS)  # one class per code
        for cls in ERRORS:
            raised.append(
                cls(
                    f"what went wrong with {cls.__name__}",
                    reason="SOME_REASON",
                    field="max_tokens",
                    metadata={"model": "m"},
                    retry_delay=0.25,
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            back = from_rpc_error(caught.value)
            assert type(back) is cls
            assert back.message == f"what went wrong with {cls.__name__}"
            assert (back.reason, back.domain, back.metadata) == ("SOME_REASON", "tokenmesh", {"model": "m"})
            assert back.field_violations == (FieldViolation("max_tokens", back.message),)
            assert back.retry_delay == 0.25 and back.answered
            assert dict(caught.value.trailing_metadata() or ())["retry-after-ms"] == "250"  # for older callers
            assert back.http_status == cls.http_status
    unknown = from_rpc_error(
        grpc.aio.AioRpcError(grpc.StatusCode.DATA_LOSS, grpc.aio.Metadata(), grpc.aio.Metadata(), details="bits lost")
    )
    assert type(unknown) is Internal and unknown.message == "DATA_LOSS: bits lost"
    assert unknown.domain == "" and not unknown.answered and unknown.reason == "INTERNAL"


def test_every_mesh_error_survives_a_status_and_the_error_a_call_would_raise_with_it() -> None:
    """A Link stream's end carries a google.rpc.Status: from_status and rpc_error read it as a call's end."""
    import grpc

    from tokenmesh.errors import ERRORS, FieldViolation, from_rpc_error, from_status, rpc_error

    for cls in ERRORS:
        error = cls(f"{cls.__name__} happened", reason="WHY", field="prompt", metadata={"worker": "w"}, retry_delay=1.5)
        raised = rpc_error(error.status())
        assert raised.code() is cls.grpc_code and raised.details() == f"{cls.__name__} happened"
        for back in (from_status(error.status()), from_rpc_error(raised)):
            assert type(back) is cls and back.message == error.message and back.answered
            assert (back.reason, back.metadata, back.retry_delay) == ("WHY", {"worker": "w"}, 1.5)
            assert back.field_violations == (FieldViolation("prompt", back.message),)
    assert rpc_error(ERRORS[0]("x").status()).code() is grpc.StatusCode.INVALID_ARGUMENT


def test_a_status_without_details_or_with_an_unknown_code_is_not_one_the_mesh_answered() -> None:
    import grpc
    from google.rpc import status_pb2

    from tokenmesh.errors import Internal, Unavailable, from_status, rpc_error

    bare = from_status(status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0], message="gone"))
    assert type(bare) is Unavailable and bare.message == "gone" and not bare.answered
    odd = status_pb2.Status(code=99, message="from the future")
    assert rpc_error(odd).code() is grpc.StatusCode.UNKNOWN
    assert type(from_status(odd)) is Internal
