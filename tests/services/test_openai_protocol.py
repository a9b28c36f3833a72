"""The OpenAI protocol layer (services/router/openai_*.py): request parsing into the router's proto, validation
errors, chat template rendering, response shapes checked with the official ``openai`` client's types."""

from __future__ import annotations

import json
import math

import jinja2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.rpc.convert import sampling_from_proto
from pdserve.v1 import generate_pb2, types_pb2
from services.router.openai_protocol import OpenAIError, error_from_grpc, status_of_grpc
from services.router.openai_requests import (
    CHAT_KEYS,
    COMPLETION_KEYS,
    ParsedRequest,
    parse_chat,
    parse_completion,
    parse_json,
)
from services.router.openai_responses import (
    TokenStrings,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    finish_reason_of,
    models_list,
    new_id,
    usage,
    usage_chunk,
)

try:  # the HTTP library the installed openai client is built on (openai 3.x: httpx2; 1.x and 2.x: httpx)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

MODEL = "tiny-llama"
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def completion(**fields) -> ParsedRequest:
    return parse_completion({"model": MODEL, "prompt": "hi", **fields}, served_model=MODEL)


def chat(tokenizer, **fields) -> ParsedRequest:
    return parse_chat({"model": MODEL, "messages": USER_HI, **fields}, served_model=MODEL, tokenizer=tokenizer)


def error_of(fn, *args, **kwargs) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args, **kwargs)
    return info.value


# -- completions: mapping ---------------------------------------------------------------------------------------


def test_every_completion_parameter_reaches_the_proto():
    body = {
        "model": MODEL, "prompt": "Hello", "max_tokens": 7, "temperature": 0.5, "top_p": 0.75, "top_k": 40,
        "min_p": 0.125, "repetition_penalty": 1.25, "presence_penalty": -1.5, "frequency_penalty": 0.25,
        "seed": -(2**63), "stop": ["\n", "END"], "stop_token_ids": [2, 7], "ignore_eos": True, "logprobs": 3,
        "stream": True, "stream_options": {"include_usage": True}, "user": "u1", "n": 1, "best_of": 1,
        "echo": False, "suffix": None, "logit_bias": {},
    }  # fmt: skip
    parsed = parse_completion(body, served_model=MODEL)
    assert parsed == ParsedRequest(
        kind="completion", model=MODEL, prompt_text="Hello", prompt_ids=None,
        sampling={"max_tokens": 7, "temperature": 0.5, "top_p": 0.75, "top_k": 40, "min_p": 0.125,
                  "repetition_penalty": 1.25, "presence_penalty": -1.5, "frequency_penalty": 0.25, "seed": -(2**63),
                  "stop": ["\n", "END"], "stop_token_ids": [2, 7], "ignore_eos": True, "logprobs": 3},
        stream=True, include_usage=True, logprobs=3,
    )  # fmt: skip
    assert parsed.to_generate_request("r1") == generate_pb2.GenerateRequest(
        text="Hello", request_id="r1",
        sampling=types_pb2.SamplingParams(
            max_tokens=7, temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, repetition_penalty=1.25,
            presence_penalty=-1.5, frequency_penalty=0.25, seed=-(2**63), logprobs=3, stop=["\n", "END"],
            stop_token_ids=[2, 7], ignore_eos=True,
        ),
    )  # fmt: skip


def test_completion_defaults_set_only_max_tokens_16():
    parsed = completion()
    assert parsed == ParsedRequest("completion", MODEL, "hi", None, {"max_tokens": 16}, False, False, None)
    request = parsed.to_generate_request()
    assert request == generate_pb2.GenerateRequest(text="hi", sampling=types_pb2.SamplingParams(max_tokens=16))
    assert [f.name for f, _ in request.sampling.ListFields()] == ["max_tokens"]  # no optional field set


def test_zero_and_off_values_are_sent_not_dropped():
    parsed = completion(temperature=0, top_k=0, seed=0, logprobs=0, presence_penalty=0.0, max_tokens=None)
    assert parsed.sampling == {"max_tokens": 16, "temperature": 0.0, "top_k": 0, "presence_penalty": 0.0, "seed": 0,
                               "logprobs": 0}  # fmt: skip
    sampling = parsed.to_generate_request().sampling
    assert [sampling.HasField(f) for f in ("temperature", "top_k", "seed", "logprobs", "top_p")] == [
        True, True, True, True, False]  # fmt: skip


@pytest.mark.parametrize(
    "prompt, text, ids",
    [
        ("Hello", "Hello", None),
        (["Hello"], "Hello", None),
        ([5, 6, 4294967295], None, [5, 6, 4294967295]),
        ([[5, 6]], None, [5, 6]),
    ],
)
def test_prompt_forms(prompt, text, ids):
    parsed = completion(prompt=prompt)
    assert (parsed.prompt_text, parsed.prompt_ids) == (text, ids)
    request = parsed.to_generate_request()
    assert request.WhichOneof("prompt") == ("text" if text else "token_ids")
    assert (request.text, list(request.token_ids.ids)) == (text or "", ids or [])


