"""TritonBackend's start and restart against a scripted tritonclient (no Triton): polls, retries, clean-up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.utils import InferenceServerException

from tokenmesh.worker import ModelSpec
from tokenmesh.worker.triton import TritonBackend, TritonBackendConfig, TritonProcessConfig, _backend
from tokenmesh.worker.triton._process import load_failures

READY = {"models": [{"name": "m", "state": "READY"}]}
LOADING = {"models": [{"name": "m", "state": "LOADING"}]}


class FakeClient:
    """tritonclient's aio client, answering the repository index from a script (the last answer repeats)."""

    made: list[FakeClient] = []
    script: list[Any] = [READY]

    def __init__(self, url: str) -> None:
        self.url = url
        self.closed = False
        self.loaded: list[str] = []
        self.index_calls = 0
        FakeClient.made.append(self)

    async def get_model_repository_index(self, as_json: bool, client_timeout: float) -> dict[str, Any]:
        assert not self.closed
        answer = FakeClient.script[min(self.index_calls, len(FakeClient.script) - 1)]
        self.index_calls += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def get_model_config(self, name: str, as_json: bool, client_timeout: float) -> dict[str, Any]:
        parameters = {"n_parallel": {"string_value": "2"}, "n_ctx": {"string_value": "4096"}}
        inputs = [{"name": "text_input"}, {"name": "stream"}, {"name": "sampling_parameters"}]
        if name == "m":  # ours declare the messages extension; the stock vLLM backend does not
            inputs.append({"name": "messages"})
        return {"config": {"name": name, "parameters": parameters, "input": inputs}}

    async def load_model(self, name: str) -> None:
        assert not self.closed
        self.loaded.append(name)

    async def close(self) -> None:
        self.closed = True


class FakeProcess:
    """A tritonserver that exits at once with the given log on its first `exits` starts, then runs."""

    def __init__(self, exits: int = 0, tail: str = "", log: str = "") -> None:
        self.exits, self.tail, self.log = exits, tail, log
        self.starts = self.stops = 0
        self.url = "127.0.0.1:1"
        self.pid = 4242

    async def start(self) -> None:
        self.starts += 1
        self.url = f"127.0.0.1:{self.starts}"

    def exited(self) -> bool:
        return self.starts <= self.exits

    def log_tail(self, lines: int = 15) -> str:
        return self.tail

    def load_failures(self) -> list[str]:
        return load_failures(self.log)

    async def stop(self) -> None:
        self.stops += 1


