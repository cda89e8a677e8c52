"""The HTTP APIs ``tokenmesh bench --target openai`` streams through: each one's request and its events.

``chat`` (``/chat/completions``), ``completions`` (``/completions``),
``responses`` (OpenAI's Responses API, ``/responses``) and ``messages``
(Anthropic's Messages API, ``/messages``), all read as Server-Sent Events as
they arrive. Each is measured the same way: TTFT is the first event that
carries text, ITL the gaps between such events, E2E the event that ends the
stream, output tokens the final usage. Where the API counts the tokens of each
event (chat and completions with ``continuous_usage_stats``, as tokenmesh and
vLLM do), an event's tokens are that count; otherwise (responses, messages;
a server without the option) each text event counts one, which only the
tokens-per-chunk figure and the throughput plot see.

Every request asks for the same thing: ``max_tokens`` (``max_output_tokens``
on responses) tokens, ``ignore_eos`` (vLLM's extension, which tokenmesh takes
on every route) unless ``--allow-eos``, and ``seed`` where the API has one
(chat and completions).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import orjson

from tokenmesh.bench.http1 import Response
from tokenmesh.bench.metrics import RequestResult
from tokenmesh.bench.prompts import Prompt

APIS = ("chat", "completions", "responses", "messages")
"""The API names ``--api`` takes (besides ``auto``: chat for prompts with messages, completions for the others)."""


def resolve(api: str, prompt: Prompt) -> str:
    """The API a prompt goes to: ``auto`` picks chat for messages, completions for a raw prompt."""
    if api != "auto":
        return api
    return "chat" if prompt.messages else "completions"


def request(
    api: str, prompt: Prompt, model: str, *, ignore_eos: bool, seed: int | None, usage_per_event: bool = True
) -> tuple[str, bytes]:
    """The path and JSON body of one streamed request to api (not ``auto``).

    ``usage_per_event`` (chat and completions): ask for ``continuous_usage_stats``, the tokens of each event;
    without it their events are as plain as the other APIs' (what ``benchmarks/gateway.py`` compares).

    Raises:
        ValueError: a prompt with messages for completions (a raw prompt takes no chat template).

    """
    messages = [{"role": role, "content": content} for role, content in prompt.messages] or [
        {"role": "user", "content": prompt.text}
    ]
    body: dict[str, Any] = {"model": model, "stream": True}
    if api == "completions":
        if prompt.messages:
            raise ValueError("--api completions takes raw prompts; these prompts have messages (use --api chat)")
        body.update(prompt=prompt.text, max_tokens=prompt.max_tokens)
    elif api == "chat":
        body.update(messages=messages, max_tokens=prompt.max_tokens)
    elif api == "responses":
        body.update(input=prompt.text if not prompt.messages else messages, max_output_tokens=prompt.max_tokens)
    else:  # messages: the system prompt is Anthropic's top-level field
        system = "\n".join(m["content"] for m in messages if m["role"] == "system")
        body.update(messages=[m for m in messages if m["role"] != "system"], max_tokens=prompt.max_tokens)
        if system:
            body["system"] = system
    if api in ("chat", "completions"):
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": usage_per_event}
        if seed is not None:
            body["seed"] = seed
    if ignore_eos:
        body["ignore_eos"] = True
    return _PATHS[api], orjson.dumps(body)


_PATHS = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "responses": "/responses",
    "messages": "/messages",
}


class StreamReader(abc.ABC):
    """One stream's events into its result; :meth:`event` says when the stream ended.

    Args:
        result: filled as the events arrive (text times and tokens, the end, the output tokens, an error).

    """

    result: RequestResult
    counted: int
    """Tokens of the text events so far."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.counted = 0

    @abc.abstractmethod
    def event(self, name: bytes, data: bytes, now: float) -> bool:
        """One event (its ``event:`` name, b"" when it has none, and its data); True when it ends the stream."""

    def text(self, now: float, tokens: int) -> None:
        """An event that carried text, and its tokens."""
        self.counted += tokens
        self.result.chunk_times.append(now)
        self.result.chunk_tokens.append(tokens)

    def end(self, now: float, output_tokens: int = 0, error: str | None = None) -> bool:
        """The stream ended at now, with the usage's output tokens (0: the text events' count) or an error."""
        self.result.ended = now
        self.result.error = error
        self.result.output_tokens = output_tokens or self.result.output_tokens or self.counted
        return True


