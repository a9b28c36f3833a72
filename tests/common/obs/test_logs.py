"""common.obs.logs: JSON lines with the request id in scope, extra fields, exceptions, the trace id of the
current span, the text format, and idempotent setup."""

from __future__ import annotations

import io
import json
import logging
import re
import threading

import pytest

from common.obs.logs import current_request_id, request_scope, setup_logging
from common.obs.tracing import Tracing, trace_id_of

TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
LOGGER = "pdserve.test"


@pytest.fixture
def restore_root():
    """Put the root logger's handlers and level back after the test (setup_logging replaces them)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture
def json_stream(restore_root) -> io.StringIO:
    stream = io.StringIO()
    setup_logging("info", "json", "router", stream=stream)
    return stream


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_has_exactly_the_base_keys_outside_a_scope(json_stream):
    logging.getLogger(LOGGER).info("hello %s", "world")
    [entry] = lines(json_stream)
    assert set(entry) == {"ts", "level", "logger", "msg", "service"}
    assert TS_RE.match(entry["ts"]), entry["ts"]
    assert (entry["level"], entry["logger"], entry["msg"], entry["service"]) == (
        "INFO",
        LOGGER,
        "hello world",
        "router",
    )
    assert "\n" not in json_stream.getvalue().rstrip("\n")


def test_request_id_inside_scope_only_and_scopes_nest(json_stream):
    log = logging.getLogger(LOGGER)
    assert current_request_id() == ""
    with request_scope("req-1") as rid:
        assert rid == "req-1" and current_request_id() == "req-1"
        log.info("a")
        with request_scope("req-2"):
            log.info("b")
        log.info("c")
    log.info("d")
    assert current_request_id() == ""
    assert [e.get("request_id") for e in lines(json_stream)] == ["req-1", "req-2", "req-1", None]


def test_scope_is_restored_when_the_body_raises():
    with pytest.raises(RuntimeError):
        with request_scope("req-x"):
            raise RuntimeError("boom")
    assert current_request_id() == ""


def test_scope_does_not_leak_into_another_thread(json_stream):
    seen: list[str] = []

    def worker() -> None:
        seen.append(current_request_id())
        logging.getLogger(LOGGER).info("in thread")
        with request_scope("req-thread"):  # what a servicer does in its handler thread
            logging.getLogger(LOGGER).info("scoped in thread")

    with request_scope("req-main"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert seen == [""]
    assert [e.get("request_id") for e in lines(json_stream)] == [None, "req-thread"]


def test_request_scope_rejects_a_non_str():
    with pytest.raises(TypeError, match="42"):
        with request_scope(42):  # type: ignore[arg-type]
            pass


def test_extra_fields_appear_and_extra_request_id_wins(json_stream):
    class NotJson:
        def __str__(self) -> str:
            return "<not json>"

    with request_scope("req-scope"):
        logging.getLogger(LOGGER).info(
            "done", extra={"num_tokens": 7, "elapsed_s": 0.25, "worker": NotJson(), "request_id": "req-extra"}
        )
    [entry] = lines(json_stream)
    assert entry["request_id"] == "req-extra"
    assert (entry["num_tokens"], entry["elapsed_s"], entry["worker"]) == (7, 0.25, "<not json>")
    assert set(entry) == {"ts", "level", "logger", "msg", "service", "request_id", "num_tokens", "elapsed_s", "worker"}


def test_exception_is_in_exc(json_stream):
    try:
        raise ValueError("bad block id 17")
    except ValueError:
        logging.getLogger(LOGGER).exception("transfer failed")
    [entry] = lines(json_stream)
    assert entry["level"] == "ERROR" and entry["msg"] == "transfer failed"
    assert entry["exc"].startswith("Traceback (most recent call last):")
    assert entry["exc"].endswith("ValueError: bad block id 17")


def test_trace_id_inside_a_span_only(json_stream):
    tracing = Tracing("router", environ={})
    log = logging.getLogger(LOGGER)
    with tracing.span("Generate") as span:
        log.info("in span")
    log.info("after span")
    tracing.shutdown()
    inside, after = lines(json_stream)
    assert inside["trace_id"] == trace_id_of(span)
    assert re.fullmatch(r"[0-9a-f]{32}", inside["trace_id"])
    assert "trace_id" not in after


def test_level_filters(json_stream):
    log = logging.getLogger(LOGGER)
    log.debug("hidden")
    log.warning("shown")
    assert [e["msg"] for e in lines(json_stream)] == ["shown"]


def test_text_format_with_and_without_request_id(restore_root):
    stream = io.StringIO()
    setup_logging("DEBUG", "text", "prefill", stream=stream)
    log = logging.getLogger(LOGGER)
    log.debug("plain")
    with request_scope("req-9"):
        log.info("scoped %d", 3)
    plain, scoped = stream.getvalue().splitlines()
    prefix = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
    assert re.fullmatch(prefix + r"DEBUG pdserve\.test: plain", plain), plain
    assert re.fullmatch(prefix + r"INFO pdserve\.test: scoped 3 \[req-9\]", scoped), scoped


def test_setup_twice_replaces_the_handler(restore_root):
    first, second = io.StringIO(), io.StringIO()
    setup_logging("info", "json", "decode", stream=first)
    handler = setup_logging("info", "json", "decode", stream=second)
    assert restore_root.handlers == [handler]
    logging.getLogger(LOGGER).info("once")
    assert first.getvalue() == ""
    assert [e["msg"] for e in lines(second)] == ["once"]


@pytest.mark.parametrize(
    ("level", "fmt", "service", "bad"),
    [("loud", "json", "router", "'loud'"), ("info", "xml", "router", "'xml'"), ("info", "json", "", "''")],
)
def test_setup_rejects_bad_arguments_by_name(restore_root, level, fmt, service, bad):
    with pytest.raises(ValueError, match=re.escape(bad)):
        setup_logging(level, fmt, service, stream=io.StringIO())
