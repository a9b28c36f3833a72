"""Validate OpenAI ``/v1/completions`` and ``/v1/chat/completions`` bodies into a :class:`ParsedRequest`.

Contract: ``parse_completion`` and ``parse_chat`` take any value ``json.loads`` can return (NaN and
Infinity included) and either return a ``ParsedRequest`` whose ``to_generate_request()`` builds a valid
``GenerateRequest``, or raise :class:`OpenAIError`: 400 ``invalid_request_error`` whose ``param`` names the
field and whose message names the bad value, or 404 ``model_not_found``. They raise nothing else. Text that
reaches the model (prompt, stop strings, message contents and names, ``session_id``) must be valid Unicode: a
lone surrogate is a 400. ``parse_json`` turns the raw body into that value (or a 400 saying why it is none).

Checks run in a fixed order, so the first fault reported is deterministic: the body is an object → no
unrecognized keys (the first in body order) → ``model`` → the prompt (``prompt`` / ``messages``) →
``max_tokens`` → sampling fields → the rest. Rendering the chat template comes last (the costly step).

Ranges are OpenAI's where it documents one (temperature [0, 2], penalties [-2, 2]), else the engine's
(``common.engine.sampling_params``: at most 20 logprobs, 16 stop strings) or the proto field's width.
Integers must be JSON integers (``true`` and ``16.0`` are rejected); null means "not given".

Extensions beyond OpenAI (vLLM's names): ``top_k`` (-1 or 0 is off), ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``. Accepted and ignored: ``user``. Accepted only at their no-op value:
``n`` = 1, ``best_of`` = 1, ``echo`` = false, ``suffix`` = "", ``logit_bias`` = {}, ``tools`` = [],
``tool_choice`` = "none" | "auto", ``response_format`` = {"type": "text"}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.engine.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS
from pdserve.client import sampling_message
from pdserve.v1 import generate_pb2
from services.router.openai_protocol import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    UINT32_MAX,
    OpenAIError,
    array_value,
    bool_value,
    float_value,
    int_value,
    invalid,
    json_type,
    only,
    show,
    string_value,
    token_ids,
    unicode_text,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat leaves it to the router

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos")  # fmt: skip
_COMMON_KEYS = {"model", "max_tokens", "logprobs", "n", "stream", "stream_options", "user", "logit_bias",
                "session_id", *_SAMPLING_KEYS}  # fmt: skip
COMPLETION_KEYS = frozenset(_COMMON_KEYS | {"prompt", "echo", "best_of", "suffix"})
CHAT_KEYS = frozenset(_COMMON_KEYS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                      "response_format"})  # fmt: skip


@dataclass
class ParsedRequest:
    """A validated request. Exactly one of ``prompt_text`` / ``prompt_ids`` is set (chat: always ids).

    ``sampling`` holds the keyword arguments of ``pdserve.client.sampling_message`` that the request set
    (absent keys take the model's defaults); its ``"logprobs"`` equals ``logprobs`` when that is not None.
    ``logprobs`` is the number of top alternatives per token to return (0: only the sampled token's);
    None returns no logprobs. ``include_usage`` is only ever true with ``stream``.
    """

    kind: str  # "completion" | "chat"
    model: str
    prompt_text: str | None
    prompt_ids: list[int] | None
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    session_id: str = ""  # pdserve's extension: the turns of one conversation reuse its KV

    def to_generate_request(self, request_id: str = "") -> generate_pb2.GenerateRequest:
        """The router's request; ``request_id`` "" lets the router make one."""
        request = generate_pb2.GenerateRequest(sampling=sampling_message(**self.sampling), request_id=request_id,
                                               session_id=self.session_id)
        if self.prompt_ids is not None:
            request.token_ids.ids.extend(self.prompt_ids)
        else:
            request.text = self.prompt_text or ""
        return request


def parse_json(raw: bytes | str, what: str = "request body") -> object:
    """The JSON value of a request body or message (bytes in UTF-8, -16 or -32, as ``json.loads`` reads them), or
    a 400 naming ``what`` and the problem: bad syntax or encoding, an integer past Python's digit limit, or nesting
    deeper than the parser's recursion limit."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise invalid(None, f"{what} is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors, so is the digit limit
        raise invalid(None, f"{what} is not valid JSON: {exc}") from None


def parse_completion(body: object, *, served_model: str) -> ParsedRequest:
    """A ``/v1/completions`` body (see the module docstring); ``max_tokens`` defaults to 16."""
    _check_keys(body, COMPLETION_KEYS)
    model = _model(body, served_model)
    text, ids = _prompt(body)
    max_tokens = int_value(body, "max_tokens", 1, UINT32_MAX)
    sampling = {"max_tokens": COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, **_sampling(body)}
    logprobs = int_value(body, "logprobs", 0, MAX_LOGPROBS)
    only(body, "n", (1,), "one choice per request")
    only(body, "best_of", (1,), "one choice per request")
    only(body, "echo", (False,), "the prompt is not echoed")
    only(body, "suffix", ("",), "suffix (insertion) is not supported")
    only(body, "logit_bias", ({},), "biasing tokens is not implemented")
    string_value(body, "user")
    stream, include_usage = _stream(body)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    return ParsedRequest("completion", model, text, ids, sampling, stream, include_usage, logprobs,
                         _session_id(body))


def parse_chat(body: object, *, served_model: str, tokenizer: Any) -> ParsedRequest:
    """A ``/v1/chat/completions`` body, rendered with ``tokenizer``'s chat template (generation prompt added).

    ``max_completion_tokens`` (or the older ``max_tokens``) unset leaves the router's default.
    """
    _check_keys(body, CHAT_KEYS)
    model = _model(body, served_model)
    messages = _messages(body)
    max_tokens = _chat_max_tokens(body)
    sampling = ({} if max_tokens is None else {"max_tokens": max_tokens}) | _sampling(body)
    logprobs = _chat_logprobs(body)
    only(body, "n", (1,), "one choice per request")
    only(body, "logit_bias", ({},), "biasing tokens is not implemented")
    only(body, "tools", ([],), "tools are not supported")
    only(body, "tool_choice", ("none", "auto"), "tools are not supported")
    only(body, "response_format", ({"type": "text"},), "only {'type': 'text'} is supported")
    string_value(body, "user")
    stream, include_usage = _stream(body)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    ids = render_chat(messages, tokenizer)
    return ParsedRequest("chat", model, None, ids, sampling, stream, include_usage, logprobs, _session_id(body))


def _session_id(body: dict) -> str:
    """The ``session_id`` extension: up to 256 characters without whitespace, or absent."""
    value = string_value(body, "session_id")
    if value is not None and (not value or len(value) > 256 or any(c.isspace() for c in value)):
        raise invalid("session_id", f"session_id must be 1-256 characters without whitespace, got {show(value)}")
    return value or ""


# -- fields ---------------------------------------------------------------------------------------------------


def _check_keys(body: object, allowed: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {json_type(body)}")
    for key in body:
        if key not in allowed:
            raise invalid(str(key), f"unrecognized request argument supplied: {show(key)}")


def _model(body: dict, served_model: str) -> str:
    value = body.get("model")
    if value is None:
        raise invalid("model", "model is required")
    if not isinstance(value, str):
        raise invalid("model", f"model must be a string, got {show(value)}")
    if value != served_model:
        raise OpenAIError(404, f"the model {show(value)} does not exist; this server serves {served_model!r}",
                          "invalid_request_error", "model", "model_not_found")  # fmt: skip
    return value


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids). A one-element array of prompts is that prompt."""
    value = body.get("prompt")
    if value is None:
        raise invalid("prompt", "prompt is required")
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1:
            raise invalid("prompt", f"batched prompts are not supported; send one prompt per request "
                                    f"(got {len(value)} prompts)")  # fmt: skip
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise invalid("prompt", "prompt is empty")
        return unicode_text(value, "prompt"), None
    if not isinstance(value, list):
        raise invalid("prompt", f"prompt must be a string or an array of token ids, got {show(value)}")
    if not value:
        raise invalid("prompt", "prompt is empty")
    return None, token_ids(value, "prompt")


def _sampling(body: dict) -> dict[str, Any]:
    """The sampling fields the body sets (sampling_message's keyword arguments)."""
    fields = {
        "temperature": float_value(body, "temperature", 0.0, 2.0),
        "top_p": float_value(body, "top_p", 0.0, 1.0, low_open=True),
        "top_k": int_value(body, "top_k", -1, INT32_MAX),
        "min_p": float_value(body, "min_p", 0.0, 1.0),
        "repetition_penalty": float_value(body, "repetition_penalty", 0.0, None, low_open=True),
        "presence_penalty": float_value(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": float_value(body, "frequency_penalty", -2.0, 2.0),
        "seed": int_value(body, "seed", INT64_MIN, INT64_MAX),
        "stop": _stop(body),
        "stop_token_ids": token_ids(array_value(body, "stop_token_ids"), "stop_token_ids"),
        "ignore_eos": bool_value(body, "ignore_eos"),
    }
    return {name: v for name, v in fields.items() if v is not None and v is not False and v != []}


def _chat_max_tokens(body: dict) -> int | None:
    new = int_value(body, "max_completion_tokens", 1, UINT32_MAX)
    old = int_value(body, "max_tokens", 1, UINT32_MAX)
    if new is not None and old is not None and new != old:
        raise invalid("max_tokens", f"max_tokens ({old}) and max_completion_tokens ({new}) disagree; send one")
    return new if new is not None else old


def _chat_logprobs(body: dict) -> int | None:
    wanted = bool_value(body, "logprobs")
    top = int_value(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs", f"top_logprobs ({top}) requires logprobs: true, "
                                      f"got logprobs={show(body.get('logprobs'))}")  # fmt: skip
    return (top or 0) if wanted else None


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(bool_value(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", f"stream_options must be an object, got {show(options)}")
    for key in options:
        if key != "include_usage":
            raise invalid(f"stream_options.{key}", f"unrecognized stream option: {show(key)}")
    return stream, bool(bool_value(options, "include_usage", "stream_options.include_usage"))


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is not None and not isinstance(value, (str, list)):
        raise invalid("stop", f"stop must be a string or an array of strings, got {show(value)}")
    items = [value] if isinstance(value, str) else array_value(body, "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    for s in items:
        if not isinstance(s, str):
            raise invalid("stop", f"stop strings must be strings, got {show(s)}")
        if not s:
            raise invalid("stop", "stop strings must not be empty")
        unicode_text(s, "stop")
    return items


# -- chat messages ------------------------------------------------------------------------------------------

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # → template role
_MESSAGE_KEYS = frozenset({"role", "content", "name"})
# What a client may send back from an earlier response: accepted only when null or [].
_NULL_MESSAGE_KEYS = frozenset({"refusal", "tool_calls", "function_call", "audio", "annotations", "tool_call_id"})


def _messages(body: dict) -> list[dict[str, str]]:
    """The messages as the chat template takes them: ``{"role", "content": str}`` (+ ``"name"`` when given).

    ``developer`` (OpenAI's successor of ``system``) renders as ``system``; text content parts are joined with
    "\n" (as vLLM does); other part types, ``tool`` messages and tool calls are rejected.
    """
    value = body.get("messages")
    if value is None:
        raise invalid("messages", "messages is required")
    if not isinstance(value, list) or not value:
        raise invalid("messages", f"messages must be a non-empty array of messages, got {show(value)}")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(msg: object, at: str) -> dict[str, str]:
    if not isinstance(msg, dict):
        raise invalid(at, f"{at} must be an object, got {show(msg)}")
    for key, value in msg.items():
        if key in _NULL_MESSAGE_KEYS and value not in (None, []):
            raise invalid(f"{at}.{key}", f"{at}.{key} is not supported (tools, audio, refusals), got {show(value)}")
        if key not in _MESSAGE_KEYS and key not in _NULL_MESSAGE_KEYS:
            raise invalid(f"{at}.{key}", f"unrecognized message field {show(key)} in {at}")
    role = msg.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        why = "; this server does not support tools" if role in ("tool", "function") else ""
        raise invalid(f"{at}.role", f"{at}.role must be one of {', '.join(map(repr, _ROLES))}, got {show(role)}{why}")
    out = {"role": _ROLES[role], "content": _content(msg.get("content"), f"{at}.content")}
    name = string_value(msg, "name", f"{at}.name")
    if name is not None:
        out["name"] = name
    return out


def _content(value: object, at: str) -> str:
    if isinstance(value, str):
        return unicode_text(value, at)
    if not isinstance(value, list):
        raise invalid(at, f"{at} must be a string or an array of text parts, got {show(value)}")
    texts = []
    for j, part in enumerate(value):
        where = f"{at}[{j}]"
        if not isinstance(part, dict):
            raise invalid(where, f"{where} must be a content part object, got {show(part)}")
        if part.get("type") != "text":
            raise invalid(f"{where}.type", f"content part type {show(part.get('type'))} is not supported; only 'text'")
        extra = next((k for k in part if k not in ("type", "text")), None)
        if extra is not None:
            raise invalid(f"{where}.{extra}", f"unrecognized content part field {show(extra)} in {where}")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.text", f"{where}.text must be a string, got {show(part.get('text'))}")
        texts.append(unicode_text(part["text"], f"{where}.text"))
    return "\n".join(texts)


def render_chat(messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` as a list of ids
    (transformers 5 returns a ``BatchEncoding``, 4 a list). A template that raises (templates reject bad
    conversations with ``raise_exception``) or a tokenizer without one is a 400 about ``messages``."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("messages", "the model has no chat template; use /v1/completions")
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - whatever the template raises is about the conversation
        raise invalid("messages", f"the chat template rejected the messages: {exc}") from exc
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    if len(ids) and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    if not len(ids):
        raise invalid("messages", "the chat template rendered an empty prompt")
    return [int(t) for t in ids]
