"""Structured logs: one JSON object per line, carrying the request id (and the trace id when a span is current).

Who calls what:

- the entry point, once at start: :func:`setup_logging` (``fmt`` ``"json"`` or ``"text"``);
- the servicer, once per call, inside the handler: ``with request_scope(request_id): ...``;
- any code: ``logging.getLogger(__name__).info(...)``; :func:`current_request_id` where the id is needed
  as a value (e.g. to stamp a record).

Threads: gRPC's synchronous server runs each handler on a thread of its pool, and a thread pool does not
carry :mod:`contextvars` from the thread that accepted the call. So :func:`request_scope` must be entered
by the servicer inside the handler, per call, never around ``server.start()``. A response-streaming handler
(a generator) enters it inside the generator body: the sync server drives a generator from one thread, so
the scope holds across its yields and ends when the generator finishes or is closed.

JSON line keys (:class:`JsonFormatter`): ``ts`` (ISO-8601 UTC, milliseconds, ``Z``), ``level``, ``logger``,
``msg``, ``service``; then, only when present: ``request_id``, ``trace_id`` (32 hex), ``exc`` (traceback),
``stack``, and every ``extra=`` field. The ``extra=`` ``request_id`` wins over the one in scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import TextIO

# A ContextVar is a key into each thread's / task's context, not shared state: Python requires it to be
# created once at module level (a ContextVar made per call would never be found again).
_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default="")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("json", "text")

# Attributes every LogRecord has (plus those the formatters add); anything else on a record came from
# ``extra=`` and is emitted as a JSON key.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",  # Python >= 3.12
}
# Keys the JSON formatter writes itself; an ``extra=`` field with one of these names does not overwrite it.
_RESERVED_KEYS = frozenset({"ts", "level", "logger", "msg", "service", "request_id", "trace_id", "exc", "stack"})


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[str]:
    """Make ``request_id`` the current request id of this thread (or asyncio task) for the ``with`` body.

    Restores the previous id on exit, also on an exception; scopes nest. Yields ``request_id``. Raises
    ``TypeError`` when ``request_id`` is not a ``str``. See the module docstring on thread pools.
    """
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}: {request_id!r}")
    token = _REQUEST_ID.set(request_id)
    try:
        yield request_id
    finally:
        _REQUEST_ID.reset(token)


def current_request_id() -> str:
    """The request id of the innermost :func:`request_scope` of this thread/task; ``""`` when none."""
    return _REQUEST_ID.get()


def _record_request_id(record: logging.LogRecord) -> str:
    """``extra={"request_id": ...}`` when given, else the id in scope; ``""`` when neither."""
    explicit = record.__dict__.get("request_id")
    if explicit is not None and explicit != "":
        return str(explicit)
    return _REQUEST_ID.get()


def _current_trace_id() -> str:
    """Hex trace id (32 chars) of the current OpenTelemetry span; ``""`` when none is current.

    Cheap when tracing is unused: if ``opentelemetry.trace`` was never imported, no span can be current,
    so it is not imported here either.
    """
    otel_trace = sys.modules.get("opentelemetry.trace")
    if otel_trace is None:
        return ""
    span_context = otel_trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return ""
    return f"{span_context.trace_id:032x}"


def _iso_utc_ms(created_s: float) -> str:
    """``2024-05-01T12:34:56.789Z`` for a ``time.time()`` value (truncated to milliseconds)."""
    whole_s = int(created_s)
    ms = int((created_s - whole_s) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole_s)) + f".{ms:03d}Z"


class JsonFormatter(logging.Formatter):
    """Formats a record as one compact JSON object (no newline inside; see the module docstring for keys).

    ``service`` names the process's role (``"router"``, ``"prefill"``, ``"decode"``) and is on every line.
    Values that JSON cannot encode are written as ``str(value)``.
    """

    def __init__(self, service: str) -> None:
        super().__init__()
        if not isinstance(service, str) or not service:
            raise ValueError(f"service must be a non-empty str, got {service!r}")
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": _iso_utc_ms(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "service": self.service,
        }
        request_id = _record_request_id(record)
        if request_id:
            entry["request_id"] = request_id
        trace_id = _current_trace_id()
        if trace_id:
            entry["trace_id"] = trace_id
        if record.exc_info:
            if not record.exc_text:  # cached on the record, as logging.Formatter does
                record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and key not in _RESERVED_KEYS and not key.startswith("_"):
                entry[key] = value
        return json.dumps(entry, default=str, separators=(",", ":"), ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The human format ``%(asctime)s %(levelname)s %(name)s: %(message)s``, plus `` [request_id]`` at the
    end of the first line when a request id is in scope (or given as ``extra=``)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        request_id = _record_request_id(record)
        return f"{line} [{request_id}]" if request_id else line


def setup_logging(level: str, fmt: str, service: str, stream: TextIO | None = None) -> logging.Handler:
    """Configure the root logger: ``level`` (a name: ``"INFO"``, ``"debug"``, ...), one handler writing to
    ``stream`` (``None``: ``sys.stderr`` as of this call) in ``fmt`` ``"json"`` or ``"text"``.

    Replaces every handler the root logger has (as ``logging.basicConfig(force=True)`` does), so a second
    call reconfigures instead of adding a handler. Returns the installed handler. Raises ``ValueError``
    naming a bad ``level``, ``fmt`` or ``service``. Called once by the entry point, before serving.
    """
    level_name = level.upper() if isinstance(level, str) else level
    level_no = logging.getLevelName(level_name)
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r} (expected e.g. DEBUG, INFO, WARNING, ERROR)")
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter(service)
    elif fmt == "text":
        if not isinstance(service, str) or not service:
            raise ValueError(f"service must be a non-empty str, got {service!r}")
        formatter = TextFormatter()
    else:
        raise ValueError(f"unknown log format {fmt!r} (expected one of {', '.join(FORMATS)})")

    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level_no)
    return handler
