"""OpenAI response bodies: completions, chat completions, their stream chunks, usage, the model list, logprobs.

Every builder returns a new plain dict ready for ``json.dumps`` (logprobs are clamped, so no NaN or Infinity)
in the shape the official ``openai`` client parses (``openai.types.Completion``,
``openai.types.chat.ChatCompletion`` / ``ChatCompletionChunk``, ``openai.types.Model``).

A stream (server-sent events, each chunk a ``data:`` line, then ``data: [DONE]``) built from the router's
``GenerateResponse`` messages:

- completions: ``completion_chunk(..., text=msg.text, finish_reason=None)`` per message; the last message
  (it carries ``finish_reason`` and ``usage``) gives the chunk with ``finish_reason_of(msg.finish_reason)``;
- chat: first ``chat_chunk(..., delta={"role": "assistant", "content": ""}, finish_reason=None)``, then
  ``delta={"content": msg.text}``, and ``delta={}`` with the finish reason last;
- with ``stream_options.include_usage``: ``usage_chunk(...)`` after the last chunk (``choices`` is []).

Finish reasons: STOP → "stop", LENGTH → "length", ABORT → "abort". "abort" is not an OpenAI value (it is
vLLM's): the official client parses it (it builds response models without validation unless the client was
made with ``_strict_response_validation``), but the front may prefer to answer an aborted generation with
an error. Note that ``openai.types.Completion`` itself declares ``finish_reason`` non-null, yet OpenAI's own
completion stream sends null on all chunks but the last, as this module does.

Logprobs token strings: ``tokenizer.decode([token_id])`` (what vLLM does), so a token holding part of a
UTF-8 character reads "\\ufffd". Chat ``bytes`` are the token's own bytes: the UTF-8 of its text, except
when that text has "\\ufffd", where the raw token (``convert_ids_to_tokens``) is mapped back through the
byte-level BPE alphabet (GPT-2's) or a SentencePiece byte-fallback piece ``<0xNN>``. Completion ``text_offset``
counts characters of those token strings from ``text_offset`` (the completion's start, not the prompt's).
Logprobs below -9999 (or NaN) are sent as -9999, like vLLM, since JSON has no -Infinity.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

from pdserve.v1 import types_pb2

LOGPROB_FLOOR = -9999.0
_OBJECTS = {"completion": "text_completion", "chat": "chat.completion.chunk"}  # streamed object per kind
_ID_PREFIXES = {"completion": "cmpl-", "chat": "chatcmpl-"}
_FINISH_REASONS: dict[int, str | None] = {
    types_pb2.FINISH_REASON_UNSPECIFIED: None,
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_ABORT: "abort",
}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def new_id(kind: str) -> str:
    """A fresh response id: "cmpl-<32 hex>" for kind "completion", "chatcmpl-<32 hex>" for "chat"."""
    if kind not in _ID_PREFIXES:
        raise ValueError(f"kind must be 'completion' or 'chat', got {kind!r}")
    return _ID_PREFIXES[kind] + uuid.uuid4().hex


def finish_reason_of(value: int) -> str | None:
    """The OpenAI finish_reason of a ``pdserve.v1.FinishReason`` value; UNSPECIFIED (not finished) → None."""
    if value not in _FINISH_REASONS:
        raise ValueError(f"unknown FinishReason value {value!r}")
    return _FINISH_REASONS[value]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def models_list(model_id: str, created: int) -> dict:
    """``GET /v1/models``: the one served model."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "pdserve"}]}


# -- completions ------------------------------------------------------------------------------------------------


