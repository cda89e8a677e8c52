"""Bad input to every RPC, against real servers on 127.0.0.1:0 (two workers over FakeBackend and a router).

Each case checks the status code, that the message tells the caller what to
change, and that a generation running meanwhile, and one started after, are
untouched. Worker RPCs that answer wrongly are xfail(strict=True), with the
expected and actual answer in the reason: the worker is fixed elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from tests.support.mesh import InProcessMesh, assert_exact, expected_text
from tokenmesh.errors import rpc_error
from tokenmesh.v1 import (
    inference_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNKNOWN_FIELD = b"\xf8\x06\x01"
"""Field 111 = 1 (varint): a field no tokenmesh message has."""


@dataclass(frozen=True)
class Case:
    send: Callable[[InProcessMesh], Awaitable[Any]]
    """Makes the bad call (it must raise the call's AioRpcError)."""
    code: grpc.StatusCode
    needles: tuple[str, ...]
    """What the message must say."""
    wrong: str = ""
    """Where the service answers otherwise today: expected vs actual (the case is xfail)."""


def chat(*messages: tuple[str, str]) -> list[inference_pb2.ChatMessage]:
    return [inference_pb2.ChatMessage(role=role, content=content) for role, content in messages]


async def read_rest(call: grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall) -> list[Any]:
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    return rest


# -- Inference ---------------------------------------------------------------------------------------------------


def generate(**fields: Any) -> Callable[[InProcessMesh], Awaitable[Any]]:
    async def send(mesh: InProcessMesh) -> Any:
        return [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(**fields), timeout=5)]

    return send


async def generate_with_a_live_request_id(mesh: InProcessMesh) -> None:
    first = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="a", max_tokens=400, request_id="dup"))
    try:
        await first.read()
        await generate(prompt="b", request_id="dup")(mesh)
    finally:
        first.cancel()


def resume(request_id: str, after_seq: int = 0, *, finished_first: bool = False) -> Callable[[InProcessMesh], Any]:
    async def send(mesh: InProcessMesh) -> Any:
        if finished_first:  # a generation the workers hold, finished: 3 chunks and the end, seq 1..4
            await generate(prompt="p", max_tokens=3, request_id=request_id)(mesh)
        request = inference_pb2.ResumeRequest(request_id=request_id, after_seq=after_seq)
        return [c async for c in mesh.inference.Resume(request, timeout=5)]

    return send


def cancel(request_id: str) -> Callable[[InProcessMesh], Awaitable[Any]]:
    async def send(mesh: InProcessMesh) -> Any:
        return await mesh.inference.Cancel(inference_pb2.CancelRequest(request_id=request_id), timeout=5)

    return send


def stream_call(*commands: inference_pb2.StreamCommand) -> Callable[[InProcessMesh], Awaitable[Any]]:
    """A GenerateStream carrying commands; the first stream that ends with a status raises it as its own call would."""

    async def send(mesh: InProcessMesh) -> Any:
        call = mesh.inference.GenerateStream(timeout=5)
        await call.write(inference_pb2.StreamCommands(commands=commands))
        await call.done_writing()
        messages = await read_rest(call)
        for end in (end for message in messages for end in message.ends):
            raise rpc_error(end.status)
        return messages

    return send


def stream_generate(stream: int = 1, timeout_s: float = 0, **fields: Any) -> inference_pb2.StreamCommand:
    return inference_pb2.StreamCommand(
        stream=stream, generate=inference_pb2.GenerateRequest(**fields), timeout_s=timeout_s
    )


def raw_unary(path: str, body: bytes, on_worker: bool = False) -> Callable[[InProcessMesh], Awaitable[Any]]:
    async def send(mesh: InProcessMesh) -> Any:
        address = mesh.workers[0].host.address if on_worker else mesh.router.host.address
        async with grpc.aio.insecure_channel(address) as channel:
            return await channel.unary_unary(path)(body, timeout=5)

    return send


def raw_stream(path: str, body: bytes, on_worker: bool = False) -> Callable[[InProcessMesh], Awaitable[Any]]:
    async def send(mesh: InProcessMesh) -> Any:
        address = mesh.workers[0].host.address if on_worker else mesh.router.host.address
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.stream_stream(path)(timeout=5)
            await call.write(body)
            await call.done_writing()
            return await read_rest(call)

    return send


# -- Control -----------------------------------------------------------------------------------------------------


