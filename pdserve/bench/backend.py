"""What a bench backend streams, and the interface the runner calls (from many threads at once).

A backend turns one request into an iterator of :class:`Chunk`: one per streamed message that carries
tokens, plus at most one (the last) that reports the server's count of completion tokens. An error raises any
exception; :meth:`Backend.status_of` names it for the report (a gRPC status code name, an HTTP status).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Chunk:
    """One streamed message as the bench sees it.

    ``num_tokens``: tokens it carries (0 for a message without any: it does not count as a token's arrival).
    ``token_ids``: those tokens' ids when the protocol gives them, else ``None``.
    ``completion_tokens``: the server's total for the request, when this message reports it, else ``None``.
    """

    num_tokens: int
    token_ids: list[int] | None = None
    completion_tokens: int | None = None


class Backend(Protocol):
    """``stream`` and ``status_of`` must be safe to call from several threads at once."""

    name: str  # "grpc" | "http"

    def stream(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
               timeout_s: float | None, session_id: str = "") -> Iterator[Chunk]:
        """Send one request (exactly ``max_tokens`` new tokens: EOS ignored); yield its chunks as they arrive.
        ``session_id``: the conversation it belongs to ("" = none)."""
        ...

    def status_of(self, exc: Exception) -> str:
        """The name of the status ``exc`` stands for, as the report's ``errors`` counts it."""
        ...

    def close(self) -> None: ...
