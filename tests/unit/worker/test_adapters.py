"""LoRA adapters on the worker's side: the names it reads, the request it sends, what the SmolLM2 model makes of it.

The model's own code (its model.py) runs here with a stand-in for Triton's Python-backend module; the real
load and a real generation with an adapter are tests/integration/test_lora.py's.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from tokenmesh.worker import AdapterState, GenerationParams, ModelSpec, parse_adapters
from tokenmesh.worker._servicer import loaded_adapters, model_infos
from tokenmesh.worker.triton import build_request, decode_first


def test_parse_adapters_reads_the_names_in_order() -> None:
    assert parse_adapters("") == ()
    assert parse_adapters("demo=adapters/demo.gguf, terse = /abs/t.gguf,") == ("demo", "terse")


def test_describe_lists_each_model_then_its_adapters_as_models_of_that_base() -> None:
    specs = [
        ModelSpec(name="smollm2", max_context=2048, slots=4, adapters=("demo", "terse")),
        ModelSpec(name="other", max_context=512, slots=2, adapters=("x",)),
    ]
    assert [(i.name, i.base, i.is_default, i.max_context) for i in model_infos(specs)] == [
        ("smollm2", "", True, 2048),
        ("smollm2:demo", "smollm2", False, 2048),
        ("smollm2:terse", "smollm2", False, 2048),
        ("other", "", False, 512),
        ("other:x", "other", False, 512),
    ]
    # The engine says which it has loaded: the others are listed not_loaded (a request loads them), and only the
    # loaded ones are in the loaded gauge.
    state = AdapterState(
        reporting=frozenset({"smollm2"}), loaded=frozenset({("smollm2", "terse")}), loads={}, unloads={}
    )
    assert [(i.name, i.not_loaded) for i in model_infos(specs, state) if i.base] == [
        ("smollm2:demo", True),
        ("smollm2:terse", False),
        ("other:x", False),  # a model that does not report its adapters: they count as loaded
    ]
    assert loaded_adapters(specs, state) == [("smollm2", "terse"), ("other", "x")]
    assert loaded_adapters(specs, None) == [("smollm2", "demo"), ("smollm2", "terse"), ("other", "x")]


def test_the_request_to_triton_names_the_adapter_as_the_vllm_backend_does() -> None:
    def sampling(params: GenerationParams) -> dict[str, Any]:
        request = build_request(params)
        raw = dict(zip([i.name for i in request.inputs], request.raw_input_contents, strict=True))
        return dict(json.loads(decode_first(raw["sampling_parameters"])))

    assert build_request(GenerationParams(model="smollm2", adapter="demo", prompt="hi")).model_name == "smollm2"
    assert sampling(GenerationParams(model="smollm2", adapter="demo", prompt="hi", max_tokens=5)) == {
        "max_tokens": 5,
        "lora_name": "demo",
    }
    assert "lora_name" not in sampling(GenerationParams(model="smollm2", prompt="hi"))


def test_the_model_applies_the_named_adapter_alone_and_every_other_request_explicitly_without(smollm2: Any) -> None:
    declared = ("demo", "terse")
    named = {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 4, "lora_name": "terse"})}
    body, chat, adapter, _ = smollm2._request_body(named, declared)
    assert not chat and adapter == "terse" and body["max_tokens"] == 4
    assert "lora_name" not in body and "lora" not in body  # the id is the adapter's place on the server it gets
    engine = smollm2._Engine(server=None, adapters=("terse", "demo"))
    assert engine.lora("terse") == [{"id": 0, "scale": 1.0}] and engine.lora("demo") == [{"id": 1, "scale": 1.0}]
    # A base request on a server with adapters names one at scale 0: without a `lora` list llama.cpp would keep
    # whatever adapter the slot ran last.
    assert engine.lora("") == [{"id": 0, "scale": 0.0}]
    assert smollm2._Engine(server=None, adapters=()).lora("") is None
    assert smollm2._request_body({"text_input": "hi"}, declared)[2] == ""
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'; this model declares: demo, terse"):
        smollm2._request_body({"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": "nope"})}, declared)


def test_max_loras_is_a_positive_integer_and_defaults_to_every_declared_adapter(smollm2: Any) -> None:
    assert smollm2._max_loras("", 3) == 3
    assert smollm2._max_loras(" 2 ", 3) == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(
            smollm2.pb_utils.TritonModelException, match=rf"max_loras: '{re.escape(bad)}' is not a positive integer"
        ):
            smollm2._max_loras(bad, 3)


class _Servers:
    """Stand-in for llama.cpp servers: each build is a server named by its loaded set; builds can be held."""

    def __init__(self) -> None:
        self.built: list[tuple[str, ...]] = []
        self.changes: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.building = threading.Event()

    def build(self, adapters: tuple[str, ...]) -> str:
        self.building.set()
        assert self.gate.wait(5)
        self.built.append(adapters)
        return "+".join(adapters) or "base"

    def changed(self, change: str, adapter: str) -> None:
        self.changes.append((change, adapter))


def test_engines_keep_at_most_max_loras_loaded_and_evict_the_least_recently_used(smollm2: Any) -> None:
    servers = _Servers()
    engines = smollm2._Engines(servers.build, ("a", "b", "c"), 2, servers.changed)
    assert servers.built == [("a", "b")] and engines.loaded() == ("a", "b")
    for adapter in ("a", "", "b", "a"):  # loaded ones (and the base model) run on the server there is
        engines.release(engines.acquire(adapter))
    assert servers.built == [("a", "b")] and engines.loaded() == ("b", "a")
    engine = engines.acquire("c")  # b is the least recently used
    assert engine.server == "a+c" and engine.lora("c") == [{"id": 1, "scale": 1.0}]
    engines.release(engine)
    engines.release(engines.acquire("b"))  # a now: c was used after it
    assert servers.built == [("a", "b"), ("a", "c"), ("c", "b")]
    assert servers.changes == [("load", "a"), ("load", "b"), ("unload", "b"), ("load", "c")] + [
        ("unload", "a"),
        ("load", "b"),
    ]


def test_engines_with_a_bound_of_one_swap_and_keep_the_old_server_for_its_running_requests(smollm2: Any) -> None:
    servers = _Servers()
    engines = smollm2._Engines(servers.build, ("a", "b"), 1, servers.changed)
    running_a = engines.acquire("a")
    running_b = engines.acquire("b")
    assert (running_a.server, running_b.server) == ("a", "b")
    # The old server still runs a request: the next load waits until it is dropped (two servers at most).
    waiter: list[Any] = []
    thread = threading.Thread(target=lambda: waiter.append(engines.acquire("a")))
    servers.building.clear()
    thread.start()
    assert not servers.building.wait(0.2) and not waiter
    assert engines.acquire("").server == "b"  # the base model runs meanwhile, on the current server
    engines.release(running_a)
    thread.join(5)
    assert waiter[0].server == "a" and servers.built == [("a",), ("b",), ("a",)]
    assert engines.loaded() == ("a",)


def test_engines_load_one_at_a_time_and_requests_for_that_adapter_wait_for_its_load(smollm2: Any) -> None:
    servers = _Servers()
    engines = smollm2._Engines(servers.build, ("a", "b", "c"), 2, servers.changed)
    servers.gate.clear()
    servers.building.clear()
    got: list[str] = []

    def run(adapter: str) -> None:
        engine = engines.acquire(adapter)
        got.append(f"{adapter}@{engine.server}")
        engines.release(engine)

    threads = [threading.Thread(target=run, args=(adapter,)) for adapter in ("c", "c", "c")]
    for thread in threads:
        thread.start()
    assert servers.building.wait(5)
    run("a")  # a loaded adapter does not wait for the load
    assert got == ["a@a+b"]
    servers.gate.set()
    for thread in threads:
        thread.join(5)
    assert got[1:] == ["c@b+c"] * 3 and servers.built == [
        ("a", "b"),
        ("b", "c"),
    ]  # the set was chosen as the load began


def test_the_model_resolves_adapter_paths_against_its_folder_and_names_what_is_wrong(
    smollm2: Any, tmp_path: Path
) -> None:
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "demo.gguf").write_bytes(b"GGUF")
    elsewhere = tmp_path / "t.gguf"
    elsewhere.write_bytes(b"GGUF")
    assert smollm2._adapters(f"demo=adapters/demo.gguf,terse={elsewhere}", str(tmp_path)) == [
        ("demo", str(tmp_path / "adapters" / "demo.gguf")),
        ("terse", str(elsewhere)),
    ]
    assert smollm2._adapters("", str(tmp_path)) == []
    with pytest.raises(smollm2.pb_utils.TritonModelException, match=r"'gone': no file .*gone\.gguf"):
        smollm2._adapters("gone=gone.gguf", str(tmp_path))
    with pytest.raises(smollm2.pb_utils.TritonModelException, match=r"'a:b=adapters/demo\.gguf' is not name=path"):
        smollm2._adapters("a:b=adapters/demo.gguf", str(tmp_path))
    with pytest.raises(smollm2.pb_utils.TritonModelException, match=r"'demo' is named twice"):
        smollm2._adapters("demo=adapters/demo.gguf,demo=adapters/demo.gguf", str(tmp_path))


UNLOADING = "the model is unloading; send the request again once it is loaded"


def _acquire_in_thread(engines: Any, adapter: str, errors: list[str]) -> threading.Thread:
    """A request for adapter on its own thread; the error it ends with is appended to errors."""

    def run() -> None:
        try:
            engines.acquire(adapter)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_an_unloading_model_ends_the_requests_waiting_for_a_load_and_starts_no_server(smollm2: Any) -> None:
    servers = _Servers()
    engines = smollm2._Engines(servers.build, ("a", "b", "c"), 1, servers.changed)
    running_a = engines.acquire("a")
    running_b = engines.acquire("b")  # a's server is kept for its request: the next load waits for it
    errors: list[str] = []
    waiting = _acquire_in_thread(engines, "c", errors)
    waiting.join(0.2)
    assert waiting.is_alive()
    engines.close()
    waiting.join(2)
    assert not waiting.is_alive() and errors == [UNLOADING]
    engines.release(running_a)  # a's server goes: still no load
    engines.release(running_b)
    assert servers.built == [("a",), ("b",)] and engines.loaded() == ()
    with pytest.raises(RuntimeError, match=UNLOADING):
        engines.acquire("")  # the base model too: there is no server left


def test_a_load_that_ends_after_the_model_began_unloading_is_not_put_in_service(smollm2: Any) -> None:
    servers = _Servers()
    engines = smollm2._Engines(servers.build, ("a", "b"), 1, servers.changed)
    servers.gate.clear()
    servers.building.clear()
    errors: list[str] = []
    loading = _acquire_in_thread(engines, "b", errors)
    assert servers.building.wait(5)
    engines.close()
    servers.gate.set()
    loading.join(5)
    assert errors == [UNLOADING] and servers.built == [("a",), ("b",)]
    assert engines.loaded() == () and servers.changes == [("load", "a")]


def test_a_request_whose_caller_went_away_while_it_waited_for_a_load_starts_none(smollm2: Any) -> None:
    servers = _Servers()
    engines = smollm2._Engines(servers.build, ("a", "b", "c"), 1, servers.changed)
    running_a = engines.acquire("a")
    engines.release(engines.acquire("b"))  # a's server is kept for its request: the next load waits for it
    gone = threading.Event()
    outcome: list[str] = []

    def request_for_c() -> None:
        try:
            engines.acquire("c", gone.is_set)
        except smollm2._Cancelled:
            outcome.append("cancelled")

    waiting = threading.Thread(target=request_for_c)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()
    gone.set()  # the caller cancels: the request ends without waiting for a's request
    waiting.join(2)
    assert not waiting.is_alive() and outcome == ["cancelled"]
    engines.release(running_a)
    assert servers.built == [("a",), ("b",)] and engines.loaded() == ("b",)  # c was never loaded, b not evicted


def test_a_replaced_server_with_no_request_left_is_torn_down_outside_the_lock(smollm2: Any) -> None:
    """A llama.cpp server's teardown takes ~60 ms: under the lock it would stall every request's acquire."""
    lock_free_at_teardown: list[bool] = []

    class Server:
        def __del__(self) -> None:
            def try_lock() -> None:
                got = engines._cond.acquire(timeout=0.5)
                if got:
                    engines._cond.release()
                lock_free_at_teardown.append(got)

            other = threading.Thread(target=try_lock)
            other.start()
            other.join()

    engines = smollm2._Engines(lambda adapters: Server(), ("a", "b"), 1, lambda change, adapter: None)
    engines.release(engines.acquire("b"))  # a's server, no request on it, goes
    assert lock_free_at_teardown == [True]
