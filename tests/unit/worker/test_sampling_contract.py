"""The sampling and structured-output contract: checked at the router, one tensor contract to both engines.

The worker maps a request onto the vLLM backend's ``sampling_parameters`` (and its ``return_*`` inputs) once;
the CPU model reads the same JSON into llama.cpp's fields. Bad values are refused naming the field, and a
structured generation is never continued after a worker failure.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenmesh.errors import Aborted, InvalidArgument
from tokenmesh.router._generation import Progress
from tokenmesh.router._relay import STRUCTURED_NOT_CONTINUED, continuation
from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.validation import check_request
from tokenmesh.worker import GenerationParams, ModelSpec
from tokenmesh.worker._registry import Record
from tokenmesh.worker._servicer import generation_params
from tokenmesh.worker.triton import build_request, decode_first
from tokenmesh.worker.triton._codec import logprobs_of
from tokenmesh.worker.triton._sse import _http_request

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "color": {"enum": ["red", "blue"]}, "tags": {"type": "array"}},
    "required": ["name", "color", "tags"],
}


def request(**fields: Any) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt="hi", **fields)


def structured(**fields: Any) -> inference_pb2.GenerateRequest:
    return request(structured_output=inference_pb2.StructuredOutput(**fields))


@pytest.mark.parametrize(
    ("bad", "field", "says"),
    [
        (request(top_k=0), "top_k", "top_k must be >= 1"),
        (request(min_p=1.5), "min_p", r"min_p must be in \[0, 1\], got 1.5"),
        (request(presence_penalty=-3), "presence_penalty", r"in \[-2, 2\]"),
        (request(frequency_penalty=float("nan")), "frequency_penalty", "got nan"),
        (request(repetition_penalty=0), "repetition_penalty", r"in \(0, 2\]"),
        (request(logit_bias={7: -101}), "logit_bias[7]", r"logit_bias\[7\] must be in \[-100, 100\]"),
        (request(logit_bias={i: 1.0 for i in range(301)}), "logit_bias", "at most 300"),
        (structured(), "structured_output", "names no format"),
        (structured(json_schema="{"), "structured_output.json_schema", "is not JSON"),
        (structured(json_schema="[1]"), "structured_output.json_schema", "must be a JSON object"),
        (structured(json_schema='{"type": "nonsense"}'), "structured_output.json_schema", "not a valid JSON Schema"),
        (
            structured(json_schema='{"properties": {"a": {"$ref": "https://example.com/a.json"}}}'),
            "structured_output.json_schema",
            "only local references",
        ),
        (structured(choice=inference_pb2.Choice()), "structured_output.choice.options", "needs 1..256 options"),
        (structured(choice=inference_pb2.Choice(options=["a", ""])), "structured_output.choice.options[1]", "1..1024"),
        (structured(grammar='start ::= "a"'), "structured_output.grammar", "root ::="),
    ],
)
def test_a_bad_sampling_field_or_format_is_refused_naming_it(
    bad: inference_pb2.GenerateRequest, field: str, says: str
) -> None:
    with pytest.raises(InvalidArgument, match=says) as raised:
        check_request(bad)
    assert [violation.field for violation in raised.value.field_violations] == [field]


def test_good_values_pass() -> None:
    check_request(
        request(
            top_k=40,
            min_p=0.05,
            presence_penalty=2,
            frequency_penalty=-2,
            repetition_penalty=1.1,
            logit_bias={42: -100, 7: 100},
            structured_output=inference_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
        )
    )
    check_request(structured(json_object=inference_pb2.JsonObject()))
    check_request(structured(choice=inference_pb2.Choice(options=["yes", "no"])))
    check_request(structured(grammar='root ::= "yes" | "no"'))
    check_request(structured(json_schema='{"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"}'))


def _sampling_and_flags(params: GenerationParams) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The sampling_parameters JSON and every other input of the gRPC request built for params."""
    built = build_request(params)
    raw = dict(zip([i.name for i in built.inputs], built.raw_input_contents, strict=True))
    return json.loads(decode_first(raw.pop("sampling_parameters"))), raw