def test_a_single_stop_string_is_a_list_of_one():
    assert completion(stop="END").to_generate_request().sampling.stop == ["END"]
    assert "stop" not in completion(stop=[]).sampling


def test_stream_options_include_usage():
    assert (completion(stream=True).include_usage, completion(stream=True).stream) == (False, True)
    assert completion(stream=True, stream_options={"include_usage": False}).include_usage is False
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert completion(stream=False, stream_options=None).include_usage is False


# -- completions: validation ------------------------------------------------------------------------------------

COMPLETION_ERRORS = [
    ({"prompt": None}, "prompt", "prompt is required"),
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"prompt": ["a", "b"]}, "prompt",
     "batched prompts are not supported; send one prompt per request (got 2 prompts)"),
    ({"prompt": [[1], [2]]}, "prompt",
     "batched prompts are not supported; send one prompt per request (got 2 prompts)"),
    ({"prompt": {"a": 1}}, "prompt", "prompt must be a string or an array of token ids, got {'a': 1}"),
    ({"prompt": [1, -1]}, "prompt", "prompt must hold token ids (integers in [0, 4294967295]), got -1"),
    ({"prompt": [1, "a"]}, "prompt", "prompt must hold token ids (integers in [0, 4294967295]), got 'a'"),
    ({"prompt": [True]}, "prompt", "prompt must hold token ids (integers in [0, 4294967295]), got True"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be in [1, 4294967295], got 0"),
    ({"max_tokens": 2**32}, "max_tokens", "max_tokens must be in [1, 4294967295], got 4294967296"),
    ({"max_tokens": 16.0}, "max_tokens", "max_tokens must be an integer, got 16.0"),
    ({"max_tokens": True}, "max_tokens", "max_tokens must be an integer, got True"),
    ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5"),
    ({"temperature": -0.1}, "temperature", "temperature must be in [0, 2], got -0.1"),
    ({"temperature": "hot"}, "temperature", "temperature must be a number, got 'hot'"),
    ({"temperature": math.nan}, "temperature", "temperature must be a finite number, got nan"),
    ({"temperature": math.inf}, "temperature", "temperature must be a finite number, got inf"),
    ({"temperature": 10**400}, "temperature", "temperature must be in [0, 2], got 1" + "0" * 76 + "..."),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -2}, "top_k", "top_k must be in [-1, 2147483647], got -2"),
    ({"top_k": 2**31}, "top_k", "top_k must be in [-1, 2147483647], got 2147483648"),
    ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1], got 1.5"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, inf), got 0"),
    ({"repetition_penalty": 1e39}, "repetition_penalty",
     "repetition_penalty is too large for a 32-bit float, got 1e+39"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty",
     "repetition_penalty must be > 0 as a 32-bit float, got 1e-50 (0)"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -3"),
    ({"seed": 2**63}, "seed",
     "seed must be in [-9223372036854775808, 9223372036854775807], got 9223372036854775808"),
    ({"seed": "42"}, "seed", "seed must be an integer, got '42'"),
    ({"stop": 5}, "stop", "stop must be a string or an array of strings, got 5"),
    ({"stop": [1]}, "stop", "stop strings must be strings, got 1"),
    ({"stop": [""]}, "stop", "stop strings must not be empty"),
    ({"stop": ["a"] * 17}, "stop", "stop must hold at most 16 strings, got 17"),
    ({"stop_token_ids": "2"}, "stop_token_ids", "stop_token_ids must be an array, got '2'"),
    ({"stop_token_ids": [-1]}, "stop_token_ids",
     "stop_token_ids must hold token ids (integers in [0, 4294967295]), got -1"),
    ({"ignore_eos": 1}, "ignore_eos", "ignore_eos must be a boolean, got 1"),
    ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
    ({"logprobs": True}, "logprobs", "logprobs must be an integer, got True"),
    ({"n": 2}, "n", "n=2 is not supported: one choice per request"),
    ({"n": True}, "n", "n=True is not supported: one choice per request"),
    ({"best_of": 3}, "best_of", "best_of=3 is not supported: one choice per request"),
    ({"echo": True}, "echo", "echo=True is not supported: the prompt is not echoed"),
    ({"suffix": "x"}, "suffix", "suffix='x' is not supported: suffix (insertion) is not supported"),
    ({"logit_bias": {"5": 10}}, "logit_bias",
     "logit_bias={'5': 10} is not supported: biasing tokens is not implemented"),
    ({"user": 5}, "user", "user must be a string, got 5"),
    ({"stream": "yes"}, "stream", "stream must be a boolean, got 'yes'"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed when stream is true"),
    ({"stream": True, "stream_options": [True]}, "stream_options", "stream_options must be an object, got [True]"),
    ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage",
     "stream_options.include_usage must be a boolean, got 'y'"),
    ({"stream": True, "stream_options": {"continuous": True}}, "stream_options.continuous",
     "unrecognized stream option: 'continuous'"),
    ({"messages": USER_HI}, "messages", "unrecognized request argument supplied: 'messages'"),
    ({"frobnicate": 1}, "frobnicate", "unrecognized request argument supplied: 'frobnicate'"),
    # Lone surrogates (JSON "\\ud800" escapes) wherever text reaches the proto: they used to fail building it (500).
    ({"prompt": "a\ud800"}, "prompt",
     "prompt holds a lone UTF-16 surrogate '\\ud800' at index 1, which is not valid Unicode"),
    ({"prompt": ["\udfff"]}, "prompt",
     "prompt holds a lone UTF-16 surrogate '\\udfff' at index 0, which is not valid Unicode"),
    ({"stop": ["ok", "x\udc00"]}, "stop",
     "stop holds a lone UTF-16 surrogate '\\udc00' at index 1, which is not valid Unicode"),
    ({"session_id": "s\ud800"}, "session_id",
     "session_id holds a lone UTF-16 surrogate '\\ud800' at index 1, which is not valid Unicode"),
    ({"user": "\ud800"}, "user", "user holds a lone UTF-16 surrogate '\\ud800' at index 0, which is not valid Unicode"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, message", COMPLETION_ERRORS, ids=[e[2][:60] for e in COMPLETION_ERRORS])
def test_completion_validation_errors(fields, param, message):
    err = error_of(parse_completion, {"model": MODEL, "prompt": "hi", **fields}, served_model=MODEL)
    assert (err.status, err.type, err.param, err.message, err.code) == (400, "invalid_request_error", param,
                                                                        message, None)  # fmt: skip
    assert err.body() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                    "code": None}}  # fmt: skip