class ChatReader(StreamReader):
    """Chat completions and completions: ``data:`` events, a usage event (``choices: []``), ``[DONE]``."""

    def event(self, name: bytes, data: bytes, now: float) -> bool:
        """A chunk, the usage event, an error event or the end."""
        if data == b"[DONE]":
            return self.end(now)
        item = orjson.loads(data)
        if "error" in item:
            return self.end(now, error=_code(item["error"], "code", "STREAM_ERROR"))
        choices = item.get("choices") or []
        text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "") for c in choices)
        usage = item.get("usage")
        if choices and text:
            self.text(now, max(0, int(usage.get("completion_tokens", 0)) - self.counted) if usage else 1)
        if usage and not choices:
            self.result.output_tokens = int(usage.get("completion_tokens", 0))
        return False


class ResponsesReader(StreamReader):
    """The Responses API: ``response.output_text.delta`` events, then ``response.completed`` or another end."""

    def event(self, name: bytes, data: bytes, now: float) -> bool:
        """A delta, the terminal event (its Response's usage), or an error."""
        if name == b"response.output_text.delta":
            if orjson.loads(data).get("delta"):
                self.text(now, 1)
            return False
        if name in (b"response.completed", b"response.incomplete", b"response.failed"):
            response = orjson.loads(data)["response"]
            tokens = int((response.get("usage") or {}).get("output_tokens") or 0)
            # incomplete at max_output_tokens is the length a benchmark asks for; cancelled or failed is not.
            status = response.get("status")
            error = None if status in ("completed", "incomplete") else _code(response.get("error"), "code", status)
            return self.end(now, tokens, error)
        if name == b"error":
            return self.end(now, error=_code(orjson.loads(data), "code", "STREAM_ERROR"))
        return False


class MessagesReader(StreamReader):
    """Anthropic's Messages API: ``content_block_delta`` events, ``message_delta`` (usage), ``message_stop``."""

    def event(self, name: bytes, data: bytes, now: float) -> bool:
        """A text delta, the usage, the end, or an error event."""
        if name == b"content_block_delta":
            if (orjson.loads(data).get("delta") or {}).get("text"):
                self.text(now, 1)
            return False
        if name == b"message_delta":
            self.result.output_tokens = int((orjson.loads(data).get("usage") or {}).get("output_tokens") or 0)
            return False
        if name == b"message_stop":
            return self.end(now)
        if name == b"error":
            return self.end(now, error=_code(orjson.loads(data).get("error"), "type", "STREAM_ERROR"))
        return False


READERS: dict[str, Callable[[RequestResult], StreamReader]] = {
    "chat": ChatReader,
    "completions": ChatReader,
    "responses": ResponsesReader,
    "messages": MessagesReader,
}


async def read(response: Response, reader: StreamReader, clock: Callable[[], float]) -> None:
    """Feed reader each event of response's body as it arrives; NO_END when the body ends before the stream did."""
    buffer = b""
    async for piece in response.pieces():
        now = clock()
        buffer += piece
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            name, data = b"", None
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                elif line.startswith(b"event:"):
                    name = line[6:].strip()
                # id lines and comments (keep-alive) say nothing measured
            if data is not None and reader.event(name, data, now):
                return
    reader.end(clock(), error="NO_END")


def _code(error: Any, key: str, default: str | None) -> str:
    """An error object's code (or Anthropic's type) in upper case, else default's."""
    code = error.get(key) if isinstance(error, dict) else None
    return str(code or default or "STREAM_ERROR").upper()
