"""One generation on Triton: a decoupled ``ModelStreamInfer`` call turned into backend events."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tritonclient.grpc import service_pb2_grpc

from tokenmesh.errors import classify_backend_message
from tokenmesh.v1 import worker_pb2
from tokenmesh.worker._backend import BackendError, Delta, Finished, Generation, GenerationParams
from tokenmesh.worker.triton._codec import MalformedBytes, _Outputs, build_request, last_events, logprobs_of


def _rpc_error_class(exc: grpc.aio.AioRpcError) -> worker_pb2.ErrorClass:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return worker_pb2.ERROR_CLASS_TIMEOUT
    if code == grpc.StatusCode.UNAVAILABLE:
        return worker_pb2.ERROR_CLASS_UNAVAILABLE
    return classify_backend_message(exc.details() or "")


class TritonGeneration(Generation):
    """One decoupled ``ModelStreamInfer`` call; cancelling it cancels the Triton request.

    The call is made with the generated gRPC stub, not tritonclient's
    ``stream_infer``: one write of a request built with raw contents, then
    reads, with no request-iterator task and no per-response wrapper objects
    (the worker's CPU per token competes with the engine on small machines).
    """

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub, params: GenerationParams) -> None:
        self._stub = stub
        self._params = params
        self._call: Any = None
        self._cancelled = False

    def cancel(self) -> None:
        """Cancel the gRPC call: Triton marks the request cancelled, the model stops."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[Delta | Finished]:
        """Deltas as Triton streams them, then Finished (or BackendError)."""
        completion_tokens = 0
        alternatives = self._params.logprobs
        if self._cancelled:
            yield Finished("cancelled", 0, 0)
            return
        call = self._open()
        try:
            await call.write(build_request(self._params))
            await call.done_writing()  # Triton ends the stream after the final response
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                if message.error_message:
                    error = message.error_message
                    raise BackendError(classify_backend_message(error), f"Triton: {error}")
                outputs = _Outputs(message.infer_response)
                text = outputs.text("text_output")
                tokens = outputs.uint("num_output_tokens")
                logprobs = () if alternatives is None else logprobs_of(outputs.text("logprobs"), alternatives)
                if not outputs.final:
                    completion_tokens += tokens
                    if text:
                        yield Delta(text, tokens, logprobs)
                    continue
                for event in last_events(
                    outputs.text("finish_reason"),
                    outputs.uint("num_input_tokens"),
                    outputs.uint("num_cached_tokens"),
                    text,
                    tokens,
                    completion_tokens,
                ):
                    yield dataclasses.replace(event, logprobs=logprobs) if isinstance(event, Delta) else event
                return
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling() != 0:
                raise  # our caller cancels us
            yield self._stopped(exc, completion_tokens)
            return
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            yield self._stopped(exc, completion_tokens)
            return
        except MalformedBytes as exc:
            # A broken response fails this generation, never the worker.
            raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, f"Triton sent a malformed response: {exc}") from exc
        finally:
            call.cancel()  # no-op once Triton ended the stream
        yield self._stopped(None, completion_tokens)

    def _open(self) -> Any:
        """The ModelStreamInfer call, carrying the trace context (its spans are children of the worker's)."""
        params = self._params
        try:
            call = self._call = self._stub.ModelStreamInfer(
                timeout=params.timeout_s, metadata=params.trace_context or None
            )
        except grpc.aio.UsageError as exc:  # "Channel is closed": the backend restarted or stopped meanwhile
            raise BackendError(worker_pb2.ERROR_CLASS_UNAVAILABLE, f"Triton: {exc} (backend restarting)") from exc
        return call

    def _stopped(self, exc: BaseException | None, completion_tokens: int) -> Finished:
        """Finished("cancelled") when cancel() stopped the call; otherwise why it stopped, raised.

        Args:
            exc: what ended the call early (None: Triton closed the stream before the final response).
            completion_tokens: tokens streamed so far.

        """
        if self._cancelled:
            return Finished("cancelled", 0, completion_tokens)
        if exc is None:
            raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, "Triton closed the stream before the final response")
        if isinstance(exc, grpc.aio.AioRpcError):
            raise BackendError(_rpc_error_class(exc), f"Triton: {exc.code().name}: {exc.details()}") from exc
        if isinstance(exc, asyncio.CancelledError):
            # Neither the caller nor cancel(): the channel was closed under the call
            # (the backend restarting), which grpc reports as a cancelled read.
            raise BackendError(worker_pb2.ERROR_CLASS_UNAVAILABLE, "Triton: the channel closed mid-stream") from exc
        raise exc
