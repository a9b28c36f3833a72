"""The OpenAI-compatible API's errors: :class:`OpenAIError`, the gRPC status → HTTP mapping, value checks.

The OpenAI protocol layer is pure (no I/O, no sockets, no clocks) and lives in three modules:

- ``openai_protocol`` (this one): the error every parser raises and the HTTP front answers with;
  ``status_of_grpc`` / ``error_from_grpc`` turn the router's gRPC failures into OpenAI error bodies
  (``rate_limit_error`` a caller's rate limit);
  the typed JSON value checks (``int_value``, ``float_value``, ...) the parsers share;
- ``openai_requests``: ``parse_completion`` / ``parse_chat`` validate a JSON body into a
  ``ParsedRequest`` that builds the router's ``GenerateRequest``;
- ``openai_responses``: the response, chunk, usage, model-list and logprobs dicts (ready for
  ``json.dumps``) in the shapes the official ``openai`` client parses.

Error body shape (OpenAI's): ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# gRPC status code name → (HTTP status, OpenAI error type, code). Anything else is a 500 server_error.
# FAILED_PRECONDITION only arises between pdserve's own workers (a KV hand-off whose identities disagree);
# the router retries it on another pair, so one that reaches the client means no healthy pair: 503.
_GRPC_TO_HTTP: dict[str, tuple[int, str, str | None]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "OUT_OF_RANGE": (400, "invalid_request_error", None),
    "UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
    "PERMISSION_DENIED": (403, "permission_error", None),
    "NOT_FOUND": (404, "invalid_request_error", "not_found"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "CANCELLED": (499, "cancelled", "request_cancelled"),
    "FAILED_PRECONDITION": (503, "service_unavailable", "service_unavailable"),
    "UNAVAILABLE": (503, "service_unavailable", "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout", "timeout"),
}
_SERVER_ERROR: tuple[int, str, str | None] = (500, "server_error", None)


@dataclass(eq=False)  # identity equality keeps the exception hashable
class OpenAIError(Exception):
    """A failed API call: ``status`` is the HTTP status; ``body()`` is what the client gets.

    ``param`` names the request field at fault (``"temperature"``, ``"messages[1].content"``) or is None;
    ``code`` is a machine-readable reason (``"model_not_found"``) or None.
    """

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def show(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages that name a bad value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_type(value: object) -> str:
    """The JSON type name of a decoded value ("object", "array", "string", "number", "boolean", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


def invalid(param: str | None, message: str) -> OpenAIError:
    """A 400 invalid_request_error about ``param`` (the parsers' one way to reject a value)."""
    return OpenAIError(400, message, "invalid_request_error", param)


def status_of_grpc(code_name: str) -> int:
    """The HTTP status for a gRPC status code name (``"UNAVAILABLE"`` → 503); unknown names → 500."""
    return _GRPC_TO_HTTP.get(code_name, _SERVER_ERROR)[0]


def error_from_grpc(code_name: str, details: str) -> OpenAIError:
    """The OpenAI error for a failed router call (``grpc.RpcError.code().name``, ``.details()``).

    The message is the router's details (they name the bad value or the failing worker), else the code name.
    """
    status, kind, code = _GRPC_TO_HTTP.get(code_name, _SERVER_ERROR)
    return OpenAIError(status, details or f"generation failed: {code_name}", kind, None, code)


def rate_limit_error(limit: str, details: str) -> OpenAIError:
    """The OpenAI error for a request refused by the caller's rate limit (``limit``: ``requests`` or ``tokens``):
    429, ``type`` the budget as OpenAI names it, ``code`` ``rate_limit_exceeded``. A saturated cluster's 429 keeps
    ``type`` ``rate_limit_error`` (:func:`error_from_grpc`), so a client can tell its own quota from a busy cluster."""
    return OpenAIError(429, details, limit, None, "rate_limit_exceeded")


# -- JSON value checks (each raises a 400 naming the param and the value) ----------------------------------------------


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_value(obj: dict, key: str, low: int, high: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not is_int(value):
        raise invalid(key, f"{key} must be an integer, got {show(value)}")
    if not low <= value <= high:
        raise invalid(key, f"{key} must be in [{low}, {high}], got {value}")
    return value


def float_value(obj: dict, key: str, low: float, high: float | None, *, low_open: bool = False) -> float | None:
    """A finite number in [low, high] ((low, high] when ``low_open``; no upper bound when ``high`` is None) that
    a 32-bit float holds (the proto field's width)."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(key, f"{key} must be a number, got {show(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(key, f"{key} must be a finite number, got {value}")
    above = value > low if low_open else value >= low
    if not above or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
        raise invalid(key, f"{key} must be in {bounds}, got {show(value)}")
    try:
        as_float32 = struct.unpack("f", struct.pack("f", value))[0]  # inf, or OverflowError, past float32's range
    except OverflowError:
        as_float32 = math.inf
    if math.isinf(as_float32):
        raise invalid(key, f"{key} is too large for a 32-bit float, got {show(value)}")
    if low_open and as_float32 <= low:
        raise invalid(key, f"{key} must be > {low:g} as a 32-bit float, got {value!r} ({as_float32:g})")
    return float(value)


def bool_value(obj: dict, key: str, param: str | None = None) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise invalid(param or key, f"{param or key} must be a boolean, got {show(value)}")


def string_value(obj: dict, key: str, param: str | None = None) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return unicode_text(value, param or key)
    raise invalid(param or key, f"{param or key} must be a string, got {show(value)}")


def unicode_text(value: str, param: str) -> str:
    """``value``, unless it holds a lone UTF-16 surrogate (a JSON ``"\\ud800"`` escape decodes to one): no UTF-8
    text, protobuf string or tokenizer takes it, so it is a 400 naming ``param`` and where the surrogate is."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(param, f"{param} holds a lone UTF-16 surrogate {value[exc.start]!r} at index {exc.start}, "
                             f"which is not valid Unicode") from None
    return value


def array_value(obj: dict, key: str) -> list:
    """The list at ``key``; [] when absent or null."""
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(key, f"{key} must be an array, got {show(value)}")
    return value


def token_ids(values: list, param: str) -> list[int]:
    for t in values:
        if not is_int(t) or not 0 <= t <= UINT32_MAX:
            raise invalid(param, f"{param} must hold token ids (integers in [0, {UINT32_MAX}]), got {show(t)}")
    return list(values)


def only(obj: dict, key: str, allowed: tuple, why: str) -> None:
    """Reject ``key`` unless it is null or one of ``allowed`` (same JSON type: ``true`` is not 1)."""
    value = obj.get(key)
    if value is None or any(type(value) is type(a) and value == a for a in allowed):
        return
    raise invalid(key, f"{key}={show(value)} is not supported: {why}")
