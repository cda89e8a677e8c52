"""Hostile input for the mesh's RPCs: random bytes and extreme field values, as hypothesis strategies.

Used by the short fuzz test in `make test` (tests/mesh/test_fuzz.py) and by the long run against a real
mesh (benchmarks/fuzz.py). Every call must end in a status code the caller can act on (never UNKNOWN or
INTERNAL, which mean a handler broke), and the services must keep serving.
"""

from __future__ import annotations

from hypothesis import strategies as st

from tokenmesh.v1 import inference_pb2, router_pb2, worker_pb2

BROKEN = {"UNKNOWN", "INTERNAL"}
"""Statuses that say a handler failed on its input instead of refusing it."""

texts = st.text(st.characters(codec="utf-8"), max_size=300)
huge_ints = st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1])
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)

generate_requests = st.builds(
    inference_pb2.GenerateRequest,
    model=st.one_of(st.just(""), texts),
    prompt=texts,
    messages=st.lists(
        st.builds(
            inference_pb2.ChatMessage,
            role=st.one_of(st.sampled_from(["user", "system", "assistant"]), texts),
            content=texts,
        ),
        max_size=4,
    ),
    max_tokens=st.one_of(huge_ints, st.integers(0, 64)),
    temperature=floats,
    top_p=floats,
    stop=st.lists(texts, max_size=20),
    seed=st.integers(0, 2**63 - 1),
    priority=st.integers(0, 5),
    request_id=st.one_of(st.just(""), texts),
    labels=st.dictionaries(texts, texts, max_size=20),
    ignore_eos=st.booleans(),
)
resume_requests = st.builds(inference_pb2.ResumeRequest, request_id=texts, after_seq=st.integers(0, 2**64 - 1))
cancel_requests = st.builds(inference_pb2.CancelRequest, request_id=texts)
weight_tables = st.builds(
    router_pb2.WeightTable,
    version=st.integers(0, 2**64 - 1),
    workers=st.lists(
        st.builds(
            router_pb2.WorkerWeight,
            address=texts,
            weight=st.floats(width=64),
            concurrency_limit=st.integers(0, 2**32 - 1),
            reason=texts,
        ),
        max_size=5,
    ),
)
worker_commands = st.builds(
    worker_pb2.WorkerCommand,
    start=generate_requests,
    first_seq=st.integers(0, 2**64 - 1),
    tokens_before=st.integers(0, 2**32 - 1),
    resumable=st.booleans(),
)
link_commands = st.builds(
    worker_pb2.LinkCommands,
    commands=st.lists(
        st.one_of(
            st.builds(
                worker_pb2.LinkCommand,
                stream=st.integers(0, 2**64 - 1),
                start=worker_commands,
                window_bytes=st.integers(0, 2**32 - 1),
            ),
            st.builds(worker_pb2.LinkCommand, stream=st.integers(0, 3), cancel=st.just(worker_pb2.CancelGeneration())),
            st.builds(worker_pb2.LinkCommand, stream=st.integers(0, 3), detach=st.just(worker_pb2.LinkDetach())),
        ),
        max_size=4,
    ),
    credit_stream=st.lists(st.integers(0, 2**64 - 1), max_size=4),
    credit_bytes=st.lists(st.integers(0, 2**32 - 1), max_size=4),
)

stream_commands = st.builds(
    inference_pb2.StreamCommands,
    commands=st.lists(
        st.one_of(
            st.builds(
                inference_pb2.StreamCommand,
                stream=st.integers(0, 2**64 - 1),
                generate=generate_requests,
                window_bytes=st.integers(0, 2**32 - 1),
                timeout_s=st.one_of(st.just(0.0), st.floats(allow_nan=True, allow_infinity=True)),
                metadata=st.dictionaries(texts, texts, max_size=4),
            ),
            st.builds(inference_pb2.StreamCommand, stream=st.integers(0, 2**64 - 1), resume=resume_requests),
            st.builds(
                inference_pb2.StreamCommand, stream=st.integers(0, 3), cancel=st.just(inference_pb2.StreamCancel())
            ),
            st.builds(
                inference_pb2.StreamCommand, stream=st.integers(0, 3), detach=st.just(inference_pb2.StreamDetach())
            ),
        ),
        max_size=4,
    ),
    credit_stream=st.lists(st.integers(0, 2**64 - 1), max_size=4),
    credit_bytes=st.lists(st.integers(0, 2**32 - 1), max_size=4),
)

# (method, kind, message strategy): kind is how the method takes its request.
TARGETS = [
    ("/tokenmesh.v1.Inference/Generate", "unary_stream", generate_requests),
    ("/tokenmesh.v1.Inference/Resume", "unary_stream", resume_requests),
    ("/tokenmesh.v1.Inference/Cancel", "unary_unary", cancel_requests),
    ("/tokenmesh.v1.Inference/ListModels", "unary_unary", st.just(inference_pb2.ListModelsRequest())),
    ("/tokenmesh.v1.Inference/GenerateStream", "stream_stream", stream_commands),
    ("/tokenmesh.v1.Router/GetRoutingTable", "unary_unary", st.just(router_pb2.GetRoutingTableRequest())),
    ("/tokenmesh.v1.Control/PushWeights", "stream_stream", weight_tables),
]
WORKER_TARGETS = [
    ("/tokenmesh.v1.Worker/Generate", "stream_stream", worker_commands),
    (
        "/tokenmesh.v1.Worker/Attach",
        "unary_stream",
        st.builds(worker_pb2.AttachRequest, request_id=texts, after_seq=st.integers(0, 2**64 - 1)),
    ),
    ("/tokenmesh.v1.Worker/Cancel", "unary_unary", cancel_requests),
    ("/tokenmesh.v1.Worker/Link", "stream_stream", link_commands),
    ("/tokenmesh.v1.Worker/Stats", "stream_stream", st.builds(worker_pb2.StatsPing, ping_id=st.integers(0, 2**64 - 1))),
    ("/tokenmesh.v1.Worker/Describe", "unary_unary", st.just(worker_pb2.DescribeRequest())),
]


def payloads(targets: list[tuple[str, str, st.SearchStrategy]]) -> st.SearchStrategy:
    """(method, kind, request bytes): a serialized message of the method's type, or random bytes."""

    def one(target: tuple[str, str, st.SearchStrategy]) -> st.SearchStrategy:
        method, kind, messages = target
        return st.tuples(
            st.just(method),
            st.just(kind),
            st.one_of(messages.map(lambda m: m.SerializeToString()), st.binary(max_size=512)),
        )

    return st.one_of(*(one(t) for t in targets))


def call(channel, method: str, kind: str, data: bytes, timeout: float = 5.0) -> str:  # noqa: ANN001
    """Send data raw to method; return the status code's name ("OK" when it answered normally)."""
    import grpc

    try:
        if kind == "unary_unary":
            channel.unary_unary(method)(data, timeout=timeout)
        elif kind == "unary_stream":
            for _ in channel.unary_stream(method)(data, timeout=timeout):
                pass
        else:
            for _ in channel.stream_stream(method)(iter([data]), timeout=timeout):
                pass
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return "OK"
