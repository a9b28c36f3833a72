"""Deterministic random-weight Llama / Qwen2 / Mistral checkpoints, built offline.

``build_tiny`` writes an ordinary Hugging Face model directory that stock ``transformers`` loads with
``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``:

- ``config.json``, ``model.safetensors`` (random weights, a pure function of the arguments),
  ``generation_config.json`` (bos/eos/pad ids only, so greedy by default);
- ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``: a byte-level BPE trained here on
  the text of ``pydoc_data.topics`` (ships with Python), specials ``<|endoftext|>`` ``<s>`` ``</s>`` ``<pad>``
  (ids 0-3; bos ``<s>``, eos ``</s>``, pad ``<pad>``). ``AutoTokenizer`` adds no BOS/EOS: ``encode(text)``
  gives exactly the BPE ids;
- ``SHA256SUMS`` in ``sha256sum`` format, one line per weight file (``*.safetensors``).

Tokenizer classes. What ``AutoTokenizer`` returns in transformers 5.24 decides the ids, so the builder trains
with the pre-tokenization that class applies and checks the saved directory before returning:

- llama, mistral: ``TokenizersBackend``, which honours ``tokenizer.json``; trained with plain
  ``ByteLevel`` pre-tokenization (the GPT-2 split);
- qwen2: ``Qwen2Tokenizer``, whatever ``tokenizer_config.json`` names, and that class replaces the normalizer
  and pre-tokenizer of ``tokenizer.json`` with its own (NFC, Qwen's regex split, ``ByteLevel`` without regex);
  trained with exactly those, taken from the class itself.

Weight init. HF's default ``initializer_range`` (0.02) makes a tiny random model's logits nearly flat (top-1 /
top-2 gaps under 1e-4 on about 1% of greedy steps) and its greedy output a short loop of a few tokens.
``initializer_range = INIT_GAIN / sqrt(hidden_size)`` with ``INIT_GAIN = 1.5`` (0.133 for "tiny") gives
median gaps near 0.3, none under 1e-4 in thousands of steps, and ~95 distinct tokens in 100 greedy
steps, so greedy decoding is numerically robust and its output depends on the whole context. When the model's
vocab is larger than the tokenizer's (the "60m" and "350m" sizes), the ``lm_head`` rows of ids the tokenizer
lacks are zero, so greedy decoding never picks one (sampling can).

Determinism: the same arguments give byte-identical files for a given Python (the corpus), tokenizers,
torch and transformers version. The global torch RNG is left untouched.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

# Model architecture -> transformers class names (config, causal LM).
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # Qwen2 with an RMSNorm of each query and key head, no q/k/v bias
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

# Size presets: transformers config kwargs. "vocab_size" is what the BPE trainer is asked for and the number
# of embedding rows; this corpus yields 4096 tokens when asked, about 6700 when asked for 32000.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=4096, max_position_embeddings=2048, dtype="float32"),
    "60m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1408, vocab_size=32000, max_position_embeddings=4096, dtype="float32"),
    "350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=2816, vocab_size=32000, max_position_embeddings=4096, dtype="bfloat16"),
}

# Mistral's default sliding window per size: well under max_position_embeddings so long prompts exercise it.
MISTRAL_SLIDING_WINDOW: dict[str, int] = {"tiny": 64, "60m": 1024, "350m": 1024}

INIT_GAIN = 1.5  # initializer_range = INIT_GAIN / sqrt(hidden_size)

SPECIAL_TOKENS = ("<|endoftext|>", "<s>", "</s>", "<pad>")  # ids 0, 1, 2, 3
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
DTYPES = ("float32", "bfloat16", "float16")

# Strings whose ids must be identical under the trained tokenizer and AutoTokenizer (whitespace runs, newlines,
# CRLF, digits, contractions, unicode, code, special tokens).
TOKENIZER_CHECK_STRINGS = (
    "hello",
    "Hello  world\n\n  x",
    "def f(x):\n    return x + 12345  # comment\n\tpass",
    "héllo wörld — 日本語 🎉 ünïcödé",
    "a   b\t\tc\r\n\r\nd",
    " leading space",
    "trailing spaces   ",
    "It's don't I'm we'll THEY'RE",
    "3.14159 + 2**10 == 1024.0",
    "<s>user\nhi</s>\n<|endoftext|><pad>",
)

_MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
# Files a build writes; only these are removed from an existing output directory before writing.
_BUILD_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                "SHA256SUMS")


def build_tiny(arch: str, out_dir: str | os.PathLike[str], *, seed: int = 0, size: str = "tiny",
               dtype: str | None = None, overrides: dict[str, Any] | None = None) -> Path:
    """Write a random-weight ``arch`` checkpoint of preset ``size`` to ``out_dir`` and return its path.

    ``seed`` fixes the weights (same seed: byte-identical ``model.safetensors``). ``dtype`` ("float32",
    "bfloat16", "float16") overrides the preset's saved dtype. ``overrides`` are extra config kwargs
    applied last (e.g. ``{"num_hidden_layers": 2, "sliding_window": 32}``); a ``sliding_window`` turns on
    Qwen2's (Qwen3's) sliding attention for every layer unless ``use_sliding_window`` / ``max_window_layers`` are given.

    ``out_dir`` may exist only if it holds nothing but files a build writes (those are replaced).
    Raises ValueError naming a bad argument, RuntimeError if AutoTokenizer would not reproduce the ids.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    kwargs = _config_kwargs(arch, size, dtype, overrides or {})
    out = Path(out_dir)
    _prepare_out_dir(out)

    import torch
    import transformers

    from common.engine.loader import write_manifest

    tokenizer = train_tokenizer(arch, kwargs["vocab_size"])
    num_tokens = tokenizer.get_vocab_size()
    ids = {tok: tokenizer.token_to_id(tok) for tok in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
    config_cls = getattr(transformers, ARCHS[arch][0])
    model_cls = getattr(transformers, ARCHS[arch][1])
    config = config_cls(**kwargs, bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN],
                        pad_token_id=ids[PAD_TOKEN], tie_word_embeddings=False)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    with torch.no_grad():  # ids past the tokenizer: logit exactly 0, never the greedy choice
        model.get_output_embeddings().weight[num_tokens:].zero_()
    model = model.to(getattr(torch, kwargs["dtype"])).eval()
    model.save_pretrained(out)
    umask_mode = (out / "config.json").stat().st_mode & 0o777
    for weights in out.glob("*.safetensors"):  # transformers writes them 0600 via a temp file
        weights.chmod(umask_mode)
    transformers.GenerationConfig(
        bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN]
    ).save_pretrained(out)

    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        add_bos_token=False, add_eos_token=False, model_max_length=kwargs["max_position_embeddings"],
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out)
    verify_saved_tokenizer(tokenizer, out)
    write_manifest(out)  # the loader owns the manifest format
    return out