def test_the_worker_sends_every_field_as_the_vllm_backend_reads_it() -> None:
    start = request(
        max_tokens=9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logit_bias={42: -100},
        structured_output=inference_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    )
    spec = ModelSpec(name="vllm_model", max_context=4096, slots=8, chat=False, flags=("return_num_input_tokens",))
    params = generation_params(worker_pb2.WorkerCommand(start=start), (spec, ""), None, ())
    sampling, inputs = _sampling_and_flags(params)
    assert sampling == {
        "max_tokens": 9,
        "top_k": 40,
        "min_p": pytest.approx(0.05),
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": pytest.approx(1.1),
        "logit_bias": {"42": -100.0},
        "guided_decoding": json.dumps({"json": SCHEMA}),
    }
    assert inputs["return_num_input_tokens"] == b"\x01"  # what the model declares, sent true
    assert "return_finish_reason" not in inputs  # a model that does not declare it would refuse the request
    http = json.loads(_http_request("127.0.0.1", 8000, params).split(b"\r\n\r\n", 1)[1])
    assert http["return_num_input_tokens"] is True and json.loads(http["sampling_parameters"]) == sampling


@pytest.mark.parametrize(
    ("output", "guided"),
    [
        (inference_pb2.StructuredOutput(json_object=inference_pb2.JsonObject()), {"json_object": True}),
        (inference_pb2.StructuredOutput(choice=inference_pb2.Choice(options=["a", "b"])), {"choice": ["a", "b"]}),
        (inference_pb2.StructuredOutput(grammar='root ::= "a"'), {"grammar": 'root ::= "a"'}),
    ],
)
def test_each_format_is_vllms_structured_output(output: inference_pb2.StructuredOutput, guided: Any) -> None:
    spec = ModelSpec(name="m", max_context=4096, slots=1)
    start = request(structured_output=output)
    sampling, _ = _sampling_and_flags(generation_params(worker_pb2.WorkerCommand(start=start), (spec, ""), None, ()))
    assert json.loads(sampling["guided_decoding"]) == guided
    assert "guided_decoding" not in _sampling_and_flags(GenerationParams(model="m", prompt="hi"))[0]


def test_the_cpu_model_reads_the_same_json_into_llama_cpp_fields(smollm2: Any) -> None:
    sampling = {
        "max_tokens": 9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -100.0},
        "guided_decoding": json.dumps({"json": SCHEMA}),
    }
    body, chat, _, _ = smollm2._request_body({"text_input": "hi", "sampling_parameters": json.dumps(sampling)}, ())
    assert not chat
    assert {k: body[k] for k in ("top_k", "min_p", "presence_penalty", "frequency_penalty", "logit_bias")} == {
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "logit_bias": {"42": -100.0},
    }
    assert body["repeat_penalty"] == 1.1 and body["json_schema"] == SCHEMA

    def guided(spec: dict[str, Any]) -> dict[str, Any]:
        given = {"text_input": "hi", "sampling_parameters": json.dumps({"guided_decoding": json.dumps(spec)})}
        return dict(smollm2._request_body(given, ())[0])

    assert guided({"json_object": True})["json_schema"] == {"type": "object"}
    assert guided({"choice": ['say "hi"', "a\\b"]})["grammar"] == r'root ::= "say \"hi\"" | "a\\b"'
    assert guided({"grammar": 'root ::= "x"'})["grammar"] == 'root ::= "x"'
    with pytest.raises(ValueError, match="guided_decoding.regex is not supported by this llama.cpp model"):
        guided({"regex": "a+"})  # refused, never run unconstrained
    with pytest.raises(ValueError, match="must set one of"):
        guided({"json_object": True, "grammar": 'root ::= "x"'})


