"""The bench backend of the router's gRPC API (``pdserve.v1.GenerateService``), through :mod:`pdserve.client`.

Prompts go as token ids; each message with tokens is one :class:`~pdserve.bench.backend.Chunk` of
``len(token_ids)`` tokens, and the last message's ``usage.completion_tokens`` is the reported total.
Errors are counted by gRPC status code name (``UNAVAILABLE``, ``INVALID_ARGUMENT``, ``UNAUTHENTICATED``, ...).
``api_key``: sent as ``authorization: Bearer KEY`` metadata on every request.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pdserve.bench.backend import Chunk
from pdserve.client import Client


class GrpcBackend:
    name = "grpc"

    def __init__(self, address: str, *, api_key: str | None = None) -> None:
        self.address = address
        # one channel, shared by all request threads (channels are thread-safe)
        self._client = Client(address, api_key=api_key)

    def stream(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
               timeout_s: float | None, session_id: str = "") -> Iterator[Chunk]:
        pieces = self._client.stream(prompt_ids, timeout_s=timeout_s, max_tokens=max_tokens,
                                     temperature=temperature, ignore_eos=True, session_id=session_id)
        for piece in pieces:
            if piece.token_ids:
                yield Chunk(num_tokens=len(piece.token_ids), token_ids=list(piece.token_ids))
            if piece.finish_reason is not None:
                yield Chunk(num_tokens=0, completion_tokens=piece.completion_tokens)

    def status_of(self, exc: Exception) -> str:
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
            return exc.code().name
        return type(exc).__name__

    def close(self) -> None:
        self._client.close()