@pytest.mark.parametrize("raw, message", [
    (b"[" * 100_000, "nested too deeply"),  # used to escape as RecursionError: a 500
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "Exceeds the limit (4300 digits) for integer string conversion: "
                                              "value has 5000 digits; use sys.set_int_max_str_digits() to increase "
                                              "the limit"),
    (b'{"prompt": "\xff"}', "'utf-8' codec can't decode byte 0xff in position 12: invalid start byte"),
    (b"{", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
])  # fmt: skip
def test_a_body_that_is_no_json_is_a_400_saying_why(raw, message):
    err = error_of(parse_json, raw)
    assert (err.status, err.type, err.param, err.message) == (400, "invalid_request_error", None,
                                                              f"request body is not valid JSON: {message}")


def test_parse_json_reads_what_json_loads_reads_and_names_what_it_parses():
    assert parse_json('{"a": [1, NaN]}'.encode("utf-16"))["a"][0] == 1
    assert parse_json(b"\xef\xbb\xbf[2]") == [2]  # a UTF-8 byte order mark
    assert error_of(parse_json, "[" * 100_000, "the request message").message == (
        "the request message is not valid JSON: nested too deeply")


def test_model_is_required_and_must_be_the_served_one():
    err = error_of(parse_completion, {"model": "gpt-4o", "prompt": "hi"}, served_model=MODEL)
    assert err.body() == {"error": {
        "message": "the model 'gpt-4o' does not exist; this server serves 'tiny-llama'",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}  # fmt: skip
    assert err.status == 404
    err = error_of(parse_completion, {"prompt": "hi"}, served_model=MODEL)
    assert (err.status, err.param, err.message) == (400, "model", "model is required")
    err = error_of(parse_completion, {"model": 7, "prompt": "hi"}, served_model=MODEL)
    assert (err.status, err.param, err.message) == (400, "model", "model must be a string, got 7")


@pytest.mark.parametrize("body, kind", [([], "array"), ("x", "string"), (None, "null"), (3.5, "number"),
                                        (True, "boolean")])  # fmt: skip
def test_a_body_that_is_not_an_object_is_a_400(body, kind):
    for err in (error_of(parse_completion, body, served_model=MODEL),
                error_of(parse_chat, body, served_model=MODEL, tokenizer=None)):  # fmt: skip
        message = f"the request body must be a JSON object, got {kind}"
        assert (err.status, err.param, err.message) == (400, None, message)


def test_unknown_keys_are_reported_before_the_model():
    err = error_of(parse_completion, {"model": "other", "prompt": "hi", "best": 1}, served_model=MODEL)
    assert (err.status, err.param) == (400, "best")


# -- chat: rendering and mapping ------------------------------------------------------------------------------


def test_chat_renders_with_the_models_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "refusal": None, "tool_calls": None},  # as the client echoes it
        {"role": "user", "content": "And 3+3?"},
    ]
    parsed = parse_chat({"model": MODEL, "messages": messages}, served_model=MODEL, tokenizer=tokenizer)
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    expected = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert parsed.prompt_ids == list(expected)
    assert tokenizer.decode(parsed.prompt_ids) == ("<s>system\nBe brief.</s>\n<s>user\nWhat is 2+2?</s>\n"
                                                   "<s>assistant\n4</s>\n<s>user\nAnd 3+3?</s>\n<s>assistant\n")
    assert parsed.to_generate_request("c1") == generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=expected), request_id="c1", sampling=types_pb2.SamplingParams())