def train_tokenizer(arch: str, vocab_size: int):
    """Train the byte-level BPE (a ``tokenizers.Tokenizer``) for ``arch``, asking for ``vocab_size`` tokens.

    Deterministic; the result may be smaller than ``vocab_size`` when the corpus runs out of merges.
    """
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    normalizer, pre_tokenizer = _pre_tokenization(arch)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([topics[key] for key in sorted(topics)], trainer=trainer)
    return tokenizer


def verify_saved_tokenizer(trained, model_dir: str | os.PathLike[str],
                           samples: tuple[str, ...] = TOKENIZER_CHECK_STRINGS) -> None:
    """Check that ``AutoTokenizer.from_pretrained(model_dir)`` gives ``trained``'s ids and round-trips text.

    Raises RuntimeError naming the first sample whose ids or decoded text differ.
    """
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(model_dir)
    for text in samples:
        expected = trained.encode(text).ids
        got = loaded.encode(text)
        if got != expected:
            raise RuntimeError(f"{type(loaded).__name__} from {model_dir} tokenizes {text!r} as {got}, "
                               f"the trained tokenizer as {expected}")
        if loaded.decode(got) != text:
            raise RuntimeError(f"{type(loaded).__name__} from {model_dir} decodes {text!r} as "
                               f"{loaded.decode(got)!r}")


def _config_kwargs(arch: str, size: str, dtype: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(SIZES[size])
    if arch == "mistral":
        kwargs["sliding_window"] = MISTRAL_SLIDING_WINDOW[size]
    if dtype is not None:
        kwargs["dtype"] = dtype
    kwargs.update(overrides)
    if arch == "llama" and kwargs.get("sliding_window") is not None:
        raise ValueError(f"sliding_window={kwargs['sliding_window']!r}: llama has no sliding-window attention")
    if arch == "qwen3":  # Qwen3Config's own default is 128 whatever the width
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if arch in ("qwen2", "qwen3") and overrides.get("sliding_window") is not None:
        kwargs.setdefault("use_sliding_window", True)
        kwargs.setdefault("max_window_layers", 0)
    if kwargs["vocab_size"] < _MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {kwargs['vocab_size']!r} is below the byte-level base vocabulary "
                         f"({_MIN_VOCAB_SIZE}: 256 bytes and {len(SPECIAL_TOKENS)} special tokens)")
    if kwargs["dtype"] not in DTYPES:
        raise ValueError(f"unknown dtype {kwargs['dtype']!r}; expected one of {list(DTYPES)}")
    kwargs.setdefault("initializer_range", round(INIT_GAIN / math.sqrt(kwargs["hidden_size"]), 6))
    return kwargs


def _pre_tokenization(arch: str):
    """(normalizer or None, pre-tokenizer) that AutoTokenizer applies to an ``arch`` model directory."""
    from tokenizers import pre_tokenizers

    if arch == "qwen2":
        from transformers import Qwen2Tokenizer

        backend = Qwen2Tokenizer().backend_tokenizer  # the class overrides tokenizer.json with these
        return backend.normalizer, backend.pre_tokenizer
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False)


def _prepare_out_dir(out: Path) -> None:
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"output path {out} exists and is not a directory")
        foreign = sorted(p.name for p in out.iterdir()
                         if p.name not in _BUILD_FILES and not p.name.endswith(".safetensors"))
        if foreign:
            raise ValueError(f"output directory {out} holds files a build does not write: {foreign}")
        for path in out.iterdir():
            path.unlink()
    out.mkdir(parents=True, exist_ok=True)
