"""What the front fuzzers send and what must come back: hypothesis strategies of malformed and extreme requests
(gRPC ``GenerateRequest`` messages and raw bytes, OpenAI bodies with one field changed, raw HTTP bodies,
``X-Request-Timeout`` values) and the oracles that judge the answers (:func:`grpc_fault`, :func:`names_field`).

The strategies draw each part of a request from ``mostly(good, anything)``: usually fine, so the checks behind
the first one are reached and a fair share of requests is valid; huge values are made when drawn (:func:`big`).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from common.kv_transfer.wire import MAX_REQUEST_ID_BYTES
from pdserve.client import sampling_message
from pdserve.v1 import generate_pb2, types_pb2


@dataclass(frozen=True)
class Model:
    """What the oracles need to know of the served model (as the router loads it)."""

    name: str  # the served model id
    vocab_size: int
    max_model_len: int
    tokenizer: Any


# -- gRPC -------------------------------------------------------------------------------------------------------


def grpc_fault(request: generate_pb2.GenerateRequest, model: Model) -> tuple[str, ...] | None:
    """None when the router must accept ``request``; else the words its INVALID_ARGUMENT details must hold (the
    first fault in the router's order: request id, prompt, then ``SamplingParams.validate``'s field order)."""
    rid_bytes = len(request.request_id.encode())
    if rid_bytes > MAX_REQUEST_ID_BYTES:
        return "request_id", str(rid_bytes)
    kind = request.WhichOneof("prompt")
    if kind == "text":
        ids = list(model.tokenizer(request.text)["input_ids"]) if request.text else []
    else:
        ids = list(request.token_ids.ids) if kind == "token_ids" else []
    if not ids:
        return ("prompt is empty",)
    if len(ids) >= model.max_model_len:
        return "prompt", str(len(ids)), str(model.max_model_len)
    bad = next((t for t in ids if t >= model.vocab_size), None)
    if bad is not None:
        return "prompt token id", str(bad)
    s = request.sampling
    finite = math.isfinite
    checks = [
        ("temperature", lambda v: finite(v) and v >= 0),
        ("top_p", lambda v: finite(v) and 0 < v <= 1),
        ("top_k", lambda v: v >= -1),
        ("min_p", lambda v: finite(v) and 0 <= v <= 1),
        ("repetition_penalty", lambda v: finite(v) and v > 0),
        ("presence_penalty", lambda v: finite(v) and -2 <= v <= 2),
        ("frequency_penalty", lambda v: finite(v) and -2 <= v <= 2),
        ("logprobs", lambda v: v <= 20),
    ]
    for name, ok in checks:
        if s.HasField(name) and not ok(getattr(s, name)):
            return name, str(getattr(s, name))
    if len(s.stop) > 16:
        return "stop", str(len(s.stop))
    if "" in s.stop:
        return ("stop strings must not be empty",)
    bad = next((t for t in s.stop_token_ids if t >= model.vocab_size), None)
    if bad is not None:
        return "stop token id", str(bad)
    return None


F32_EDGES = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 2.0000002,
             -2.0000002, -1.0, 3.4028235e38, -3.4028235e38]  # fmt: skip


def big(piece, n: int):
    """``piece * n``, made when drawn (a ``just`` of it would put the huge value in the strategy's repr)."""
    return st.just(n).map(lambda k: piece * k)


def f32s():
    return st.sampled_from(F32_EDGES) | st.floats(width=32)


def mostly(good, anything, one_in: int = 6):
    """``anything`` about once in ``one_in`` draws, else ``good``: each part of a request is usually fine, so the
    checks behind the first one are reached and a fair share of requests is valid and generates."""
    return st.integers(1, one_in).flatmap(lambda i: anything if i == 1 else good)


def token_ids(model: Model):
    v = model.vocab_size
    return st.integers(0, v - 1) | st.sampled_from([0, v - 1, v, v + 1, 2**31, 2**32 - 1])


def prompts(model: Model):
    """(kind, value): kind None (no prompt), "text" or "ids"; empty, short, around the context and huge."""
    n = model.max_model_len
    text = (st.just("") | st.text(max_size=40) | st.integers(1, 3 * n).map(lambda k: "lorem " * k)
            | big("x", 1_000_000))  # fmt: skip
    ids = st.lists(token_ids(model), max_size=12) | st.integers(n - 3, n + 2).map(lambda k: [7] * k)
    good = (st.tuples(st.just("text"), st.text(min_size=1, max_size=40))
            | st.tuples(st.just("ids"), st.lists(st.integers(0, model.vocab_size - 1), min_size=1, max_size=12)))
    return mostly(good, st.none() | st.tuples(st.just("text"), text) | st.tuples(st.just("ids"), ids), 4)


def samplings(model: Model):
    def f32(*good):  # unset or one of ``good`` values, or any 32-bit float (NaN, infinities and edges included)
        return mostly(st.none() | st.sampled_from(good), f32s(), 8)

    return st.builds(
        sampling_message,
        max_tokens=mostly(st.sampled_from([0, 1, 2, 3]), st.sampled_from([2**32 - 1]) | st.integers(0, 2**32 - 1), 4),
        temperature=f32(0.0, 1e-5, 0.7, 2.0), top_p=f32(0.1, 0.95, 1.0), min_p=f32(0.0, 0.05, 1.0),
        repetition_penalty=f32(0.5, 1.0, 1.3), presence_penalty=f32(-2.0, 0.0, 2.0),
        frequency_penalty=f32(-2.0, 0.5, 2.0),
        top_k=mostly(st.none() | st.sampled_from([-1, 0, 1, 50]),
                     st.sampled_from([-(2**31), -2, -1, 0, 1, 2**31 - 1]) | st.integers(-3, 100)),
        seed=st.none() | st.integers(-(2**63), 2**63 - 1),
        logprobs=mostly(st.none() | st.sampled_from([0, 5, 20]), st.sampled_from([21, 2**32 - 1]) | st.integers(0, 30)),
        stop=mostly(st.lists(st.text(min_size=1, max_size=8), max_size=3),
                    st.lists(st.just("") | st.text(max_size=8) | big("z", 100_000), max_size=20)),
        stop_token_ids=mostly(st.lists(st.integers(0, model.vocab_size - 1), max_size=4),
                              st.lists(token_ids(model), max_size=4) | big([1], 100_000)),
        ignore_eos=st.booleans(),
    )  # fmt: skip


def generate_requests(model: Model):
    """GenerateRequests; request ids are fresh (a uuid, padded to a drawn length with a drawn character)."""

    def build(prompt, sampling, rid_shape, session_id):
        length, pad = rid_shape
        rid = (uuid.uuid4().hex + pad * length)[:length]
        request = generate_pb2.GenerateRequest(sampling=sampling, request_id=rid, session_id=session_id)
        if prompt is not None:
            kind, value = prompt
            if kind == "text":
                request.text = value
            else:
                request.token_ids.ids.extend(value)
        return request

    rid_shapes = mostly(st.tuples(st.sampled_from([0, 32]), st.just("r")),
                        st.tuples(st.sampled_from([200, 256, 257, 1000]), st.sampled_from(["r", "é", "\n", "/"])), 8)
    sessions = st.sampled_from(["", "", "s1", "s2"]) | big("s", 100_000) | st.text(min_size=1, max_size=12)
    return st.builds(build, prompts(model), samplings(model), rid_shapes, sessions)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (numbers < 16, payloads < 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


BAD_UTF8 = [b"\xff", b"\xc3", b"\xc3(", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\x80", b"\x80abc"]


def raw_requests():
    """Bytes that are no GenerateRequest, or barely one: invalid UTF-8 in each string field, corrupt wire format,
    truncated messages, random bytes (which may parse)."""
    bad_text = st.tuples(st.text("ab", max_size=4), st.sampled_from(BAD_UTF8)).map(lambda t: t[0].encode() + t[1])
    bad_fields = st.builds(lambda where, s: {
        "text": _field(1, s),
        "request_id": _field(1, b"hi") + _field(4, s),
        "session_id": _field(1, b"hi") + _field(5, s),
        "stop": _field(1, b"hi") + _field(3, _field(11, s)),
    }[where], st.sampled_from(["text", "request_id", "session_id", "stop"]), bad_text)
    valid = generate_pb2.GenerateRequest(text="hello", sampling=types_pb2.SamplingParams(max_tokens=2,
                                                                                         stop=["x"])).SerializeToString()
    truncated = st.integers(0, len(valid) - 1).map(lambda k: valid[:k])
    return bad_fields | truncated | st.binary(max_size=40) | st.just(b"\x0a\xff\xff\xff\xff\x0f")


# -- HTTP and WebSocket ------------------------------------------------------------------------------------------

SURROGATES = ["\ud800", "a\udfffb", "\udbff\udc00\udc00"]
EDGE_VALUES = [0, 1, -1, 2, 2**32 - 1, 2**32, 2**63, -(2**63) - 1, 10**30, 0.5, 1e-46, 1e39, math.nan, math.inf,
               -math.inf, True, False, "", "x", [], {}, None, [""], ["x"] * 17, [2**32 - 1], [-1], *SURROGATES,
               [SURROGATES[0]], {"include_usage": True}, {"x": 1}]  # fmt: skip
EDGES = st.sampled_from(EDGE_VALUES) | big("y", 100_000) | big([5], 3000)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(st.characters(exclude_categories=()), max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.dictionaries(
    st.sampled_from(["role", "content", "name", "refusal", "tool_calls", "x"]),
    st.sampled_from(["user", "system", "assistant", "developer", "tool", "function", "User"]) | JSON
    | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | JSON,
                                      "text": st.sampled_from(["hi", "", *SURROGATES]) | JSON}), max_size=2),
    max_size=4,
)  # fmt: skip
FIELD_VALUES = {  # values aimed at one field's deeper checks (on top of EDGE_VALUES and JSON for every field)
    "prompt": st.text(max_size=20) | st.lists(st.integers(-1, 5000), max_size=4) | st.lists(JSON, max_size=2),
    "messages": st.lists(MESSAGE, max_size=3) | st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                                                "content": JSON}), min_size=1),
    "stop": st.lists(st.text(max_size=4) | JSON, max_size=20),
    "stop_token_ids": st.lists(st.integers(-1, 2**33), max_size=4),
    "stream_options": st.dictionaries(st.sampled_from(["include_usage", "x"]), JSON, max_size=2),
}
DELETE = object()  # a mutation that removes the field


