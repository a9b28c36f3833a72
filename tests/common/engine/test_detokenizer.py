"""IncrementalDetokenizer: streamed text equals the full decode, never broken UTF-8, O(window) decodes.

Three small tokenizers are trained here (about 1 s in all): a byte-level BPE (GPT-2 / Llama-3 / Qwen
style), a Metaspace BPE (SentencePiece style, "▁" for spaces), and a Llama-2-style BPE with
SentencePiece byte-fallback tokens (`<0xE6>`) for characters outside its vocabulary.
"""

from __future__ import annotations

import json
from pydoc_data.topics import topics
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.engine.detokenizer import IncrementalDetokenizer

UNICODE_TEXT = [
    "héllo wörld, ça va? naïve café",
    "日本語のテキストです。東京は大きい都市です。",
    "中文字符测试，你好世界",
    "emoji 😀🎉🚀 ok 👍🏽 family 👨‍👩‍👧",
    "Привет мир, как дела?",
]
CORPUS = list(topics.values())[:200] + UNICODE_TEXT * 5
SPECIALS = ["<s>", "</s>", "<pad>"]
EXTRA_IDS = 8  # ids past the tokenizer, as in checkpoints whose embedding matrix is padded


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _metaspace_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _wrap_metaspace(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def _byte_fallback_bpe(metaspace: Tokenizer) -> PreTrainedTokenizerFast:
    """The Metaspace BPE's merges with 256 `<0xXX>` tokens and Llama-2's normalizer and decoder."""
    trained = json.loads(metaspace.to_str())["model"]
    specials = ["<unk>", *SPECIALS]
    vocab = {token: i for i, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    metaspace = _metaspace_bpe()
    return {
        "byte_level": _byte_level_bpe(),
        "metaspace": _wrap_metaspace(metaspace),
        "byte_fallback": _byte_fallback_bpe(metaspace),
    }


def _reference(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    valid = [i for i in ids if i < len(tokenizer)]
    return tokenizer.decode(valid, skip_special_tokens=skip_special_tokens)


def _stream(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    chunks = [detokenizer.add(i) for i in ids]
    tail = detokenizer.flush()
    assert detokenizer.text == "".join(chunks) + tail
    assert detokenizer.token_ids == ids
    return chunks, tail


def _check_stream(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> None:
    expected = _reference(tokenizer, ids, skip_special_tokens)
    chunks, tail = _stream(tokenizer, ids, skip_special_tokens)
    assert "".join(chunks) + tail == expected
    position = 0
    for chunk in chunks:
        assert not chunk.endswith("\ufffd")  # held back until complete (or until flush)
        for k, char in enumerate(chunk):
            if char == "\ufffd":
                assert expected[position + k] == "\ufffd"
        position += len(chunk)


TOKENIZER_NAMES = ["byte_level", "metaspace", "byte_fallback"]
_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list(" \n.,!?abcdefxyz")),
        st.sampled_from(list("éöçñ日本語中文字😀🎉🚀👍🏽Ж")),
        st.characters(min_codepoint=0x20, max_codepoint=0x1FAFF, exclude_categories=("Cs",)),
    ),
    max_size=30,
)


@st.composite
def _id_sequences(draw: st.DrawFn, tokenizer: Any) -> list[int]:
    """Random ids, ids of encoded unicode text, or both interleaved, with specials and padded ids."""
    size = len(tokenizer)
    any_id = st.integers(min_value=0, max_value=size + EXTRA_IDS - 1)
    special = st.sampled_from(tokenizer.all_special_ids)
    kind = draw(st.sampled_from(["random", "text", "mixed"]))
    ids: list[int] = []
    if kind in ("text", "mixed"):
        ids = tokenizer.encode(draw(_TEXT), add_special_tokens=False)
    if kind in ("random", "mixed"):
        extra = draw(st.lists(st.one_of(any_id, special), max_size=30))
        for token in extra:
            ids.insert(draw(st.integers(min_value=0, max_value=len(ids))), token)
    return ids


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_equals_decode_property(tokenizers: dict, name: str, data: st.DataObject) -> None:
    tokenizer = tokenizers[name]
    ids = data.draw(_id_sequences(tokenizer))
    _check_stream(tokenizer, ids, skip_special_tokens=data.draw(st.booleans()))


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@pytest.mark.parametrize("text", UNICODE_TEXT + ["def f(x):\n    return x  # done", " leading and  double  spaces "])
def test_stream_of_encoded_text(tokenizers: dict, name: str, text: str) -> None:
    tokenizer = tokenizers[name]
    ids = tokenizer.encode(text, add_special_tokens=False)
    _check_stream(tokenizer, ids)
    if name == "byte_level":  # lossless: the stream is the original text
        assert "".join(_stream(tokenizer, ids)[0]) + _stream(tokenizer, ids)[1] == text


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
def test_split_characters_are_held_back(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    ids = tokenizer.encode("a🦀b", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the emoji really is split across tokens
    chunks, tail = _stream(tokenizer, ids)
    assert "".join(chunks) + tail == "a🦀b"
    assert all("\ufffd" not in c for c in chunks)
    assert "🦀" in "".join(chunks)  # released as one piece once complete, not only by flush


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
def test_incomplete_character_flushed_as_replacement(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    ids = tokenizer.encode("ok 🦀", add_special_tokens=False)
    split = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    chunks, tail = _stream(tokenizer, ids[:split])
    assert "\ufffd" not in "".join(chunks)
    assert tail.endswith("\ufffd")
    assert "".join(chunks) + tail == tokenizer.decode(ids[:split])


def test_byte_fallback_run_is_not_emitted_before_it_ends(tokenizers: dict) -> None:
    # "日" is complete after its three byte tokens, but a following stray byte token turns the whole
    # run into U+FFFDs in the full decode; emitting "日" early would contradict it.
    tokenizer = tokenizers["byte_fallback"]
    byte = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE6, 0x97, 0xA5, 0x80)}
    ids = [byte[0xE6], byte[0x97], byte[0xA5], tokenizer.eos_token_id, byte[0x80]]
    assert tokenizer.decode(ids[:3]) == "日"
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == "\ufffd" * 4
    _check_stream(tokenizer, ids)


def test_metaspace_spaces_kept_between_tokens(tokenizers: dict) -> None:
    tokenizer = tokenizers["metaspace"]
    ids = tokenizer.encode("hello world foo bar", add_special_tokens=False)
    naive = "".join(tokenizer.decode([i]) for i in ids)
    assert naive != "hello world foo bar"  # a per-token decode loses the spaces: context is needed
    chunks, tail = _stream(tokenizer, ids)
    assert "".join(chunks) + tail == "hello world foo bar"
    assert tail == ""


def test_ids_beyond_tokenizer_are_dropped(tokenizers: dict) -> None:
    tokenizer = tokenizers["byte_level"]
    ids = tokenizer.encode("abc def", add_special_tokens=False)
    padded = [len(tokenizer), *ids[:2], len(tokenizer) + 5, *ids[2:]]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(len(tokenizer)) == ""
    text = "".join(detokenizer.add(i) for i in padded[1:]) + detokenizer.flush()
    assert text == "abc def"
    assert detokenizer.token_ids == padded


def test_negative_id_rejected(tokenizers: dict) -> None:
    with pytest.raises(ValueError, match="token id must be >= 0, got -1"):
        IncrementalDetokenizer(tokenizers["byte_level"]).add(-1)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_special_tokens_kept_when_not_skipped(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    ids = [tokenizer.bos_token_id, *tokenizer.encode("x 日", add_special_tokens=False), tokenizer.eos_token_id]
    chunks, tail = _stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(chunks) + tail == tokenizer.decode(ids, skip_special_tokens=False)
    assert "<s>" in "".join(chunks) and "</s>" in "".join(chunks) + tail
    _check_stream(tokenizer, ids, skip_special_tokens=True)


class _CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.decoded_lengths: list[int] = []

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decoded_lengths.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_cost_per_token_is_a_window(tokenizers: dict, name: str) -> None:
    tokenizer = _CountingTokenizer(tokenizers[name])
    text = " ".join(CORPUS[:3]) + " " + " ".join(UNICODE_TEXT)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 500
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert streamed == tokenizer.decode(ids)
    calls = tokenizer.decoded_lengths[:-1]  # the reference decode above is the last call
    assert len(calls) <= 2 * len(ids) + 2
    assert max(calls) <= 16  # the longest held-back run (a byte-split emoji sequence) plus context