def completion_chunk(id: str, created: int, model: str, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:  # fmt: skip
    """One streamed ``/v1/completions`` chunk (object "text_completion", like OpenAI's stream)."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def completion_response(id: str, created: int, model: str, text: str, finish_reason: str | None, usage: dict,
                        logprobs: dict | None = None) -> dict:  # fmt: skip
    """The whole ``/v1/completions`` answer; ``usage`` from :func:`usage`."""
    return completion_chunk(id, created, model, text, finish_reason, logprobs) | {"usage": usage}


# -- chat -------------------------------------------------------------------------------------------------------


def chat_chunk(id: str, created: int, model: str, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:  # fmt: skip
    """One streamed chat chunk: ``delta`` is {"role": "assistant", "content": ""} first, then {"content": text},
    and {} (with ``finish_reason``) last."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def chat_response(id: str, created: int, model: str, content: str, finish_reason: str | None, usage: dict,
                  logprobs: dict | None = None) -> dict:  # fmt: skip
    """The whole ``/v1/chat/completions`` answer; ``usage`` from :func:`usage`."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
              "finish_reason": finish_reason}  # fmt: skip
    return {"id": id, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage}  # fmt: skip


def usage_chunk(kind: str, id: str, created: int, model: str, usage: dict) -> dict:
    """The final chunk of a stream with ``stream_options.include_usage``: ``choices`` [] and ``usage``;
    ``kind`` is "completion" or "chat" (it picks the object name)."""
    if kind not in _OBJECTS:
        raise ValueError(f"kind must be 'completion' or 'chat', got {kind!r}")
    return {"id": id, "object": _OBJECTS[kind], "created": created, "model": model, "choices": [], "usage": usage}


# -- logprobs ---------------------------------------------------------------------------------------------------


class TokenStrings:
    """Token id → (text, bytes) for logprobs, cached per id. Build one per tokenizer in the entry point and
    share it (at most one entry per vocabulary id; a racing duplicate computation is harmless)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._get(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._get(token_id)[1]

    def _get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id])
            hit = self._cache[token_id] = (text, self._bytes_of(token_id, text))
        return hit

    def _bytes_of(self, token_id: int, text: str) -> list[int]:
        if "\ufffd" in text:  # part of a UTF-8 character: the raw token holds the bytes
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece:
                fallback = _BYTE_FALLBACK.fullmatch(piece)
                if fallback:
                    return [int(fallback.group(1), 16)]
                if all(c in _BYTE_LEVEL_DECODER for c in piece):
                    return [_BYTE_LEVEL_DECODER[c] for c in piece]
        return list(text.encode("utf-8"))


def completion_logprobs(entries: Sequence[types_pb2.TokenLogprob], strings: TokenStrings,
                        text_offset: int = 0) -> dict:  # fmt: skip
    """``choices[0].logprobs`` of a completion (legacy shape) for these tokens.

    ``text_offset`` is where the first token starts; a stream passes the running total
    ``previous_offset + sum(len(t) for t in previous["tokens"])``. ``top_logprobs[i]`` maps each alternative's
    text to its logprob (alternatives whose texts coincide keep the first).
    """
    tokens = [strings.text(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    tops = [_first_per_text((strings.text(t.token_id), clamp_logprob(t.logprob)) for t in e.top) for e in entries]
    return {"tokens": tokens, "token_logprobs": [clamp_logprob(e.logprob) for e in entries], "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(entries: Sequence[types_pb2.TokenLogprob], strings: TokenStrings) -> dict:
    """``choices[0].logprobs`` of a chat completion or chunk: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``."""

    def one(token_id: int, logprob: float) -> dict:
        return {"token": strings.text(token_id), "logprob": clamp_logprob(logprob), "bytes": strings.bytes(token_id)}

    return {"content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
                        for e in entries]}  # fmt: skip


def clamp_logprob(value: float) -> float:
    """A logprob JSON can carry: in [LOGPROB_FLOOR, 0]; NaN and -inf → LOGPROB_FLOOR."""
    if value >= 0.0:
        return 0.0
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _first_per_text(pairs) -> dict[str, float]:
    out: dict[str, float] = {}
    for text, logprob in pairs:
        out.setdefault(text, logprob)
    return out


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character standing for each byte → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_LEVEL_DECODER = _byte_level_decoder()
