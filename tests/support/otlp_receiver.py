"""An OTLP/gRPC trace receiver for tests (opentelemetry-proto's TraceService on 127.0.0.1:0), keeping every span."""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = 0

    async def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:  # noqa: N802
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    async def start(self) -> str:
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.server.stop(0)

    def spans(self) -> list[tuple[str, trace_pb2.Span]]:
        """(service.name, span) for every span received."""
        found = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), ""
                )
                for scope in resource_spans.scope_spans:
                    found += [(service, span) for span in scope.spans]
        return found

    def raw(self) -> bytes:
        """Every request as bytes (to look for text that must not be there)."""
        return b"".join(r.SerializeToString() for r in self.requests)


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        values[a.key] = [getattr(v, v.WhichOneof("value")) for v in value.values] if kind == "array_value" else value
    return values
