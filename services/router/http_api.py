"""The router's HTTP API: OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, and
a WebSocket token stream at ``/v1/generate/ws``. Served on the router's HTTP front (``--http-port``).

Every request goes through :meth:`RouterServicer.stream` itself (see :mod:`services.router.http_call`), so
HTTP and gRPC share validation, routing, retries, metrics, records and traces, and give the same tokens.

Streaming (``"stream": true``): server-sent events, one ``data: {chunk}`` per message from the router, then
``data: [DONE]``; a failure before the first token is a plain HTTP error (400, 429 with ``Retry-After``,
503, 504 ...), one after it an ``data: {"error": ...}`` event. A client that disconnects (or closes the
WebSocket) cancels the request on every worker. ``X-Request-Timeout: SECONDS`` bounds the whole request.

Rate limits (:mod:`services.router.rate_limits`): the principal the HTTP front authenticated rides on the
call's context, so HTTP and gRPC callers spend the same budgets. A caller over its limit gets 429 with
``Retry-After`` and ``"type": "requests"|"tokens", "code": "rate_limit_exceeded"``; a saturated cluster's 429
has ``"type": "rate_limit_error"``.

WebSocket protocol: the client sends one text message, a ``/v1/completions`` body (``model`` optional);
the server sends ``{"type": "token", "data": {"text", "token_ids"}, "timestamp"}`` per message, then
``{"type": "done", "data": {"finish_reason", "usage"}, "timestamp"}`` (or ``{"type": "error", "data":
{"error": ...}}``) and closes. ``timestamp``: unix seconds when the server sent it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

from common.http import websocket
from common.http.server import HttpFront, send_json
from common.security.auth import principal_of
from services.router import openai_requests as oareq
from services.router import openai_responses as out
from services.router.http_call import BlockingStream, CallAborted, DisconnectWatcher, HttpCallContext
from services.router.openai_protocol import OpenAIError, error_from_grpc, rate_limit_error
from services.router.rate_limits import RATE_LIMIT_KEY
from services.router.servicer import RETRY_AFTER_MS_KEY, RouterServicer

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20


class ClientGone(Exception):
    """Writing to the client failed: it went away."""


class RouterHttpApi:
    def __init__(self, servicer: RouterServicer, served_model: str, loop: asyncio.AbstractEventLoop) -> None:
        """``loop``: the event loop the servicer's streams run on (the router's gRPC server's)."""
        self.servicer = servicer
        self.loop = loop
        self.served_model = served_model
        self.tokenizer = servicer.model.tokenizer
        self.token_strings = out.TokenStrings(self.tokenizer)
        self.created = int(time.time())

    def register(self, front: HttpFront) -> None:
        front.route("GET", "/v1/models", self.models)
        front.route("POST", "/v1/completions", lambda req: self.generate(req, "completion"))
        front.route("POST", "/v1/chat/completions", lambda req: self.generate(req, "chat"))
        front.route("GET", "/v1/generate/ws", self.websocket)

    # -- /v1/models ----------------------------------------------------------------------------------------

    def models(self, request: BaseHTTPRequestHandler) -> None:
        send_json(request, 200, out.models_list(self.served_model, self.created))

    # -- completions and chat completions ------------------------------------------------------------------

    def generate(self, request: BaseHTTPRequestHandler, kind: str) -> None:
        try:
            body = _read_json(request)
            if kind == "chat":
                parsed = oareq.parse_chat(body, served_model=self.served_model, tokenizer=self.tokenizer)
            else:
                parsed = oareq.parse_completion(body, served_model=self.served_model)
            ctx = HttpCallContext(request.headers, principal_of(request))
        except OpenAIError as exc:
            return _send_error(request, exc)
        except ValueError as exc:
            return _send_error(request, OpenAIError(400, str(exc), "invalid_request_error"))
        rid = out.new_id(kind)
        responses = BlockingStream(self.loop, self.servicer.stream(parsed.to_generate_request(rid), ctx), ctx)
        watcher = DisconnectWatcher(request.connection, ctx)
        try:
            if parsed.stream:
                self._stream(request, kind, parsed, rid, responses, ctx)
            else:
                self._whole(request, kind, parsed, rid, responses)
        except ClientGone:
            ctx.cancel()
        finally:
            watcher.stop()
            responses.close()  # a stream left mid-way: its cleanup (release KV, records) runs now
            ctx.done()

    def _whole(self, request, kind, parsed, rid, responses) -> None:
        created = int(time.time())
        text, logprobs, finish, usage = [], [], None, None
        try:
            for r in responses:
                text.append(r.text)
                logprobs.extend(r.logprobs)
                if r.finish_reason:
                    finish = out.finish_reason_of(r.finish_reason)
                if r.HasField("usage"):
                    usage = out.usage(r.usage.prompt_tokens, r.usage.completion_tokens)
        except CallAborted as exc:
            return _send_error(request, _error_of(exc), exc.trailing)
        lp = self._logprobs(kind, parsed, logprobs)
        if kind == "chat":
            body = out.chat_response(rid, created, self.served_model, "".join(text), finish, usage, logprobs=lp)
        else:
            body = out.completion_response(rid, created, self.served_model, "".join(text), finish, usage, logprobs=lp)
        _write_or_gone(lambda: send_json(request, 200, body))

    def _stream(self, request, kind, parsed, rid, responses, ctx) -> None:
        created = int(time.time())
        try:
            first = next(responses, None)  # errors before the first token are plain HTTP errors
        except CallAborted as exc:
            return _send_error(request, _error_of(exc), exc.trailing)
        stream = _EventStream(request)
        if kind == "chat":
            stream.send(out.chat_chunk(rid, created, self.served_model, {"role": "assistant", "content": ""}, None))
        usage, offset = None, 0
        pieces = [] if first is None else [first]
        try:
            for r in _chain(pieces, responses):
                finish = out.finish_reason_of(r.finish_reason) if r.finish_reason else None
                if r.HasField("usage"):
                    usage = out.usage(r.usage.prompt_tokens, r.usage.completion_tokens)
                if not (r.text or r.token_ids or finish):
                    continue
                lp = self._logprobs(kind, parsed, list(r.logprobs), offset)
                offset += len(r.text)
                if kind == "chat":
                    delta = {"content": r.text} if (r.text or not finish) else {}
                    stream.send(out.chat_chunk(rid, created, self.served_model, delta, finish, logprobs=lp))
                else:
                    stream.send(out.completion_chunk(rid, created, self.served_model, r.text, finish, logprobs=lp))
        except CallAborted as exc:
            if ctx.cancelled:
                raise ClientGone() from exc
            stream.send(_error_of(exc).body())
        else:
            if parsed.include_usage and usage is not None:
                stream.send(out.usage_chunk(kind, rid, created, self.served_model, usage))
        stream.done()

    def _logprobs(self, kind, parsed, logprobs, text_offset: int = 0):
        if parsed.logprobs is None or not logprobs:
            return None
        if kind == "chat":
            return out.chat_logprobs(logprobs, self.token_strings)
        return out.completion_logprobs(logprobs, self.token_strings, text_offset)

    # -- WebSocket -------------------------------------------------------------------------------------------

    def websocket(self, request: BaseHTTPRequestHandler) -> None:
        try:
            ws = websocket.accept(request)
        except websocket.HandshakeError as exc:
            return websocket.reject(request, exc)
        try:
            message = ws.recv(timeout_s=60.0)
            if message is None:
                return
            body = oareq.parse_json(message, "the request message")
            if isinstance(body, dict):
                body.setdefault("model", self.served_model)
            parsed = oareq.parse_completion(body, served_model=self.served_model)
            ctx = HttpCallContext({}, principal_of(request))
        except TimeoutError as exc:
            return _ws_error(ws, OpenAIError(400, f"expected one JSON request message: {exc}",
                                                "invalid_request_error"))
        except OpenAIError as exc:
            return _ws_error(ws, exc)
        rid = out.new_id("completion")
        responses = BlockingStream(self.loop, self.servicer.stream(parsed.to_generate_request(rid), ctx), ctx)

        def watch() -> None:  # the client closing the socket cancels the generation
            while ws.recv() is not None:
                pass
            ctx.cancel()

        threading.Thread(target=watch, name="ws-watch", daemon=True).start()
        try:
            for r in responses:
                if r.text or r.token_ids:
                    ws.send_json({"type": "token", "data": {"text": r.text, "token_ids": list(r.token_ids)},
                                  "timestamp": time.time()})
                if r.finish_reason:
                    usage = out.usage(r.usage.prompt_tokens, r.usage.completion_tokens)
                    ws.send_json({"type": "done", "data": {"finish_reason": out.finish_reason_of(r.finish_reason),
                                                           "usage": usage}, "timestamp": time.time()})
            ws.close(1000)
        except CallAborted as exc:
            if not ctx.cancelled:
                _ws_error(ws, _error_of(exc))
        except websocket.WebSocketError:
            ctx.cancel()
        finally:
            responses.close()
            ctx.done()


