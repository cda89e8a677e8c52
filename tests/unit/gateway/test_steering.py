"""The steering fields each dialect takes, read into the one GenerateRequest contract (``_steering``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import HttpError, _anthropic, _openai, _responses

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}


def chat(**fields: Any) -> inference_pb2.GenerateRequest:
    return _openai.parse({"messages": USER, **fields}, "chat").request


def test_the_sampling_extensions_and_logit_bias_are_taken_as_vllm_takes_them() -> None:
    request = chat(
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"42": -100, "7": 3},
    )
    assert (request.top_k, request.presence_penalty, request.frequency_penalty) == (40, 0.5, -0.5)
    assert request.min_p == pytest.approx(0.05) and request.repetition_penalty == pytest.approx(1.2)
    assert dict(request.logit_bias) == {42: -100.0, 7: 3.0}
    for every in (-1, 0):  # vLLM's "every token"
        assert not chat(top_k=every).HasField("top_k")
    assert not chat().HasField("min_p") and not chat().logit_bias


@pytest.mark.parametrize(
    ("response_format", "format_kind", "value"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
            "json_schema",
            SCHEMA,
        ),
        ({"type": "json_object"}, "json_object", None),
        ({"type": "text"}, None, None),
    ],
)
def test_response_format_becomes_the_structured_output(response_format: Any, format_kind: Any, value: Any) -> None:
    for kind, body in (("chat", {"messages": USER}), ("completion", {"prompt": "x"})):
        request = _openai.parse({**body, "response_format": response_format}, kind).request  # type: ignore[arg-type]
        assert request.structured_output.WhichOneof("format") == format_kind
        if value is not None:
            assert json.loads(request.structured_output.json_schema) == value


def test_vllms_guided_fields_are_one_format_each() -> None:
    assert json.loads(chat(guided_json=SCHEMA).structured_output.json_schema) == SCHEMA
    assert json.loads(chat(guided_json=json.dumps(SCHEMA)).structured_output.json_schema) == SCHEMA
    assert list(chat(guided_choice=["yes", "no"]).structured_output.choice.options) == ["yes", "no"]
    assert chat(guided_grammar='root ::= "a"').structured_output.grammar == 'root ::= "a"'
    with pytest.raises(HttpError, match="set one output format, not response_format and guided_json") as two:
        chat(response_format={"type": "json_object"}, guided_json=SCHEMA)
    assert two.value.param == "guided_json"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "the JSON Schema",
        ),
        ({"logit_bias": [1, 2]}, "logit_bias", "an object of token id"),
        ({"logit_bias": {"-3": 1}}, "logit_bias", "whole numbers"),
        ({"logit_bias": {"3": "ban"}}, "logit_bias[3]", "must be a number"),
        ({"top_k": 1.5}, "top_k", "integer"),
        ({"top_k": -2}, "top_k", ">= 1"),
        ({"guided_choice": "yes"}, "guided_choice", "list of strings"),
        ({"guided_grammar": 3}, "guided_grammar", "GBNF grammar"),
    ],
)
def test_a_bad_shape_is_a_400_naming_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(HttpError, match=words) as refused:
        chat(**fields)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_responses_text_format_is_the_flat_shape_and_messages_take_top_k() -> None:
    flat = {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}
    request = _responses.parse({"input": "hi", "text": {"format": flat}}).request
    assert json.loads(request.structured_output.json_schema) == SCHEMA
    assert _responses.parse({"input": "hi", "text": {"format": {"type": "json_object"}}}).request.HasField(
        "structured_output"
    )
    assert not _responses.parse({"input": "hi", "text": {"format": {"type": "text"}}}).request.HasField(
        "structured_output"
    )
    assert _anthropic.parse({"messages": USER, "max_tokens": 4, "top_k": 5}).request.top_k == 5


def test_a_schema_that_is_none_is_refused_naming_the_callers_own_field() -> None:
    bad = {"type": "nonsense"}
    with pytest.raises(HttpError, match=r"response_format.json_schema.schema is not a valid JSON Schema") as openai:
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    assert openai.value.param == "response_format.json_schema.schema"
    with pytest.raises(HttpError, match="only local references") as responses:
        _responses.parse(
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "http://x/s"}}}}
        )
    assert responses.value.param == "text.format.schema"
    with pytest.raises(HttpError) as guided:
        chat(guided_json=bad)
    assert guided.value.param == "guided_json"


def test_the_proto_bounds_are_the_gateways_the_rest_the_routers() -> None:
    # uint32 is what the proto can carry: past it is the gateway's 400; inside it, ranges are the router's
    with pytest.raises(HttpError) as top_k:
        chat(top_k=2**32)
    assert top_k.value.param == "top_k"
    with pytest.raises(HttpError, match="whole numbers") as token:
        chat(logit_bias={str(2**32): 1})
    assert token.value.param == "logit_bias"
    request = chat(top_k=2**32 - 1, logit_bias={str(2**32 - 1): 500}, min_p=7, repetition_penalty=0)
    assert (request.top_k, dict(request.logit_bias)) == (2**32 - 1, {2**32 - 1: 500.0})
    assert (request.min_p, request.repetition_penalty) == (7, 0)  # out of range: the router's INVALID_ARGUMENT


def test_completions_take_the_same_fields() -> None:
    body = {"prompt": "x", "top_k": 3, "presence_penalty": 1, "logit_bias": {"5": 1}, "guided_choice": ["a", "b"]}
    request = _openai.parse(body, "completion").request
    assert (request.top_k, request.presence_penalty, dict(request.logit_bias)) == (3, 1.0, {5: 1.0})
    assert list(request.structured_output.choice.options) == ["a", "b"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_choice": ["a"], "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "guided_grammar": "g"}, "guided_grammar"),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"guided_json": "{bad"}, "guided_json"),  # JSON text that does not parse: a 400, never a 500
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": 1}}, "response_format.type"),
    ],
)
def test_more_bad_formats_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(HttpError) as refused:
        chat(**fields)
    assert (refused.value.status, refused.value.param) == (400, param)


STILL_REFUSED: list[tuple[str, Any]] = [
    ("min_tokens", 5),
    ("stop_token_ids", [2]),
    ("prompt_logprobs", 1),
    ("bad_words", ["x"]),
    ("function_call", "auto"),
    ("structured_outputs", {"regex": "a+"}),
    ("audio", {"voice": "alloy"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("modalities", ["text", "audio"]),
]


@pytest.mark.parametrize(("name", "value"), STILL_REFUSED)
def test_what_the_mesh_cannot_honour_is_still_refused(name: str, value: Any) -> None:
    with pytest.raises(HttpError, match="not supported by tokenmesh") as refused:
        chat(**{name: value})
    assert refused.value.param == name


def test_the_responses_object_repeats_the_callers_format() -> None:
    flat = {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}
    assert _responses.parse({"input": "hi", "text": {"format": flat}}).echo.text_format == flat
    assert _responses.parse({"input": "hi"}).echo.text_format == {"type": "text"}
    assert _responses.parse({"input": "hi", "text": {"format": None}}).echo.text_format == {"type": "text"}


def test_messages_take_output_format_and_not_the_openai_penalties() -> None:
    body = {"messages": USER, "max_tokens": 4, "output_format": {"type": "json_schema", "schema": SCHEMA}}
    request = _anthropic.parse({**body, "min_p": 0.5, "logit_bias": {"1": 5}}).request
    assert json.loads(request.structured_output.json_schema) == SCHEMA
    # Anthropic has no penalties: like any field it does not know, they are ignored
    assert not request.HasField("min_p") and not request.logit_bias
    with pytest.raises(HttpError) as refused:
        _anthropic.parse({**body, "output_format": {"type": "json_schema"}})
    assert refused.value.param == "output_format.schema"
