"""The bench backend of an OpenAI-compatible HTTP front (standard library only).

Protocol (the router's HTTP front, which arrives with the next issue; until then this module is tested against
a small stand-in server in ``tests/pdserve/test_bench_http.py``, and the live-router HTTP test comes with the
front itself):

- ``GET {base}/v1/models`` → ``{"data": [{"id": ...}, ...]}``: without ``--model`` the first id is used;
- ``POST {base}/v1/completions`` with ``{"model", "prompt": [token ids], "max_tokens", "temperature",
  "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true}`` → server-sent events,
  one ``data: {json}`` per chunk with ``choices[0].text``, the usage in the last chunk, then ``data: [DONE]``.

Token counting: a chunk whose ``choices[0]`` has ``token_ids`` carries that many tokens; otherwise a chunk with
non-empty text carries one. The request's output tokens are ``usage.completion_tokens`` of the final chunk
when present, else the chunks' count. Errors are counted by HTTP status (``"503"``); an error object inside
the stream by its ``code``; a stream that ends without ``[DONE]`` as ``StreamTruncated``; network failures
by exception name (``ConnectionRefusedError``, ``TimeoutError``). ``timeout_s`` is the request's deadline.
``api_key``: sent as ``Authorization: Bearer KEY`` on every request (``/v1/models`` included); without it a
router that wants one answers 401 (counted as ``"401"``).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator

from pdserve.bench.backend import Chunk

MODELS_TIMEOUT_S = 10.0


class HttpStatusError(Exception):
    """The server answered with an error: an HTTP status other than 200, or an error object in the stream."""

    def __init__(self, status: int | str, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class StreamTruncated(ConnectionError):
    """The event stream ended before ``data: [DONE]``."""


def base_url_from(router: str, http_url: str | None) -> str:
    """``http_url`` if given, else ``http://ROUTER`` (``router`` being HOST:PORT of the HTTP front); no '/' end."""
    url = http_url or f"http://{router}"
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url.rstrip("/")


def first_model_id(base_url: str, timeout_s: float = MODELS_TIMEOUT_S, *, api_key: str | None = None) -> str:
    """The first model id ``GET /v1/models`` lists; ValueError if it lists none."""
    request = urllib.request.Request(f"{base_url}/v1/models", headers=_auth_headers(api_key))
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        models = json.loads(resp.read())
    ids = [m.get("id") for m in models.get("data") or [] if isinstance(m, dict) and m.get("id")]
    if not ids:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return ids[0]


def iter_sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines); other fields are ignored."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


class HttpBackend:
    name = "http"

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None) -> None:
        parts = urllib.parse.urlsplit(base_url)
        self.base_url = base_url
        self.model = model
        self._auth_headers = _auth_headers(api_key)
        self._https = parts.scheme == "https"
        self._netloc = parts.netloc
        self._path = parts.path.rstrip("/") + "/v1/completions"

    def stream(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
               timeout_s: float | None, session_id: str = "") -> Iterator[Chunk]:
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        body = {
            "model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
        }  # fmt: skip
        if session_id:
            body["session_id"] = session_id
        body = json.dumps(body)
        conn_cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = conn_cls(self._netloc, timeout=timeout_s)
        try:
            conn.request("POST", self._path, body=body,
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                                  **self._auth_headers})
            resp = conn.getresponse()
            if resp.status != 200:
                raise HttpStatusError(resp.status, resp.read(500).decode("utf-8", "replace").strip())
            completion_tokens = None
            for data in iter_sse_data(resp):
                if deadline_s is not None and time.monotonic() > deadline_s:
                    raise TimeoutError(f"no [DONE] within {timeout_s} s")
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    error = event["error"]
                    raise HttpStatusError(error.get("code") or "error", str(error.get("message", error)))
                chunk = _chunk_of(event)
                if chunk is not None:
                    yield chunk
                usage = event.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    completion_tokens = int(usage["completion_tokens"])
            else:
                raise StreamTruncated("the event stream ended before [DONE]")
            if completion_tokens is not None:
                yield Chunk(num_tokens=0, completion_tokens=completion_tokens)
        finally:
            conn.close()

    def status_of(self, exc: Exception) -> str:
        if isinstance(exc, HttpStatusError):
            return str(exc.status)
        return type(exc).__name__

    def close(self) -> None:
        pass  # one connection per request, closed with it


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _chunk_of(event: dict) -> Chunk | None:
    """The tokens one completion chunk carries, or None when it carries none (e.g. the usage-only chunk)."""
    choices = event.get("choices") or []
    if not choices:
        return None
    token_ids = choices[0].get("token_ids")
    if token_ids:
        return Chunk(num_tokens=len(token_ids), token_ids=list(token_ids))
    if choices[0].get("text"):
        return Chunk(num_tokens=1)
    return None