def mutations(keys: frozenset[str]):
    """(field, value or DELETE): one field of a valid body replaced, removed or added (unknown keys too)."""
    names = st.sampled_from(sorted(keys)) | st.sampled_from(["foo", "Model", "", "prompt "]) | st.text(max_size=6)

    def values(name):
        return st.just(DELETE) | EDGES | JSON | FIELD_VALUES.get(name, st.nothing())

    return names.flatmap(lambda name: st.tuples(st.just(name), values(name)))


@dataclass(frozen=True)
class Bodies:
    """Valid bodies of one kind: ``short`` generates 2 tokens; ``long`` fills all but a few tokens of the context
    (for mutations of max_tokens: any valid value then ends within a few tokens)."""

    path: str
    keys: frozenset[str]
    short: dict
    long: dict

    def mutated(self, field: str, value) -> dict:
        body = dict(self.long if field in ("max_tokens", "max_completion_tokens") else self.short)
        if value is DELETE:
            body.pop(field, None)
        else:
            body[field] = value
        return body


# Words that name a field in the router's own rejections (HTTP 400 with param null: checks that need the model).
ROUTER_WORDS = {"prompt": "prompt", "messages": "prompt", "stop_token_ids": "stop token id"}
# Fields whose fault may be reported under another param (max_tokens and max_completion_tokens disagree).
ALIASES = {"max_completion_tokens": ("max_tokens",)}


