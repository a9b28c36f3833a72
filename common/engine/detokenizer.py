"""Incremental detokenizer: a request's output text, streamed one token at a time.

Contract: for the output ids given to `add`, the concatenation of every `add` result and of `flush`
equals `tokenizer.decode(valid_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`,
where `valid_ids` drops the ids >= len(tokenizer) (checkpoints often have more embedding rows than
the tokenizer has tokens; those ids decode to nothing and never raise). Only the output tokens are
decoded, not the prompt, exactly as `decode(generate(...)[prompt_len:])` would.

`add` never returns text ending in U+FFFD: a byte-level token can carry part of a multi-byte
character, so text is held back until later tokens complete it; `flush` returns what remains,
U+FFFD included for bytes that never completed. SentencePiece byte-fallback tokens (`<0xE6>`) need
one more rule: their decoder turns a whole run of byte tokens into U+FFFDs when the run is not valid
UTF-8, so a complete character can still turn into U+FFFDs if another byte token follows; text is
therefore held back while the last decoded token is a byte-fallback token.

Cost per token is O(window), not O(length), by vLLM's prefix/read-offset technique: the window
`ids[prefix_offset:]` is decoded, and the part after the text of the context tokens
`ids[prefix_offset:read_offset]` (already emitted) is new. Decoding from a few tokens of context, not
from the window's first new token, is what keeps a SentencePiece (Metaspace, "▁") token's leading
space: a decoder strips the space of the first token it sees. The window shrinks back to the last
emitted tokens each time text is emitted, and grows only while text is held back.

Clean-up of tokenization spaces is not applied: it rewrites text across token boundaries, so no
stream can match it (Transformers 5 defaults it off and ignores it for BPE tokenizers anyway).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


def _uses_byte_fallback(tokenizer: Any) -> bool:
    """False only when the backend model says it has no byte-fallback tokens."""
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    return bool(getattr(model, "byte_fallback", True))


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas that are final."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        """`tokenizer` is a Transformers tokenizer (anything with `decode` and `__len__`)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokenizer_size = len(tokenizer)
        self._all_ids: list[int] = []  # every id given to `add`, in order
        self._ids: list[int] = []  # the decodable ids (< tokenizer size)
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] are emitted context tokens
        self._read_offset = 0  # ids[read_offset:] are not emitted yet
        self._prefix_text = ""  # decode of ids[prefix_offset:read_offset]
        self._chunks: list[str] = []  # every text returned so far
        self._byte_fallback = _uses_byte_fallback(tokenizer)
        self._in_byte_run = False  # the last decoded token is a byte-fallback token
        self._skipped_ids: frozenset[int] | None = None  # special ids dropped by decode; built on first need

    @property
    def token_ids(self) -> list[int]:
        """Every id given to `add`, in order, including undecodable ones (do not mutate)."""
        return self._all_ids

    @property
    def text(self) -> str:
        """The text returned so far by `add` and `flush`."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it makes final ('' when none yet)."""
        if token_id < 0:
            raise ValueError(f"token id must be >= 0, got {token_id}")
        self._all_ids.append(token_id)
        if token_id >= self._tokenizer_size:
            return ""
        self._ids.append(token_id)
        if self._byte_fallback:
            self._track_byte_run(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR) or self._in_byte_run:
            return ""  # nothing new (e.g. a skipped special token), an incomplete character or byte run
        return self._emit(new_text[len(self._prefix_text) :])

    def flush(self) -> str:
        """At the end of the request: the held-back text, incomplete characters as U+FFFD."""
        new_text = self._decode(self._ids[self._prefix_offset :])
        return self._emit(new_text[len(self._prefix_text) :])

    def _emit(self, delta: str) -> str:
        """Record `delta` as emitted and slide the window to start at the tokens just emitted."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if delta:
            self._chunks.append(delta)
        return delta

    def _track_byte_run(self, token_id: int) -> None:
        """Update whether the ids end in a run of byte-fallback tokens (skipped tokens do not break it)."""
        if self._in_byte_run and token_id in self._special_ids_skipped():
            return
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        self._in_byte_run = isinstance(token, str) and len(token) == 6 and token[:3] == "<0x" and token[-1] == ">"

    def _special_ids_skipped(self) -> frozenset[int]:
        if self._skipped_ids is None:
            ids: set[int] = set()
            if self._skip_special_tokens:
                ids.update(getattr(self._tokenizer, "all_special_ids", ()))
                added = getattr(self._tokenizer, "added_tokens_decoder", {})
                ids.update(i for i, token in added.items() if getattr(token, "special", False))
            self._skipped_ids = frozenset(ids)
        return self._skipped_ids

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