def test_a_structured_generation_is_not_continued_after_delivered_text() -> None:
    base = request(max_tokens=50, request_id="r1", structured_output=inference_pb2.StructuredOutput(grammar="root"))
    progress = Progress()
    assert continuation(base, progress) is base  # nothing delivered: the first worker's failure retries it whole
    progress.seq, progress.tokens, progress.text = 3, 3, ['{"na', "me", '": ']
    with pytest.raises(Aborted, match="not continued on another worker") as raised:
        continuation(base, progress)
    assert raised.value.reason == STRUCTURED_NOT_CONTINUED and raised.value.metadata == {"delivered_chunks": "3"}
    free = request(max_tokens=50, request_id="r2")
    forward = continuation(free, progress)
    assert forward is not None and forward.prompt == 'hi{"name": ' and forward.max_tokens == 47


def test_the_vllm_backends_logprobs_become_one_entry_per_token_with_its_alternatives() -> None:
    output = json.dumps(
        [
            {  # the sampled token first; it also ranks among the alternatives
                "7042": {"logprob": -0.26, "rank": 1, "decoded_token": " Paris"},
                "260": {"logprob": -2.76, "rank": 2, "decoded_token": " the"},
                "4528": {"logprob": -4.29, "rank": 3, "decoded_token": " London"},
            },
            {  # sampled outside the top 2
                "11": {"logprob": -5.0, "rank": 9, "decoded_token": ","},
                "30": {"logprob": -0.1, "rank": 1, "decoded_token": "."},
                "31": {"logprob": -2.5, "rank": 2, "decoded_token": "!"},
            },
        ]
    )
    first, second = logprobs_of(output, 2)
    assert (first.token, first.bytes, [a.token for a in first.top_logprobs]) == (
        " Paris",
        b" Paris",
        [" Paris", " the"],
    )
    assert (second.token, second.logprob) == (",", -5.0)
    assert [(a.token, a.logprob) for a in second.top_logprobs] == [(".", pytest.approx(-0.1)), ("!", -2.5)]
    assert logprobs_of(output, 0)[0].top_logprobs == []  # the token's own only
    assert logprobs_of("", 3) == () and logprobs_of("null", 3) == ()


def test_chunks_that_coalesce_keep_one_logprob_per_token_in_order() -> None:
    record = Record("r", 1, 0, generation=None, max_bytes=1 << 20)  # type: ignore[arg-type]  # never pumped here
    for i in range(3):  # nobody read the first: the next two merge into it
        entry = inference_pb2.TokenLogprob(token=f"t{i}", logprob=-0.1 * i)
        record.append(
            worker_pb2.WorkerEvent(chunk=worker_pb2.TokenChunk(text=f"t{i}", token_count=1, logprobs=[entry]))
        )
    (merged,) = record.events
    assert merged.chunk.text == "t0t1t2" and merged.chunk.token_count == 3
    assert [e.token for e in merged.chunk.logprobs] == ["t0", "t1", "t2"]


def test_the_cpu_model_answers_logprobs_in_the_vllm_backends_shape(smollm2: Any) -> None:
    choice = {
        "text": " Paris",
        "logprobs": {
            "content": [
                {
                    "id": 7042,
                    "token": " Paris",
                    "logprob": -0.26,
                    "top_logprobs": [
                        {"id": 7042, "token": " Paris", "logprob": -0.26},
                        {"id": 260, "token": " the", "logprob": -2.76},
                    ],
                }
            ]
        },
    }
    (position,) = smollm2._vllm_logprobs(choice, 2)
    assert list(position) == ["7042", "260"]  # the sampled token first
    assert position["7042"] == {"logprob": -0.26, "rank": 1, "decoded_token": " Paris"}
    assert position["260"]["rank"] == 2
    given = {"text_input": "hi", "sampling_parameters": json.dumps({"logprobs": 0})}
    body, _, _, alternatives = smollm2._request_body(given, ())
    assert body["n_probs"] == 1 and alternatives == 0  # at least the sampled token's own, none of the others
    with pytest.raises(ValueError, match="logprobs must be a whole number"):
        smollm2._alternatives({"logprobs": -1})
