"""Stop-string matching over a stream of text deltas.

Contract: feeding a text in any split and then calling `flush` emits exactly
`text[:i]`, where i is the earliest position at which any stop string occurs in the text, or the
whole text when none occurs. The stop string and everything after it are never emitted.

To keep that promise while streaming, the matcher holds back the longest suffix of the text seen so
far that could still grow into a stop string. A complete occurrence ends the stream only when no
partial match starts before it (such a partial match could still complete into an earlier
occurrence); until then the text from that partial match on stays held back. The hold-back is at
most (longest stop string - 1) characters beyond the earliest complete occurrence, so the engine
learns of a stop at most that many characters late.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first stop string in one request's streamed output text."""

    def __init__(self, stop: Sequence[str]) -> None:
        """`stop` strings must be non-empty; an empty sequence makes `feed` a pass-through."""
        if isinstance(stop, str):
            raise ValueError(f"stop must be a sequence of strings, got the string {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self._stop = tuple(dict.fromkeys(stop))  # unique, in order
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._held = ""  # text received but not emitted yet
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has been found (by `feed` or by `flush`)."""
        return self._stopped

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add `delta`; return (text safe to emit now, whether a stop string has been found).

        Once stopped, further calls return ('', True).
        """
        if self._stopped:
            return "", True
        if not self._stop:
            return delta, False
        text = self._held + delta
        stop_at = self._first_occurrence(text)
        partial_at = self._first_partial(text)
        if stop_at is not None and (partial_at is None or partial_at > stop_at):
            self._held = ""
            self._stopped = True
            return text[:stop_at], True
        keep_from = len(text) if partial_at is None else partial_at
        self._held = text[keep_from:]
        return text[:keep_from], False

    def flush(self) -> str:
        """The held-back text when generation ends for another reason, cut at a stop string if any."""
        if self._stopped:
            return ""
        text, self._held = self._held, ""
        stop_at = self._first_occurrence(text)
        if stop_at is not None:
            self._stopped = True
            return text[:stop_at]
        return text

    def _first_occurrence(self, text: str) -> int | None:
        """Start of the earliest complete stop string in `text`."""
        starts = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(starts) if starts else None

    def _first_partial(self, text: str) -> int | None:
        """Start of the longest suffix of `text` that is a proper prefix of some stop string."""
        for start in range(max(0, len(text) - self._max_len + 1), len(text)):
            suffix = text[start:]
            if any(len(s) > len(suffix) and s.startswith(suffix) for s in self._stop):
                return start
        return None
