"""Checks of a ``GenerateRequest`` that hold wherever it arrives: the router, and a worker called directly.

Each failure is an :class:`~tokenmesh.errors.InvalidArgument` that says what
to change. What depends on the model (``max_tokens`` against its context) is
checked by the caller once it knows the model.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema

from tokenmesh.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2

ROLES = frozenset({"system", "user", "assistant"})
"""Roles a chat message may have."""
MAX_LABELS = 16
"""Labels a request may carry (each one is held for the whole generation, by router and worker)."""
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_STOP = 16
"""Stop sequences a request may have (OpenAI allows 4; each is matched against every token)."""
MAX_STOP_CHARS = 512
MAX_REQUEST_ID_CHARS = 128
MAX_LOGIT_BIAS = 300
"""Tokens a request may bias (OpenAI's bound)."""
MAX_FORMAT_BYTES = 64 * 1024
"""The largest JSON Schema or grammar: each is compiled by the engine for the request."""
MAX_TOP_LOGPROBS = 20
"""Alternatives per position a request may ask for (OpenAI's bound; vLLM's default max_logprobs is 20)."""
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


def check_request(request: inference_pb2.GenerateRequest, max_prompt_bytes: int | None = None) -> None:
    """Raise InvalidArgument when the request's own fields cannot make a generation."""
    if bool(request.prompt) == bool(request.messages):
        if request.prompt:
            raise InvalidArgument("set either prompt or messages, not both", field="prompt")
        raise InvalidArgument(
            "empty request: set prompt, or messages with at least one {role, content}", field="prompt"
        )
    if max_prompt_bytes is not None:
        size = len(request.prompt.encode()) + sum(len(m.content.encode()) for m in request.messages)
        if size > max_prompt_bytes:
            raise InvalidArgument(
                f"prompt is {size} bytes; the limit is {max_prompt_bytes} bytes: shorten it", field="prompt"
            )
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"messages[{i}].role is {message.role!r}; use one of {', '.join(sorted(ROLES))}",
                field=f"messages[{i}].role",
            )
    if request.HasField("temperature") and not (request.temperature >= 0 and math.isfinite(request.temperature)):
        raise InvalidArgument(f"temperature must be >= 0, got {request.temperature}", field="temperature")
    if request.HasField("top_p") and not (0 < request.top_p <= 1):
        raise InvalidArgument(f"top_p must be in (0, 1], got {request.top_p}", field="top_p")
    check_sampling(request)
    if request.priority not in inference_pb2.Priority.values():
        raise InvalidArgument(
            f"unknown priority {request.priority}; use PRIORITY_LOW, _NORMAL or _HIGH", field="priority"
        )
    check_bounds(request)


