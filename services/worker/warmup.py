"""Warm-up: compute the KV of frequent prefixes (system prompts) once and pin it in the prefix cache.

At start from ``--warmup-file`` (JSONL, one ``{"prompt": TEXT}`` or ``{"prompt_ids": [...]}`` per line, as
``pdserve run --prompts-file``), or later through ``POST /admin/warmup`` on the worker's HTTP port with
``{"prompts": [TEXT or [ids], ...]}``. Each prompt runs as a one-token request through the engine loop (other
requests keep running), then its full blocks are pinned: never evicted, reported as ``kv_blocks_cached``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler

from common.engine.engine_loop import EngineLoop
from common.engine.sampling_params import SamplingParams
from common.http.server import send_json

WARMUP_TIMEOUT_S = 600.0


def prompt_ids(loop: EngineLoop, prompts: Sequence) -> list[list[int]]:
    """Text prompts tokenized, id lists checked; ValueError naming the bad one."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) and p:
            out.append(loop.call(lambda e, p=p: e.tokenize(p)))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append(p)
        else:
            raise ValueError(f"prompt {i} must be non-empty text or a non-empty list of token ids, got {p!r:.80}")
    return out


def warm_up(loop: EngineLoop, prompts: list[list[int]]) -> dict:
    """Compute and pin; returns ``{"prompts", "prompt_tokens", "pinned_blocks"}``."""
    once = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    streams = [loop.add_request(ids, once) for ids in prompts]
    for stream in streams:
        while not stream.get(timeout_s=WARMUP_TIMEOUT_S).finished:
            pass
    pinned = loop.call(lambda e: e.pin_prefixes(prompts))
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "pinned_blocks": pinned}


def read_warmup_file(path: str) -> list:
    """The prompts of a JSONL warm-up file (text or id lists); ValueError naming the bad line."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict) or ("prompt" in item) == ("prompt_ids" in item):
                raise ValueError(f"{path}:{lineno}: needs exactly one of 'prompt' or 'prompt_ids'")
            prompts.append(item.get("prompt", item.get("prompt_ids")))
    return prompts


def admin_route(loop: EngineLoop):
    """The ``POST /admin/warmup`` handler."""

    def handle(request: BaseHTTPRequestHandler) -> None:
        try:
            body = json.loads(request.rfile.read(int(request.headers.get("Content-Length") or 0)) or b"null")
            if not isinstance(body, dict) or not isinstance(body.get("prompts"), list) or not body["prompts"]:
                raise ValueError('the body must be {"prompts": [TEXT or [token ids], ...]}')
            result = warm_up(loop, prompt_ids(loop, body["prompts"]))
        except (ValueError, UnicodeDecodeError) as exc:
            return send_json(request, 400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
        send_json(request, 200, result)

    return handle