def push(address: str | None, weight: float) -> Callable[[InProcessMesh], Awaitable[Any]]:
    async def send(mesh: InProcessMesh) -> Any:
        table = router_pb2.WeightTable(
            version=9, workers=[router_pb2.WorkerWeight(address=address or mesh.workers[0].host.address, weight=weight)]
        )
        call = router_pb2_grpc.ControlStub(mesh.channel).PushWeights(timeout=5)
        await call.write(table)
        return await call.read()

    return send


# -- Worker (called directly, as a router or the prober does) ------------------------------------------------------


def worker_generate(*commands: worker_pb2.WorkerCommand) -> Callable[[InProcessMesh], Awaitable[Any]]:
    async def send(mesh: InProcessMesh) -> Any:
        async with grpc.aio.insecure_channel(mesh.workers[0].host.address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Generate(timeout=5)
            for command in commands:
                await call.write(command)
            await call.done_writing()
            return await read_rest(call)

    return send


def worker_link(*commands: worker_pb2.LinkCommand) -> Callable[[InProcessMesh], Awaitable[Any]]:
    """A Link carrying commands; the first stream that ends with a status raises it as its own call would."""

    async def send(mesh: InProcessMesh) -> Any:
        async with grpc.aio.insecure_channel(mesh.workers[0].host.address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Link(timeout=5)
            await call.write(worker_pb2.LinkCommands(commands=commands))
            await call.done_writing()
            messages = await read_rest(call)
        for end in (end for message in messages for end in message.ends):
            if end.HasField("status"):
                raise rpc_error(end.status)
        return messages

    return send


def link_start(stream: int = 1, **fields: Any) -> worker_pb2.LinkCommand:
    return worker_pb2.LinkCommand(stream=stream, start=start(**fields))


def start(**fields: Any) -> worker_pb2.WorkerCommand:
    fields.setdefault("request_id", "w-1")
    fields.setdefault("max_tokens", 3)
    return worker_pb2.WorkerCommand(start=inference_pb2.GenerateRequest(**fields))


def attach(request_id: str, after_seq: int = 0, *, held_first: bool = False) -> Callable[[InProcessMesh], Any]:
    async def send(mesh: InProcessMesh) -> Any:
        if held_first:  # a finished generation the worker keeps for resume: 3 chunks and the end, seq 1..4
            command = start(prompt="p", request_id=request_id)
            command.resumable = True
            await worker_generate(command)(mesh)
        async with grpc.aio.insecure_channel(mesh.workers[0].host.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            request = worker_pb2.AttachRequest(request_id=request_id, after_seq=after_seq)
            return [e async for e in stub.Attach(request, timeout=5)]

    return send


def worker_cancel(request_id: str) -> Callable[[InProcessMesh], Awaitable[Any]]:
    async def send(mesh: InProcessMesh) -> Any:
        async with grpc.aio.insecure_channel(mesh.workers[0].host.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            return await stub.Cancel(inference_pb2.CancelRequest(request_id=request_id), timeout=5)

    return send


MAX_TOKENS = "max_tokens must be 1..512 (the context size of 'fake')"
REQUIRED = "request_id is required: the one the generation was started with"
WEIGHT = "must be a number in [0, 1]"

CASES: dict[str, dict[str, Case]] = {
    "Inference/Generate": {
        "generate-empty": Case(generate(), INVALID, ("empty request: set prompt, or messages",)),
        "generate-prompt-and-messages": Case(
            generate(prompt="x", messages=chat(("user", "hi"))), INVALID, ("set either prompt or messages, not both",)
        ),
        "generate-bad-role": Case(
            generate(messages=chat(("user", "hi"), ("robot", "beep"))),
            INVALID,
            ("messages[1].role is 'robot'; use one of assistant, system, user",),
        ),
        "generate-nan-temperature": Case(
            generate(prompt="x", temperature=math.nan), INVALID, ("temperature must be >= 0, got nan",)
        ),
        "generate-negative-temperature": Case(
            generate(prompt="x", temperature=-0.5), INVALID, ("temperature must be >= 0, got -0.5",)
        ),
        "generate-top-p-0": Case(generate(prompt="x", top_p=0.0), INVALID, ("top_p must be in (0, 1], got 0",)),
        "generate-top-p-above-1": Case(generate(prompt="x", top_p=1.5), INVALID, ("top_p must be in (0, 1], got 1.5",)),
        "generate-unknown-priority": Case(
            generate(prompt="x", priority=9), INVALID, ("unknown priority 9; use PRIORITY_LOW, _NORMAL or _HIGH",)
        ),
        "generate-max-tokens-0": Case(generate(prompt="x", max_tokens=0), INVALID, (MAX_TOKENS, "got 0")),
        "generate-max-tokens-over-context": Case(
            generate(prompt="x", max_tokens=513), INVALID, (MAX_TOKENS, "got 513")
        ),
        "generate-prompt-too-large": Case(
            generate(prompt="x" * (1024 * 1024 + 1)),
            INVALID,
            ("prompt is 1048577 bytes; the limit is 1048576 bytes: shorten it",),
        ),
        "generate-messages-too-large": Case(
            generate(messages=chat(("system", "x" * 600_000), ("user", "y" * 600_000))),
            INVALID,
            ("prompt is 1200000 bytes; the limit is 1048576 bytes",),
        ),
        "generate-unknown-model": Case(
            generate(prompt="x", model="nope"), NOT_FOUND, ("unknown model 'nope'; available: fake",)
        ),
        "generate-live-request-id": Case(
            generate_with_a_live_request_id,
            grpc.StatusCode.ALREADY_EXISTS,
            ("request_id 'dup' is live already; use a new id, or Resume it",),
        ),
    },
    "Inference/Resume": {
        "resume-empty-id": Case(resume(""), INVALID, (REQUIRED,)),
        "resume-unknown-id": Case(
            resume("never-started"), NOT_FOUND, ("no worker holds generation 'never-started'", "resume grace period")
        ),
        "resume-after-seq-beyond": Case(
            resume("r-done", after_seq=99, finished_first=True),
            grpc.StatusCode.OUT_OF_RANGE,
            ("after_seq 99 is beyond the last seq sent, 4",),
        ),
    },
    "Inference/GenerateStream": {
        "generate-stream-negative-temperature": Case(
            stream_call(stream_generate(prompt="x", temperature=-0.5)),
            INVALID,
            ("temperature must be >= 0, got -0.5",),
        ),
        "generate-stream-unknown-model": Case(
            stream_call(stream_generate(prompt="x", model="nope")),
            NOT_FOUND,
            ("unknown model 'nope'; available: fake",),
        ),
        "generate-stream-resume-unknown-id": Case(
            stream_call(
                inference_pb2.StreamCommand(stream=1, resume=inference_pb2.ResumeRequest(request_id="never-started"))
            ),
            NOT_FOUND,
            ("no worker holds generation 'never-started'",),
        ),
        "generate-stream-id-0": Case(
            stream_call(stream_generate(0, prompt="x")),
            INVALID,
            ("commands.stream 0 is not above 0", "stream ids are > 0 and increase"),
        ),
        "generate-stream-negative-timeout": Case(
            stream_call(stream_generate(timeout_s=-1, prompt="x")),
            INVALID,
            ("commands.timeout_s must be a number of seconds >= 0 (0: none), got -1",),
        ),
        "undecodable-stream-commands": Case(
            raw_stream("/tokenmesh.v1.Inference/GenerateStream", b"\xff\xff\xff"),
            INVALID,
            ("not a valid tokenmesh.v1.StreamCommands",),
        ),
    },
    "Inference/Cancel": {
        "cancel-empty-id": Case(cancel(""), INVALID, (REQUIRED,)),
        "cancel-unknown-id": Case(
            cancel("never-started"), NOT_FOUND, ("no live generation with request_id 'never-started'",)
        ),
    },
    "Control/PushWeights": {
        "push-nan-weight": Case(push(None, math.nan), INVALID, ("workers[0]", "weight nan", WEIGHT)),
        "push-negative-weight": Case(push(None, -0.5), INVALID, ("workers[0]", "weight -0.5", WEIGHT)),
        "push-weight-above-1": Case(push(None, 1.01), INVALID, ("workers[0]", "weight 1.01", WEIGHT)),
        "push-bad-address": Case(
            push("worker-without-port", 1.0),
            INVALID,
            ("workers[0] ('worker-without-port'): address must be host:port",),
        ),
        "push-unconfigured-worker": Case(
            push("10.1.2.3:50061", 1.0),
            INVALID,
            ("workers[0] ('10.1.2.3:50061') is not one of this router's --workers", "--discovery prober"),
        ),
    },
    "Worker/Generate": {
        "worker-generate-cancel-first": Case(
            worker_generate(worker_pb2.WorkerCommand(cancel=worker_pb2.CancelGeneration(reason="x"))),
            INVALID,
            ("the first WorkerCommand must be `start` with the GenerateRequest",),
        ),
        "worker-generate-empty-stream": Case(
            worker_generate(), INVALID, ("the first WorkerCommand must be `start` with the GenerateRequest",)
        ),
        "worker-generate-no-request-id": Case(
            worker_generate(start(prompt="p", request_id="")),
            INVALID,
            ("start.request_id is required (the router assigns one)",),
        ),
        "worker-generate-unknown-model": Case(
            worker_generate(start(prompt="p", model="nope")),
            NOT_FOUND,
            ("model 'nope' is not served here; served: fake",),
        ),
        "worker-generate-empty-request": Case(
            worker_generate(start()), INVALID, ("empty request: set prompt, or messages",)
        ),
        "worker-generate-no-max-tokens": Case(
            worker_generate(worker_pb2.WorkerCommand(start=inference_pb2.GenerateRequest(prompt="p", request_id="w"))),
            INVALID,
            ("start.max_tokens is required",),
        ),
        "worker-generate-bad-role": Case(worker_generate(start(messages=chat(("robot", "beep")))), INVALID, ("role",)),
        "worker-generate-max-tokens-0": Case(
            worker_generate(start(prompt="p", max_tokens=0)), INVALID, ("max_tokens",)
        ),
        "worker-generate-nan-temperature": Case(
            worker_generate(start(prompt="p", temperature=math.nan)), INVALID, ("temperature",)
        ),
    },
    "Worker/Attach": {
        "worker-attach-unknown-id": Case(
            attach("never-started"), NOT_FOUND, ("no generation 'never-started' here", "resume grace period")
        ),
        "worker-attach-after-seq-beyond": Case(
            attach("held", after_seq=99, held_first=True),
            grpc.StatusCode.OUT_OF_RANGE,
            ("after_seq 99 is beyond the last seq sent, 4",),
        ),
        "worker-attach-empty-id": Case(attach(""), INVALID, ("request_id is required",)),
    },
    "Worker/Cancel": {
        "worker-cancel-unknown-id": Case(
            worker_cancel("never-started"), NOT_FOUND, ("no generation 'never-started' on this worker",)
        ),
        "worker-cancel-empty-id": Case(worker_cancel(""), INVALID, ("request_id is required",)),
    },
    "Worker/Link": {
        "worker-link-no-request-id": Case(
            worker_link(link_start(prompt="p", request_id="")),
            INVALID,
            ("start.request_id is required (the router assigns one)",),
        ),
        "worker-link-unknown-model": Case(
            worker_link(link_start(prompt="p", model="nope")),
            NOT_FOUND,
            ("model 'nope' is not served here; served: fake",),
        ),
        "worker-link-max-tokens-0": Case(worker_link(link_start(prompt="p", max_tokens=0)), INVALID, ("max_tokens",)),
        "worker-link-stream-0": Case(
            worker_link(link_start(0, prompt="p")), INVALID, ("stream 0 is not above 0", "stream ids are > 0")
        ),
        "undecodable-link-commands": Case(
            raw_stream("/tokenmesh.v1.Worker/Link", b"\xff\xff\xff", on_worker=True),
            INVALID,
            ("not a valid tokenmesh.v1.LinkCommands",),
        ),
    },
    # Bytes that are no message of the request type; ListModels stands for every unary RPC of every service.
    "Inference/ListModels": {
        "undecodable-request": Case(
            raw_unary("/tokenmesh.v1.Inference/ListModels", b"\xff\xff\xff"), INVALID, ("ListModelsRequest",)
        ),
        "undecodable-stream-message": Case(
            raw_stream("/tokenmesh.v1.Worker/Generate", b"\xff\xff\xff", on_worker=True),
            INVALID,
            ("not a valid tokenmesh.v1.WorkerCommand",),
        ),
    },
}
"""Per RPC (Service/Method), its cases by id."""


def params() -> list[Any]:
    return [
        pytest.param(case, id=name, marks=[pytest.mark.xfail(strict=True, reason=case.wrong)] if case.wrong else [])
        for cases in CASES.values()
        for name, case in cases.items()
    ]


@pytest.mark.parametrize("case", params())
async def test_bad_input_gets_a_status_that_says_what_to_change_and_harms_nothing_else(
    mesh: InProcessMesh,
    case: Case,
) -> None:
    for backend in mesh.backends:
        backend.delay = 0.005
    bystander = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="bystander", max_tokens=30), timeout=10)
    try:
        first = await bystander.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await case.send(mesh)
        assert info.value.code() == case.code, info.value
        details = info.value.details() or ""
        for needle in case.needles:
            assert needle in details, details
        chunks = [first, *await read_rest(bystander)]
    finally:
        bystander.cancel()
    # The stream that ran meanwhile is whole, and the router still serves.
    assert_exact(chunks, 30)
    after = [
        c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=2), timeout=5)
    ]
    assert after[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert "".join(c.text for c in after) == expected_text(2)


# -- RPCs with nothing to get wrong -------------------------------------------------------------------------------


async def list_models(mesh: InProcessMesh) -> None:
    response = inference_pb2.ListModelsResponse.FromString(
        await raw_unary("/tokenmesh.v1.Inference/ListModels", UNKNOWN_FIELD)(mesh)
    )
    assert [(m.name, m.workers) for m in response.models] == [("fake", 2)]


async def routing_table(mesh: InProcessMesh) -> None:
    response = router_pb2.RoutingTable.FromString(
        await raw_unary("/tokenmesh.v1.Router/GetRoutingTable", UNKNOWN_FIELD)(mesh)
    )
    assert sorted(w.address for w in response.workers) == sorted(w.host.address for w in mesh.workers)


async def describe(mesh: InProcessMesh) -> None:
    response = worker_pb2.DescribeResponse.FromString(
        await raw_unary("/tokenmesh.v1.Worker/Describe", UNKNOWN_FIELD, on_worker=True)(mesh)
    )
    assert [m.name for m in response.models] == ["fake"]


async def stats(mesh: InProcessMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.workers[0].host.address) as channel:
        call = channel.stream_stream(
            "/tokenmesh.v1.Worker/Stats", response_deserializer=worker_pb2.WorkerStats.FromString
        )(timeout=5)
        await call.write(worker_pb2.StatsPing(ping_id=7).SerializeToString() + UNKNOWN_FIELD)
        answer = await call.read()
        await call.done_writing()
        assert answer.ping_id == 7 and answer.concurrency_limit > 0 and answer.serving
        assert await read_rest(call) == []
        # A stream that sends no ping gets no stats, and ends OK.
        empty = worker_pb2_grpc.WorkerStub(channel).Stats(timeout=5)
        await empty.done_writing()
        assert await read_rest(empty) == [] and await empty.code() == grpc.StatusCode.OK


@pytest.mark.parametrize(
    "check",
    [list_models, routing_table, describe, stats],
    ids=["inference-list-models", "router-get-routing-table", "worker-describe", "worker-stats"],
)
async def test_an_rpc_without_inputs_ignores_unknown_fields_and_answers(
    mesh: InProcessMesh,
    check: Callable[[InProcessMesh], Awaitable[None]],
) -> None:
    await check(mesh)


NO_INPUT = {"Inference/ListModels", "Router/GetRoutingTable", "Worker/Describe", "Worker/Stats"}
"""The RPCs test_an_rpc_without_inputs_ignores_unknown_fields_and_answers covers."""


def test_every_rpc_has_a_case() -> None:
    services = [
        inference_pb2.DESCRIPTOR.services_by_name["Inference"],
        router_pb2.DESCRIPTOR.services_by_name["Router"],
        router_pb2.DESCRIPTOR.services_by_name["Control"],
        worker_pb2.DESCRIPTOR.services_by_name["Worker"],
    ]
    every = {f"{s.name}/{m.name}" for s in services for m in s.methods}
    assert set(CASES) | NO_INPUT == every


async def test_a_chat_for_a_prompt_only_model_is_a_caller_error_not_a_worker_failure() -> None:
    from tests.support.mesh import in_process_mesh

    async with in_process_mesh(backend_settings={"chat": False}) as mesh:
        chat = inference_pb2.GenerateRequest(max_tokens=3)
        chat.messages.add(role="user", content="hi")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in mesh.inference.Generate(chat)]
        assert info.value.code() == INVALID
        assert "takes a prompt only" in (info.value.details() or "")
        assert "send `prompt` with the chat template applied" in (info.value.details() or "")
        assert not any(b.started for b in mesh.backends)
        table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
        assert all(w.weight > 0 and "avoided" not in w.reason for w in table.workers)  # no worker blamed
        chunks = [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="hi", max_tokens=3))]
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