def names_field(error: dict, field: str) -> bool:
    """Whether an error names ``field``: as its param (or a part of it), or in the router's message."""
    param = error["param"]
    if param is None:
        return field in ROUTER_WORDS and ROUTER_WORDS[field] in error["message"]
    return any(param == f or param.startswith((f + ".", f + "[")) for f in (field, *ALIASES.get(field, ())))


def dumps(body) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity as Python writes them; lone surrogates as \\udXXX escapes


def raw_bodies(model_name: str):
    """Bodies that are not JSON, not UTF-8, nested deeper than any parser's limit, truncated, or huge."""
    m = model_name.encode()
    valid = b'{"model":"%s","prompt":"Hello","max_tokens":2}' % m

    def nested(depth: int) -> list[bytes]:
        inner = b"[" * depth + b"]" * depth
        return [inner, b'{"model":"%s","prompt":%s}' % (m, inner),
                b'{"model":"%s","messages":[{"role":"user","content":%s}]}' % (m, inner)]

    return st.one_of(
        st.binary(max_size=64),
        st.text(max_size=64).map(str.encode),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.tuples(st.integers(1, 3000) | st.integers(900, 1000), st.integers(0, 2)).map(lambda t: nested(t[0])[t[1]]),
        st.integers(0, len(valid) - 1).map(lambda k: valid[:k]),
        st.tuples(st.integers(0, len(valid)), st.sampled_from(BAD_UTF8)).map(
            lambda t: valid[: t[0]] + t[1] + valid[t[0]:]),
        st.sampled_from([
            valid.decode().encode("utf-16"),  # JSON in UTF-16: json.loads detects it
            b"\xef\xbb\xbf" + valid,  # a UTF-8 byte order mark
            b'{"model":"%s","prompt":"\xe9"}' % m,  # Latin-1, not UTF-8
            b'{"model":"%s","max_tokens":%s}' % (m, b"9" * 5000),  # past Python's int-digit limit
            b'{"model":"%s","prompt":"hi","max_tokens":2,"x":"%s"}' % (m, b"\\ud800"),
            b"", b"null", b"NaN", b"[]", b'"hi"', b"{", b"}", b'{"a":1,"a":2}',
        ]),
        big(b"lorem ", 400_000).map(lambda p: b'{"model":"%s","prompt":"%s","max_tokens":2}' % (m, p)),  # 2.4 MB
    )  # fmt: skip


def not_json(data: bytes | str) -> bool:
    """Whether ``data`` is surely no JSON (nesting too deep for this thread's stack may still parse on the
    router's, which is shallower: not sure)."""
    try:
        json.loads(data)
    except ValueError:
        return True
    except RecursionError:
        return False
    return False


TIMEOUTS = st.sampled_from(["nan", "-1", "0", "-0", "inf", "1e309", "abc", "", " ", "0x10", "1_000", " 5", "30",
                            "1e-300", "5e-324"]) | st.text(st.characters(min_codepoint=32, max_codepoint=126),
                                                           max_size=8)  # fmt: skip