def check_bounds(request: inference_pb2.GenerateRequest) -> None:
    """Raise InvalidArgument for fields past the limits that bound what one caller can make the mesh hold."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
        raise InvalidArgument(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters", field="request_id"
        )
    if len(request.labels) > MAX_LABELS:
        raise InvalidArgument(f"{len(request.labels)} labels; at most {MAX_LABELS}", field="labels")
    for key, value in request.labels.items():
        if not key or len(key) > MAX_LABEL_KEY_CHARS or not key.isprintable():
            raise InvalidArgument(
                f"label key {key[:MAX_LABEL_KEY_CHARS]!r}: 1..{MAX_LABEL_KEY_CHARS} printable characters",
                field="labels",
            )
        if len(value) > MAX_LABEL_VALUE_CHARS or not value.isprintable():
            raise InvalidArgument(
                f"label {key!r}: its value must be at most {MAX_LABEL_VALUE_CHARS} printable characters",
                field=f"labels[{key!r}]",
            )
    if len(request.stop) > MAX_STOP:
        raise InvalidArgument(f"{len(request.stop)} stop sequences; at most {MAX_STOP}", field="stop")
    for i, stop in enumerate(request.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}] must be 1..{MAX_STOP_CHARS} characters", field=f"stop[{i}]")


def _within(request: inference_pb2.GenerateRequest, name: str, low: float, high: float, *, open_low: bool) -> None:
    if not request.HasField(name):
        return
    value = getattr(request, name)
    inside = math.isfinite(value) and (low < value if open_low else low <= value) and value <= high
    if not inside:
        bound = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        raise InvalidArgument(f"{name} must be in {bound}, got {value:g}", field=name)


def check_sampling(request: inference_pb2.GenerateRequest) -> None:
    """Raise InvalidArgument for a sampling field or format no engine could take, naming the field."""
    if request.HasField("top_k") and request.top_k < 1:
        raise InvalidArgument("top_k must be >= 1 (leave it unset to sample from every token)", field="top_k")
    _within(request, "min_p", 0, 1, open_low=False)
    _within(request, "presence_penalty", -2, 2, open_low=False)
    _within(request, "frequency_penalty", -2, 2, open_low=False)
    _within(request, "repetition_penalty", 0, 2, open_low=True)
    if len(request.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(
            f"logit_bias has {len(request.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}", field="logit_bias"
        )
    for token, bias in request.logit_bias.items():
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise InvalidArgument(
                f"logit_bias[{token}] must be in [-100, 100], got {bias:g}", field=f"logit_bias[{token}]"
            )
    if request.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            f"top_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {request.top_logprobs}", field="top_logprobs"
        )
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs: set logprobs too", field="top_logprobs")
    if request.HasField("structured_output"):
        check_structured_output(request.structured_output)


def check_structured_output(output: inference_pb2.StructuredOutput) -> None:
    """Raise InvalidArgument unless the format is one an engine can compile (a schema that is one, a grammar...)."""
    kind = output.WhichOneof("format")
    if kind is None:
        raise InvalidArgument(
            "structured_output names no format: set json_schema, json_object, choice or grammar (or leave it unset)",
            field="structured_output",
        )
    if kind == "json_schema":
        json_schema(output.json_schema)
    elif kind == "choice":
        options = output.choice.options
        if not 1 <= len(options) <= MAX_CHOICES:
            raise InvalidArgument(
                f"structured_output.choice needs 1..{MAX_CHOICES} options, got {len(options)}",
                field="structured_output.choice.options",
            )
        for i, option in enumerate(options):
            if not 1 <= len(option) <= MAX_CHOICE_CHARS:
                raise InvalidArgument(
                    f"structured_output.choice.options[{i}] must be 1..{MAX_CHOICE_CHARS} characters",
                    field=f"structured_output.choice.options[{i}]",
                )
    elif kind == "grammar":
        grammar = output.grammar
        if len(grammar.encode()) > MAX_FORMAT_BYTES:
            raise InvalidArgument(
                f"structured_output.grammar is over {MAX_FORMAT_BYTES} bytes", field="structured_output.grammar"
            )
        if not any(line.lstrip().startswith("root") and "::=" in line for line in grammar.splitlines()):
            raise InvalidArgument(
                "structured_output.grammar must be GBNF with a rule `root ::= ...` (where the output starts)",
                field="structured_output.grammar",
            )


def json_schema(text: str) -> dict[str, Any]:
    """The JSON Schema in text, checked against its metaschema; InvalidArgument saying what is wrong otherwise.

    An engine handed a schema it cannot read may ignore it (llama.cpp does) and deliver free text as if it
    matched: no schema passes the router unchecked.
    """
    where = "structured_output.json_schema"
    if len(text.encode()) > MAX_FORMAT_BYTES:
        raise InvalidArgument(f"{where} is over {MAX_FORMAT_BYTES} bytes", field=where)
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{where} is not JSON: {exc}", field=where) from None
    if not isinstance(schema, dict):
        raise InvalidArgument(
            f"{where} must be a JSON object (a JSON Schema), got {type(schema).__name__}",
            field=where,
        )
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(part) for part in exc.absolute_path) or "(top)"
        raise InvalidArgument(f"{where} is not a valid JSON Schema at {path}: {exc.message}", field=where) from None
    remote = _remote_ref(schema)
    if remote is not None:
        raise InvalidArgument(
            f"{where} refers to {remote!r}: engines fetch nothing, so only local references (#/$defs/...) are "
            "allowed; put the referenced schema under $defs",
            field=where,
        )
    return schema


def _remote_ref(node: Any) -> str | None:
    """The first ``$ref`` outside the schema itself (an engine would ignore the constraint, not fetch it)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return ref
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            found = _remote_ref(item)
            if found is not None:
                return found
    return None


def check_max_tokens(request: inference_pb2.GenerateRequest, model: str, max_context: int) -> None:
    """Raise InvalidArgument unless max_tokens (when set) fits the model's context."""
    if request.HasField("max_tokens") and not (1 <= request.max_tokens <= max_context):
        raise InvalidArgument(
            f"max_tokens must be 1..{max_context} (the context size of {model!r}), got {request.max_tokens}",
            field="max_tokens",
            metadata={"model": model, "max_context": str(max_context)},
        )


def require_request_id(request_id: str) -> None:
    """Raise InvalidArgument for an empty request_id (Resume, Cancel, Attach)."""
    if not request_id:
        raise InvalidArgument("request_id is required: the one the generation was started with", field="request_id")