@pytest.fixture(autouse=True)
def fake_client(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeClient.made, FakeClient.script = [], [READY]
    monkeypatch.setattr(_backend.triton_aio, "InferenceServerClient", FakeClient)
    monkeypatch.setattr(_backend, "READY_POLL_S", 0.01)


def own(process: FakeProcess, start_timeout_s: float = 60.0) -> TritonBackend:
    config = TritonProcessConfig(work_dir=Path("/nonexistent"), start_timeout_s=start_timeout_s)
    backend = TritonBackend(TritonBackendConfig(process=config))
    backend.process = process  # type: ignore[assignment]
    return backend


async def test_start_polls_while_triton_is_unreachable_or_loading_then_reads_the_models() -> None:
    FakeClient.script = [InferenceServerException("failed to connect"), {"models": []}, LOADING, READY]
    backend = TritonBackend(TritonBackendConfig(url="127.0.0.1:1"))
    try:
        await backend.start()
        assert backend.models() == [ModelSpec(name="m", max_context=2048, slots=2)]
        assert FakeClient.made[0].index_calls == 4
    finally:
        await backend.stop()


async def test_start_gives_up_after_the_timeout_saying_what_it_waited_for() -> None:
    FakeClient.script = [LOADING]
    backend = own(FakeProcess(tail="I loading model m"), start_timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"had no READY model after 0 s \(still loading: m LOADING\)\nI loading"):
        await backend.start()
    assert 0.2 <= time.monotonic() - started < 2
    await backend.stop()


async def test_a_tritonserver_that_exited_stops_the_poll_at_once_with_its_log_tail() -> None:
    backend = own(FakeProcess(exits=1, tail="E model m failed to load"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="tritonserver exited during start:\nE model m failed to load"):
        await backend.start()
    assert time.monotonic() - started < 1  # not the 60 s start timeout
    assert FakeClient.made[0].index_calls == 0
    await backend.stop()


async def test_a_tritonserver_that_exited_for_a_model_says_the_models_own_error_which_its_tail_lacks() -> None:
    # Triton's log as it reads when a model's initialize raises (its tables between the error and the tail).
    log = "\n".join(
        [
            'I1202 21:23:46.997772 19305 pb_stub.cc:366] "Failed to initialize Python stub: TritonModelException: x"',
            "E1202 21:23:47.213880 19305 model_lifecycle.cc:642] \"failed to load 'smollm2' version 1: Internal: "
            "TritonModelException: max_loras: '0' is not a positive integer (the most ...)\\n\\nAt:\\n  model.py(85)\"",
            "E1202 21:23:47.213881 19305 model_lifecycle.cc:642] \"failed to load 'other' version 3: Invalid argument: "
            'bad config"',
            "I1202 21:23:47.213899 19305 model_lifecycle.cc:777] \"failed to load 'smollm2'\"",
            "| smollm2 | 1       | UNAVAILABLE: Internal: TritonModelException: max_loras: '0' is not ... |",
        ]
    )
    backend = own(FakeProcess(exits=1, tail="error: creating server: Internal - failed to load all models", log=log))
    why = (
        "tritonserver exited during start (model smollm2: Internal: TritonModelException: max_loras: '0' is not a "
        "positive integer (the most ...); model other: Invalid argument: bad config):\n"
        "error: creating server: Internal - failed to load all models"
    )
    with pytest.raises(RuntimeError) as raised:
        await backend.start()
    assert str(raised.value) == why
    await backend.stop()


async def test_a_model_that_failed_to_load_is_not_waited_for() -> None:
    FakeClient.script = [{"models": [{"name": "m", "state": "UNAVAILABLE", "reason": "bad config"}]}]
    backend = TritonBackend(TritonBackendConfig(url="127.0.0.1:1"))
    with pytest.raises(RuntimeError, match="no model loaded: m: bad config"):
        await backend.start()
    assert FakeClient.made[0].index_calls == 1
    await backend.stop()


async def test_a_port_taken_before_triton_binds_is_retried_on_new_ports(caplog: pytest.LogCaptureFixture) -> None:
    process = FakeProcess(exits=1, tail="E grpc: bind: Address already in use")
    backend = own(process)
    try:
        await backend.start()
        assert process.starts == 2 and process.stops == 1  # the failed server was stopped first
        assert backend.endpoint == "127.0.0.1:2"
        assert "port was taken before it bound (attempt 1); trying new ports" in caplog.text
    finally:
        await backend.stop()


async def test_ports_taken_three_times_give_up() -> None:
    process = FakeProcess(exits=99, tail="E grpc: bind: Address already in use")
    backend = own(process)
    with pytest.raises(RuntimeError, match="could not bind free ports in 3 attempts") as info:
        await backend.start()
    assert process.starts == 3 and process.stops == 3
    assert "already in use" in str(info.value.__cause__)
    assert all(c.closed for c in FakeClient.made)


async def test_restarting_an_external_triton_reloads_and_closes_the_client_and_channel_of_before() -> None:
    backend = TritonBackend(TritonBackendConfig(url="127.0.0.1:1"))
    try:
        await backend.start()
        old_channel = backend._channel
        assert old_channel is not None
        await backend.restart()
        first, second = FakeClient.made
        assert first.loaded == ["m"] and first.closed and not second.closed
        assert old_channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        assert backend._channel is not old_channel
    finally:
        await backend.stop()
    assert all(c.closed for c in FakeClient.made)