def test_text_parts_join_with_newlines_and_developer_renders_as_system(tokenizer):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                 "name": "ann"}]  # fmt: skip
    parsed = parse_chat({"model": MODEL, "messages": messages}, served_model=MODEL, tokenizer=tokenizer)
    assert tokenizer.decode(parsed.prompt_ids) == "<s>system\nRules.</s>\n<s>user\na\nb</s>\n<s>assistant\n"


def test_every_chat_parameter_reaches_the_proto(tokenizer):
    parsed = chat(
        tokenizer, max_completion_tokens=9, temperature=1.5, top_p=0.5, top_k=-1, min_p=0.25, repetition_penalty=1.5,
        presence_penalty=2, frequency_penalty=-2, seed=2**63 - 1, stop="###", stop_token_ids=[3], ignore_eos=False,
        logprobs=True, top_logprobs=20, stream=True, stream_options={"include_usage": True}, n=1, user="u",
        logit_bias=None, tools=[], tool_choice="none", response_format={"type": "text"},
    )  # fmt: skip
    assert (parsed.kind, parsed.model, parsed.prompt_text, parsed.stream, parsed.include_usage, parsed.logprobs) == (
        "chat", MODEL, None, True, True, 20)  # fmt: skip
    assert parsed.to_generate_request().sampling == types_pb2.SamplingParams(
        max_tokens=9, temperature=1.5, top_p=0.5, top_k=-1, min_p=0.25, repetition_penalty=1.5, presence_penalty=2,
        frequency_penalty=-2, seed=2**63 - 1, logprobs=20, stop=["###"], stop_token_ids=[3],
    )  # fmt: skip


def test_chat_defaults_leave_max_tokens_to_the_router(tokenizer):
    parsed = chat(tokenizer)
    assert (parsed.sampling, parsed.logprobs, parsed.stream, parsed.include_usage) == ({}, None, False, False)
    assert parsed.to_generate_request().sampling == types_pb2.SamplingParams()  # max_tokens 0: router default


@pytest.mark.parametrize(
    "fields, max_tokens, logprobs",
    [
        ({"max_tokens": 5}, 5, None),
        ({"max_tokens": 5, "max_completion_tokens": 5}, 5, None),
        ({"logprobs": True}, None, 0),
        ({"logprobs": False}, None, None),
        ({"logprobs": True, "top_logprobs": 0}, None, 0),
        ({"logprobs": True, "top_logprobs": None}, None, 0),
    ],
)
def test_chat_max_tokens_and_logprobs(tokenizer, fields, max_tokens, logprobs):
    parsed = chat(tokenizer, **fields)
    assert (parsed.sampling.get("max_tokens"), parsed.logprobs, parsed.sampling.get("logprobs")) == (
        max_tokens, logprobs, logprobs)  # fmt: skip


