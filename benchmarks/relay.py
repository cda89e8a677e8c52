"""The one-hop grpc.aio relay baseline: a token source and one Python relay in front of it.

Both speak ``tokenmesh.v1.Inference`` (Generate, ListModels), so the same
client drives them and the mesh. The source streams like the synthetic Triton
model: ``--tokens-per-s`` per stream in chunks of ``--chunk-tokens``, seq 1..N,
then a final chunk with usage. The relay forwards each chunk of one source
stream as it arrives (what the cheapest possible router does).

    python benchmarks/relay.py source --port 50700
    python benchmarks/relay.py relay --port 50701 --upstream 127.0.0.1:50700
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import uvloop

from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

MODEL = "synthetic"


class Source(inference_pb2_grpc.InferenceServicer):
    """Placeholder tokens at a fixed rate per stream."""

    def __init__(self, tokens_per_s: float, chunk_tokens: int) -> None:
        self.interval = chunk_tokens / tokens_per_s
        self.chunk_tokens = chunk_tokens

    async def Generate(
        self,
        request: inference_pb2.GenerateRequest,  # noqa: N802
        context: Any,
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """max_tokens tokens at the rate, then the final chunk."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        sent, seq = 0, 0
        while sent < request.max_tokens:
            due += self.interval
            await asyncio.sleep(max(0.0, due - loop.time()))
            count = min(self.chunk_tokens, request.max_tokens - sent)
            seq += 1
            yield inference_pb2.GenerateChunk(
                request_id=request.request_id,
                seq=seq,
                token_count=count,
                model=MODEL,
                text="".join(f" t{i}" for i in range(sent, sent + count)),
            )
            sent += count
        yield inference_pb2.GenerateChunk(
            request_id=request.request_id,
            seq=seq + 1,
            model=MODEL,
            finish_reason=inference_pb2.FINISH_REASON_LENGTH,
            usage=inference_pb2.Usage(prompt_tokens=len(request.prompt.split()), completion_tokens=sent),
        )

    async def ListModels(
        self,
        request: inference_pb2.ListModelsRequest,  # noqa: N802
        context: Any,
    ) -> inference_pb2.ListModelsResponse:
        """The one model."""
        return inference_pb2.ListModelsResponse(models=[inference_pb2.ModelInfo(name=MODEL, is_default=True)])


class Relay(inference_pb2_grpc.InferenceServicer):
    """Forwards each Generate to the upstream, chunk by chunk."""

    def __init__(self, upstream: str) -> None:
        self.channel = grpc.aio.insecure_channel(upstream)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    async def Generate(
        self,
        request: inference_pb2.GenerateRequest,  # noqa: N802
        context: Any,
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """The upstream's chunks as they arrive."""
        async for chunk in self.stub.Generate(request):
            yield chunk

    async def ListModels(
        self,
        request: inference_pb2.ListModelsRequest,  # noqa: N802
        context: Any,
    ) -> inference_pb2.ListModelsResponse:
        """The upstream's models."""
        return await self.stub.ListModels(request)


async def serve(args: argparse.Namespace) -> None:
    server = grpc.aio.server()
    servicer = Source(args.tokens_per_s, args.chunk_tokens) if args.role == "source" else Relay(args.upstream)
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("source", "relay"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", default="", help="relay: the source's host:port")
    parser.add_argument("--tokens-per-s", type=float, default=1000.0, help="source: per stream (default 1000)")
    parser.add_argument("--chunk-tokens", type=int, default=5, help="source: tokens per chunk (default 5)")
    uvloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