class _EventStream:
    """Server-sent events over HTTP/1.1 chunked transfer encoding."""

    def __init__(self, request: BaseHTTPRequestHandler) -> None:
        self._request = request

        def head():
            request.send_response(200)
            request.send_header("Content-Type", "text/event-stream")
            request.send_header("Cache-Control", "no-cache")
            request.send_header("Transfer-Encoding", "chunked")
            request.end_headers()

        _write_or_gone(head)

    def send(self, obj) -> None:
        self._chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    def done(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        _write_or_gone(lambda: (self._request.wfile.write(b"0\r\n\r\n"), self._request.wfile.flush()))

    def _chunk(self, data: bytes) -> None:
        wfile = self._request.wfile
        _write_or_gone(lambda: (wfile.write(b"%x\r\n%s\r\n" % (len(data), data)), wfile.flush()))


def _chain(first: list, rest: Iterator) -> Iterator:
    yield from first
    yield from rest


def _write_or_gone(fn) -> None:
    try:
        fn()
    except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
        raise ClientGone() from exc


def _read_json(request: BaseHTTPRequestHandler):
    """The body's JSON value. A body refused unread (no or a bad Content-Length, over the limit) also closes the
    connection: its bytes must not be parsed as the next request."""
    length = request.headers.get("Content-Length")
    if length is None or not length.isdigit():
        request.close_connection = True
        raise OpenAIError(411 if length is None else 400, "a JSON body with Content-Length is required",
                             "invalid_request_error")
    if int(length) > MAX_BODY_BYTES:
        request.close_connection = True
        raise OpenAIError(413, f"request body of {length} bytes is over the limit of {MAX_BODY_BYTES}",
                             "invalid_request_error")
    return oareq.parse_json(request.rfile.read(int(length)))


def _error_of(exc: CallAborted) -> OpenAIError:
    """The OpenAI error for a failed router call: a rate limit's (trailing ``rate-limit``), else by its status."""
    limit = exc.trailing.get(RATE_LIMIT_KEY)
    return rate_limit_error(limit, exc.details) if limit else error_from_grpc(exc.code.name, exc.details)


def _send_error(request: BaseHTTPRequestHandler, error: OpenAIError, trailing: dict | None = None) -> None:
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    request.send_response(error.status)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(body)))
    retry_ms = (trailing or {}).get(RETRY_AFTER_MS_KEY)
    if retry_ms is not None:
        request.send_header("Retry-After", str(max(1, math.ceil(int(retry_ms) / 1000))))
    if request.close_connection:
        request.send_header("Connection", "close")
    request.end_headers()
    _write_or_gone(lambda: request.wfile.write(body))


def _ws_error(ws, error: OpenAIError) -> None:
    try:
        ws.send_json({"type": "error", "data": error.body(), "timestamp": time.time()})
        ws.close(1008 if error.status < 500 else 1011)
    except websocket.WebSocketError:
        pass