CHAT_ERRORS = [
    ({"messages": None}, "messages", "messages is required"),
    ({"messages": []}, "messages", "messages must be a non-empty array of messages, got []"),
    ({"messages": "hi"}, "messages", "messages must be a non-empty array of messages, got 'hi'"),
    ({"messages": ["hi"]}, "messages[0]", "messages[0] must be an object, got 'hi'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role",
     "messages[0].role must be one of 'system', 'developer', 'user', 'assistant', got 'tool'; "
     "this server does not support tools"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role",
     "messages[0].role must be one of 'system', 'developer', 'user', 'assistant', got ['user']"),
    ({"messages": [*USER_HI, {"role": "user"}]}, "messages[1].content",
     "messages[1].content must be a string or an array of text parts, got None"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "content part type 'image_url' is not supported; only 'text'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]",
     "messages[0].content[0] must be a content part object, got 'hi'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
     "messages[0].content[0].text must be a string, got 5"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]},
     "messages[0].content[0].cache", "unrecognized content part field 'cache' in messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}]}, "messages[0].tool_calls",
     "messages[0].tool_calls is not supported (tools, audio, refusals), got [{'id': 'c'}]"),
    ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo",
     "unrecognized message field 'foo' in messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name",
     "messages[0].name must be a string, got 5"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content",
     "messages[0].content holds a lone UTF-16 surrogate '\\ud800' at index 0, which is not valid Unicode"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "ab\udfff"}]}]},
     "messages[0].content[0].text",
     "messages[0].content[0].text holds a lone UTF-16 surrogate '\\udfff' at index 2, which is not valid Unicode"),
    ({"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}, "messages[0].name",
     "messages[0].name holds a lone UTF-16 surrogate '\\ud800' at index 0, which is not valid Unicode"),
    ({"tools": [{"type": "function"}]}, "tools",
     "tools=[{'type': 'function'}] is not supported: tools are not supported"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice='required' is not supported: tools are not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "response_format={'type': 'json_object'} is not supported: only {'type': 'text'} is supported"),
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs (3) requires logprobs: true, got logprobs=None"),
    ({"logprobs": 1}, "logprobs", "logprobs must be a boolean, got 1"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20], got 21"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be in [1, 4294967295], got 0"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens",
     "max_tokens (5) and max_completion_tokens (6) disagree; send one"),
    ({"temperature": math.nan}, "temperature", "temperature must be a finite number, got nan"),
    ({"n": 3}, "n", "n=3 is not supported: one choice per request"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed when stream is true"),
    ({"echo": False}, "echo", "unrecognized request argument supplied: 'echo'"),
    ({"prompt": "hi"}, "prompt", "unrecognized request argument supplied: 'prompt'"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, message", CHAT_ERRORS, ids=[e[2][:60] for e in CHAT_ERRORS])
def test_chat_validation_errors(tokenizer, fields, param, message):
    body = {"model": MODEL, "messages": USER_HI, **fields}
    err = error_of(parse_chat, body, served_model=MODEL, tokenizer=tokenizer)
    assert (err.status, err.type, err.param, err.message) == (400, "invalid_request_error", param, message)


def test_chat_model_mismatch_is_404(tokenizer):
    err = error_of(parse_chat, {"model": "x", "messages": USER_HI}, served_model=MODEL, tokenizer=tokenizer)
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")


class StubTokenizer:
    """A tokenizer whose chat template returns (or raises) ``out``."""

    def __init__(self, out, chat_template="{{ messages }}"):
        self.out = out
        self.chat_template = chat_template
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append((messages, kwargs))
        if isinstance(self.out, Exception):
            raise self.out
        return self.out


@pytest.mark.parametrize("out", [[5, 6, 7], {"input_ids": [5, 6, 7]}, {"input_ids": [[5, 6, 7]]}])
def test_chat_template_output_forms(out):
    stub = StubTokenizer(out)
    parsed = parse_chat({"model": MODEL, "messages": USER_HI}, served_model=MODEL, tokenizer=stub)
    assert parsed.prompt_ids == [5, 6, 7]
    assert stub.calls == [(USER_HI, {"add_generation_prompt": True, "tokenize": True})]


@pytest.mark.parametrize(
    "stub, message",
    [
        (StubTokenizer(jinja2.TemplateError("Conversation roles must alternate")),
         "the chat template rejected the messages: Conversation roles must alternate"),
        (StubTokenizer([]), "the chat template rendered an empty prompt"),
        (StubTokenizer([1], chat_template=None), "the model has no chat template; use /v1/completions"),
    ],
)  # fmt: skip
def test_chat_template_failures_are_400s(stub, message):
    err = error_of(parse_chat, {"model": MODEL, "messages": USER_HI}, served_model=MODEL, tokenizer=stub)
    assert (err.status, err.param, err.message) == (400, "messages", message)


# -- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, status, kind, err_code",
    [
        ("INVALID_ARGUMENT", 400, "invalid_request_error", None),
        ("OUT_OF_RANGE", 400, "invalid_request_error", None),
        ("UNAUTHENTICATED", 401, "authentication_error", "invalid_api_key"),
        ("PERMISSION_DENIED", 403, "permission_error", None),
        ("NOT_FOUND", 404, "invalid_request_error", "not_found"),
        ("RESOURCE_EXHAUSTED", 429, "rate_limit_error", "rate_limit_exceeded"),
        ("CANCELLED", 499, "cancelled", "request_cancelled"),
        ("FAILED_PRECONDITION", 503, "service_unavailable", "service_unavailable"),
        ("UNAVAILABLE", 503, "service_unavailable", "service_unavailable"),
        ("DEADLINE_EXCEEDED", 504, "timeout", "timeout"),
        ("INTERNAL", 500, "server_error", None),
        ("DATA_LOSS", 500, "server_error", None),
        ("UNKNOWN", 500, "server_error", None),
        ("NO_SUCH_CODE", 500, "server_error", None),
    ],
)
def test_grpc_status_mapping(code, status, kind, err_code):
    assert status_of_grpc(code) == status
    err = error_from_grpc(code, "no live decode worker")
    assert err.body() == {"error": {"message": "no live decode worker", "type": kind, "param": None, "code": err_code}}
    assert (err.status, str(err)) == (status, "no live decode worker")


def test_grpc_error_without_details_names_the_code():
    assert error_from_grpc("UNAVAILABLE", "").message == "generation failed: UNAVAILABLE"


def official_client(handler) -> openai.OpenAI:
    """The official client, its HTTP answered in-process by ``handler(request) -> httpx.Response``."""
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(api_key="k", base_url="http://pdserve.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=transport))  # fmt: skip


def test_the_official_client_reads_the_error_body():
    err = error_from_grpc("RESOURCE_EXHAUSTED", "all decode workers are full")
    client = official_client(lambda request: httpx.Response(err.status, json=err.body()))
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=MODEL, prompt="hi")
    exc = info.value
    assert (exc.status_code, exc.type, exc.code, exc.param, exc.body) == (
        429, "rate_limit_error", "rate_limit_exceeded", None, err.body()["error"])  # fmt: skip
    bad = error_of(parse_completion, {"model": MODEL, "prompt": "hi", "top_p": 0}, served_model=MODEL)
    client = official_client(lambda request: httpx.Response(bad.status, json=bad.body()))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", top_p=0)
    assert (info.value.param, info.value.body["message"]) == ("top_p", "top_p must be in (0, 1], got 0")


# -- responses --------------------------------------------------------------------------------------------------


def dumped(body: dict) -> dict:
    """``body`` after a JSON round trip (fails on NaN or Infinity)."""
    return json.loads(json.dumps(body, allow_nan=False))


def test_completion_shapes_parse_with_the_official_types():
    body = completion_response("cmpl-1", 1700000000, MODEL, "Hi there", "length", usage(3, 4))
    assert dumped(body) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": MODEL,
        "choices": [{"index": 0, "text": "Hi there", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }  # fmt: skip
    parsed = Completion.model_validate(body)
    assert (parsed.choices[0].text, parsed.choices[0].finish_reason, parsed.usage.total_tokens) == (
        "Hi there", "length", 7)  # fmt: skip
    last = completion_chunk("cmpl-1", 1700000000, MODEL, "", "stop")
    assert Completion.model_validate(last).choices[0].finish_reason == "stop"
    # openai.types.Completion declares finish_reason non-null although OpenAI's stream sends null until the last
    # chunk; the client builds stream chunks without validation. Check the rest of a mid-stream chunk strictly.
    mid = completion_chunk("cmpl-1", 1700000000, MODEL, "Hi", None)
    assert mid["choices"][0]["finish_reason"] is None
    mid["choices"][0]["finish_reason"] = "stop"
    assert Completion.model_validate(mid).choices[0].text == "Hi"
    tail = usage_chunk("completion", "cmpl-1", 1700000000, MODEL, usage(3, 4))
    assert dumped(tail) == {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": MODEL,
                            "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    assert Completion.model_validate(tail).usage.completion_tokens == 4


def test_chat_shapes_parse_with_the_official_types():
    body = chat_response("chatcmpl-1", 1700000000, MODEL, "4", "stop", usage(10, 2))
    assert dumped(body) == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }  # fmt: skip
    parsed = ChatCompletion.model_validate(body)
    assert (parsed.choices[0].message.role, parsed.choices[0].message.content, parsed.usage.total_tokens) == (
        "assistant", "4", 12)  # fmt: skip
    first = ChatCompletionChunk.model_validate(chat_chunk("chatcmpl-1", 1, MODEL, {"role": "assistant", "content": ""},
                                                          None))  # fmt: skip
    assert (first.object, first.choices[0].delta.role, first.choices[0].delta.content) == (
        "chat.completion.chunk", "assistant", "")  # fmt: skip
    last = ChatCompletionChunk.model_validate(chat_chunk("chatcmpl-1", 1, MODEL, {}, "length"))
    assert (last.choices[0].delta.content, last.choices[0].finish_reason) == (None, "length")
    tail = usage_chunk("chat", "chatcmpl-1", 1, MODEL, usage(10, 2))
    assert dumped(tail)["object"] == "chat.completion.chunk"
    assert ChatCompletionChunk.model_validate(tail).usage.prompt_tokens == 10


def sse(chunks: list[dict]) -> httpx.Response:
    text = "".join(f"data: {json.dumps(c, allow_nan=False)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_the_official_client_reads_a_chat_stream_and_a_completion(tokenizer):
    """What the front will send, parsed by the client's own code path (requests checked on the way)."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/v1/chat/completions":
            parsed = parse_chat(body, served_model=MODEL, tokenizer=tokenizer)
            seen.append(parsed)
            return sse([
                chat_chunk("chatcmpl-1", 1, MODEL, {"role": "assistant", "content": ""}, None),
                chat_chunk("chatcmpl-1", 1, MODEL, {"content": "Hel"}, None),
                chat_chunk("chatcmpl-1", 1, MODEL, {"content": "lo"}, None),
                chat_chunk("chatcmpl-1", 1, MODEL, {}, "stop"),
                usage_chunk("chat", "chatcmpl-1", 1, MODEL, usage(5, 2)),
            ])  # fmt: skip
        parsed = parse_completion(body, served_model=MODEL)
        seen.append(parsed)
        return httpx.Response(200, json=completion_response("cmpl-1", 1, MODEL, "Hello", "length", usage(1, 2)))

    client = official_client(handler)
    stream = client.chat.completions.create(model=MODEL, messages=USER_HI, stream=True, max_completion_tokens=2,
                                            stream_options={"include_usage": True}, temperature=0)  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert [c.choices[0].finish_reason if c.choices else "usage" for c in chunks] == [None, None, None, "stop",
                                                                                      "usage"]  # fmt: skip
    assert chunks[-1].usage.total_tokens == 7
    result = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, seed=7)
    assert (result.choices[0].text, result.choices[0].finish_reason, result.usage.completion_tokens) == (
        "Hello", "length", 2)  # fmt: skip
    assert [(p.kind, p.stream, p.include_usage, p.sampling) for p in seen] == [
        ("chat", True, True, {"max_tokens": 2, "temperature": 0.0}),
        ("completion", False, False, {"max_tokens": 2, "seed": 7}),
    ]  # fmt: skip
    assert seen[1].prompt_ids == [1, 2, 3]


def test_models_list_shape():
    body = models_list(MODEL, 1700000000)
    assert body == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1700000000,
                                                "owned_by": "pdserve"}]}  # fmt: skip
    assert Model.model_validate(body["data"][0]).id == MODEL


def test_finish_reasons_and_ids():
    assert [finish_reason_of(v) for v in (types_pb2.FINISH_REASON_UNSPECIFIED, types_pb2.FINISH_REASON_STOP,
                                          types_pb2.FINISH_REASON_LENGTH, types_pb2.FINISH_REASON_ABORT)] == [
        None, "stop", "length", "abort"]  # fmt: skip
    with pytest.raises(ValueError, match="unknown FinishReason value 9"):
        finish_reason_of(9)
    a, b, c = new_id("completion"), new_id("completion"), new_id("chat")
    assert (a[:5], len(a), c[:9], len(c), a != b) == ("cmpl-", 37, "chatcmpl-", 41, True)
    with pytest.raises(ValueError, match="kind must be 'completion' or 'chat', got 'edit'"):
        new_id("edit")
    with pytest.raises(ValueError, match="got 'edit'"):
        usage_chunk("edit", "x", 1, MODEL, usage(1, 1))


def test_logprobs_of_both_kinds(tokenizer):
    h, c3, a9 = tokenizer.encode("hé")  # byte-level BPE: "é" is two single-byte tokens
    assert [tokenizer.decode([t]) for t in (h, c3, a9)] == ["h", "\ufffd", "\ufffd"]
    entries = [
        types_pb2.TokenLogprob(token_id=h, logprob=-0.5, top=[types_pb2.TopLogprob(token_id=h, logprob=-0.5),
                                                              types_pb2.TopLogprob(token_id=c3, logprob=-1.5),
                                                              types_pb2.TopLogprob(token_id=a9, logprob=-2.5)]),
        types_pb2.TokenLogprob(token_id=c3, logprob=float("-inf")),
        types_pb2.TokenLogprob(token_id=a9, logprob=float("nan")),
    ]  # fmt: skip
    strings = TokenStrings(tokenizer)
    legacy = completion_logprobs(entries, strings, text_offset=10)
    assert dumped(legacy) == {
        "tokens": ["h", "\ufffd", "\ufffd"], "token_logprobs": [-0.5, -9999.0, -9999.0],
        "top_logprobs": [{"h": -0.5, "\ufffd": -1.5}, {}, {}],  # the two "\ufffd" alternatives keep the first
        "text_offset": [10, 11, 12],
    }  # fmt: skip
    body = completion_response("cmpl-1", 1, MODEL, "hé", "stop", usage(1, 3), logprobs=legacy)
    assert Completion.model_validate(body).choices[0].logprobs.tokens == ["h", "\ufffd", "\ufffd"]
    new = chat_logprobs(entries, strings)
    assert dumped(new) == {"content": [
        {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
            {"token": "h", "logprob": -0.5, "bytes": [104]},
            {"token": "\ufffd", "logprob": -1.5, "bytes": [0xC3]},
            {"token": "\ufffd", "logprob": -2.5, "bytes": [0xA9]}]},
        {"token": "\ufffd", "logprob": -9999.0, "bytes": [0xC3], "top_logprobs": []},
        {"token": "\ufffd", "logprob": -9999.0, "bytes": [0xA9], "top_logprobs": []},
    ]}  # fmt: skip
    assert bytes(b for item in new["content"] for b in item["bytes"]).decode() == "hé"
    chunk = ChatCompletionChunk.model_validate(chat_chunk("c", 1, MODEL, {"content": "hé"}, None, logprobs=new))
    assert chunk.choices[0].logprobs.content[1].bytes == [0xC3]
    full = ChatCompletion.model_validate(chat_response("c", 1, MODEL, "hé", "stop", usage(1, 3), logprobs=new))
    assert full.choices[0].logprobs.content[0].top_logprobs[2].logprob == -2.5


def test_token_bytes_of_a_sentencepiece_byte_fallback_piece():
    class SentencePieceLike:
        def decode(self, ids):
            return {7: "\ufffd", 8: "▁x"}.get(ids[0], "é")

        def convert_ids_to_tokens(self, token_id):
            return {7: "<0xE6>", 8: "▁x"}.get(token_id, "é")

    strings = TokenStrings(SentencePieceLike())
    assert [strings.bytes(7), strings.bytes(9)] == [[0xE6], [0xC3, 0xA9]]  # "é" whole: its UTF-8, not Latin-1


# -- fuzz -------------------------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
    | st.sampled_from(["\ud800", "a\udfff"]),  # lone surrogates: JSON escapes decode to them
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
KEYS = st.sampled_from(sorted(COMPLETION_KEYS | CHAT_KEYS | {"foo"})) | st.text(max_size=6)
PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | JSON,
                                        "text": st.text(max_size=6) | JSON}), max_size=2)  # fmt: skip
MESSAGES = st.lists(st.dictionaries(
    st.sampled_from(["role", "content", "name", "refusal", "tool_calls", "x"]),
    st.sampled_from(["user", "system", "assistant", "developer", "tool"]) | st.text(max_size=6) | PARTS | JSON,
    max_size=4), max_size=3)  # fmt: skip
# Near-valid bodies: a valid one with a few fields replaced (reaches the checks after model and prompt).
EDGES = st.sampled_from([0, 1, -1, 0.5, 2, 2**32, 1e-46, 1e39, math.nan, True, "x", [], {}])
NUMERIC_KEYS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "logprobs", "top_logprobs", "max_completion_tokens"]  # fmt: skip


def near_valid(base: dict, allowed: frozenset[str]):
    """``base`` (valid) with a few fields replaced: numbers around the bounds, or anything at all."""
    numbers = st.dictionaries(st.sampled_from([k for k in NUMERIC_KEYS if k in allowed]),
                              EDGES | st.floats(-2.5, 2.5) | st.integers(-2, 30), max_size=3)  # fmt: skip
    return st.builds(lambda o: {**base, **o}, numbers | st.dictionaries(KEYS, JSON | EDGES, max_size=3))


COMPLETION_BODIES = JSON | st.dictionaries(KEYS, JSON, max_size=6) | near_valid(
    {"model": MODEL, "prompt": "hi"}, COMPLETION_KEYS)
CHAT_BODIES = JSON | st.dictionaries(KEYS, JSON, max_size=6) | near_valid(
    {"model": MODEL, "messages": USER_HI}, CHAT_KEYS) | st.builds(
    lambda m: {"model": MODEL, "messages": m}, MESSAGES)


def parses_or_rejects(parse, what: str = "") -> None:
    """``parse()`` returns a request whose proto the router accepts, or raises an OpenAIError 400/404."""
    try:
        parsed = parse()
    except OpenAIError as exc:
        assert exc.status in (400, 404), (what, exc.body())
        assert exc.status == 400 or exc.code == "model_not_found", (what, exc.body())
        json.dumps(exc.body(), allow_nan=False)
    else:  # what this layer accepts, the router accepts (its own check of the proto, without the vocabulary)
        try:
            sampling_from_proto(parsed.to_generate_request("fuzz").sampling, None, 16)
        except ValueError as exc:
            raise AssertionError(f"accepted {what or parsed} but the router rejects it: {exc}") from exc


BOUNDARY_VALUES = [0, 1, -1, 2, -2, 20, 21, 0.5, 1e-46, 1e-30, 1e39, 3.4028235e38, 2.0000001, 1.0000001, -2.0000001,
                   2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, math.nan, math.inf,
                   -math.inf, True, None, "1"]  # fmt: skip


@pytest.mark.parametrize("key", NUMERIC_KEYS)
def test_every_boundary_value_is_rejected_here_or_accepted_by_the_router(tokenizer, key):
    for value in BOUNDARY_VALUES:
        if key in COMPLETION_KEYS:
            body = {"model": MODEL, "prompt": "hi", key: value}
            parses_or_rejects(lambda: parse_completion(body, served_model=MODEL), f"{key}={value!r}")
        if key in CHAT_KEYS:
            body = {"model": MODEL, "messages": USER_HI, "logprobs": key == "top_logprobs", key: value}
            parses_or_rejects(lambda: parse_chat(body, served_model=MODEL, tokenizer=tokenizer), f"{key}={value!r}")


@settings(max_examples=500, deadline=None)
@given(body=COMPLETION_BODIES)
def test_fuzzed_completion_bodies_only_raise_openai_errors(body):
    parses_or_rejects(lambda: parse_completion(body, served_model=MODEL))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=CHAT_BODIES)
def test_fuzzed_chat_bodies_only_raise_openai_errors(tokenizer, body):
    parses_or_rejects(lambda: parse_chat(body, served_model=MODEL, tokenizer=tokenizer))
