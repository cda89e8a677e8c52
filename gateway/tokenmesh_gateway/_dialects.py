"""The dialects of the generation POSTs that resume with ``Last-Event-ID``: OpenAI's two and Anthropic's Messages.

Each says only how its body becomes a ``GenerateRequest`` and how its
answer is written (:class:`~tokenmesh_gateway._front.Dialect`); tenants,
draining, ids, spans and the exchange are the front's. Responses plugs into
the same front from :mod:`tokenmesh_gateway._responses_api` (its background
runs are its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import _anthropic, _openai
from tokenmesh_gateway._anthropic_sse import MessagesAnswer
from tokenmesh_gateway._front import Incoming
from tokenmesh_gateway._openai import Kind
from tokenmesh_gateway._sse import OpenAIAnswer


@dataclass(frozen=True)
class OpenAI:
    """``/v1/chat/completions`` or ``/v1/completions``."""

    kind: Kind

    def start(self, incoming: Incoming, request_id: str) -> tuple[inference_pb2.GenerateRequest, OpenAIAnswer]:
        """The chat or completion the body asks for, and its answer (streamed or whole)."""
        parsed = _openai.parse(incoming.body, self.kind, incoming.front.config.default_model)
        request = parsed.request
        incoming.identify(request, request_id)
        answer = OpenAIAnswer(
            self.kind,
            parsed.stream,
            parsed.include_usage,
            parsed.continuous_usage,
            request.model,
            int(time.time()),
            incoming.prefix,
        )
        return request, answer

    def resumed(self, incoming: Incoming, after: int) -> OpenAIAnswer:
        """A repeated POST's stream after ``after``, with the body's stream_options."""
        include, continuous = _openai.stream_flags(incoming.body)
        return self.resumed_answer(incoming, include, continuous, incoming.model())

    def resumed_answer(self, incoming: Incoming, include_usage: bool, continuous: bool, model: str) -> OpenAIAnswer:
        """A resumed stream's answer. Its chunks may name no model: the caller's (a repeated POST), else the default."""
        return OpenAIAnswer(
            self.kind,
            True,
            include_usage,
            continuous,
            model or incoming.front.config.default_model,
            int(time.time()),
            incoming.prefix,
        )


@dataclass(frozen=True)
class Messages:
    """``/v1/messages``: the same generation, answered in Anthropic's format."""

    kind: Kind = "chat"

    def start(self, incoming: Incoming, request_id: str) -> tuple[inference_pb2.GenerateRequest, MessagesAnswer]:
        """The Messages request the body asks for, and its answer."""
        parsed = _anthropic.parse(incoming.body, incoming.front.config.default_model)
        request = parsed.request
        incoming.identify(request, request_id)
        return request, MessagesAnswer(parsed.stream, request.model, incoming.prefix)

    def resumed(self, incoming: Incoming, after: int) -> MessagesAnswer:
        """The rest of that stream, without its opening events."""
        model = incoming.model() or incoming.front.config.default_model
        return MessagesAnswer(True, model, incoming.prefix, after=after)


CHAT = OpenAI("chat")
COMPLETION = OpenAI("completion")
MESSAGES = Messages()
