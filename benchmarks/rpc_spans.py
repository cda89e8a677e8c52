"""What an RPC span costs a call and its messages: a plain channel, the client interceptors, the traced channel.

One process (client and server together, so the figures include the
server's side, the same for all three) makes --calls bidirectional calls,
--concurrency at a time, shaped as the router's calls to a worker: one
``call.write()``, then ``call.read()`` until the end of --messages responses.
Per variant, alternated --rounds times, it prints the CPU per call: on a plain
channel; with ``tokenmesh.tracing.client_interceptors`` (grpc.aio client
interceptors); through ``tokenmesh.tracing.traced_channel`` (what the mesh's
channels use). Spans go to an exporter that drops them, one at a time. Run
it with two --messages values to split the cost per call from the cost per
message.

    PYTHONPATH=services .venv/bin/python benchmarks/rpc_spans.py --messages 200
    PYTHONPATH=services .venv/bin/python benchmarks/rpc_spans.py --messages 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tokenmesh.__main__ import set_grpc_defaults

set_grpc_defaults(os.environ)  # as the services run (before grpc is imported)

import grpc  # noqa: E402 - after the gRPC settings
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402

from tokenmesh.tracing import Tracing, client_interceptors, traced_channel  # noqa: E402

METHOD = "/bench.Worker/Generate"


class _Dropped(SpanExporter):
    """Takes every span, sends none."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class _Dropping(Tracing):
    """Tracing on, its spans ended one at a time into :class:`_Dropped` (no collector needed)."""

    def __init__(self) -> None:
        super().__init__("bench", enabled=False)
        self._provider = TracerProvider()
        self._provider.add_span_processor(SimpleSpanProcessor(_Dropped()))
        self.tracer = self._provider.get_tracer("bench")


async def _call(make: Callable[..., Any]) -> None:
    call = make()
    await call.write(b"start")
    while await call.read() is not grpc.aio.EOF:
        pass


async def _run(channel: grpc.aio.Channel, calls: int, concurrency: int) -> float:
    """CPU microseconds per call (this process: client and server)."""
    make: Any = channel.stream_stream(METHOD)
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            await _call(make)

    started = time.process_time()
    await asyncio.gather(*(one() for _ in range(calls)))
    return (time.process_time() - started) / calls * 1e6


async def main(args: argparse.Namespace) -> None:
    async def generate(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        async for _ in requests:
            break
        message = b"x" * 40
        for _ in range(args.messages):
            yield message

    server = grpc.aio.server()
    handler: Any = grpc.stream_stream_rpc_method_handler(generate)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Worker", {"Generate": handler}),))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    tracing = _Dropping()
    variants: dict[str, Callable[[], grpc.aio.Channel]] = {
        "plain": lambda: grpc.aio.insecure_channel(address),
        "interceptors": lambda: grpc.aio.insecure_channel(address, interceptors=client_interceptors(tracing, address)),
        "traced channel": lambda: traced_channel(tracing, grpc.aio.insecure_channel(address), address),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(args.rounds):
            for name, open_ in variants.items():
                async with open_() as channel:
                    await _run(channel, args.concurrency, args.concurrency)  # warm-up: connected, first calls
                    results[name].append(await _run(channel, args.calls, args.concurrency))
    finally:
        await server.stop(None)
        tracing.shutdown()
    print(f"{args.calls} calls of 1 write and {args.messages} messages read, {args.concurrency} at a time")
    for name, runs in results.items():
        spread = " ".join(f"{r:.0f}" for r in runs)
        print(f"{name:15} {statistics.median(runs):8.0f} us CPU per call (median; runs: {spread})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200, help="responses per call")
    parser.add_argument("--calls", type=int, default=300, help="calls per run")
    parser.add_argument("--concurrency", type=int, default=12, help="calls at once")
    parser.add_argument("--rounds", type=int, default=5, help="runs per variant, alternated")
    asyncio.run(main(parser.parse_args()))
