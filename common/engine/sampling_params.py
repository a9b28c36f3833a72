"""Per-request sampling parameters: what a request asks of the sampler and of stop handling.

`SamplingParams` is a frozen value object that crosses every boundary (API → router → prefill →
decode). Construction is cheap and does not validate; the entry point that accepts a request calls
`validate(vocab_size)` once, which raises `ValueError` naming the bad field and value.

Semantics (the sampler implements them; see `common.engine.sampler`):

- `temperature < GREEDY_TEMPERATURE` (0 included) or `top_k == 1` means greedy: argmax after penalties.
- `top_k` 0 or -1 is off; `top_p == 1` is off; `min_p == 0` is off.
- `repetition_penalty`: Hugging Face semantics over prompt + output tokens (positive logits divided,
  negative logits multiplied); 1 is off.
- `presence_penalty` / `frequency_penalty`: OpenAI semantics over output tokens only; 0 is off.
- `seed`: the request draws its randomness from its own generator, so its tokens do not depend on
  which other requests share the batch.
- `logprobs`: None is off; n >= 0 returns the sampled token's logprob plus the top-n alternatives,
  computed from the raw model logits (before penalties and temperature).
- `stop` strings are not emitted; `stop_token_ids` end the request like EOS does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MIN_SEED = -(2**63)  # the range torch.Generator.manual_seed accepts
MAX_SEED = 2**64 - 1

# Generation-config attributes taken as defaults by `from_generation_config` when sampling is on.
_SAMPLING_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and stops. Immutable; call `validate` before use."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept a single string or any sequence for the tuple fields, as the OpenAI API does;
        # a tuple keeps the object hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (after penalties) and uses no randomness."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """True when any of the repetition, presence or frequency penalties is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `ValueError` naming the first bad field and its value; `vocab_size` bounds stop token ids."""
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=MIN_SEED, high=MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._validate_stop()
        self._validate_stop_token_ids(vocab_size)

    def _validate_stop(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):  # messages stay short: other stop strings may be huge
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be str, got {s!r}")
            if not s:
                raise ValueError(f"stop strings must not be empty, got {s!r} at index {i}")

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        for token_id in self.stop_token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise ValueError(f"stop token ids must be int, got {token_id!r}")
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise ValueError(f"unknown stop token id {token_id} (vocab size {vocab_size})")

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (not validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_generation_config(cls, generation_config: Any | None, **overrides: Any) -> SamplingParams:
        """Params from a model's `GenerationConfig`, with the user's non-None `overrides` on top.

        The generation config supplies defaults the way vLLM's `--generation-config auto` reads it:
        only values it actually sets (not None) are taken. When `do_sample` is true, its temperature,
        top_p, top_k and min_p are taken; when it is false or unset, or there is no generation config,
        the default is greedy (temperature 0) unless the user sets a temperature. Its
        repetition_penalty is always taken, as `model.generate` applies it in both modes. `overrides`
        set to None are skipped, so a CLI can pass its parsed flags straight through. The result is
        not validated.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(names)}")
        values: dict[str, Any] = {"temperature": 0.0}  # greedy unless the config samples or the user says
        if generation_config is not None:
            if getattr(generation_config, "do_sample", None):
                for name in _SAMPLING_CONFIG_FIELDS:
                    value = getattr(generation_config, name, None)
                    if value is not None:
                        values[name] = value
            repetition_penalty = getattr(generation_config, "repetition_penalty", None)
            if repetition_penalty is not None:
                values["repetition_penalty"] = repetition_penalty
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _check_int(name: str, value: Any, *, low: int, high: int | None = None) -> None:
    """Require an int (bool rejected) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_float(
    name: str, value: Any, *, low: float, high: float | None = None, low_open: bool = False
) -> None:
    """Require a finite real number (int accepted, bool rejected) in [low, high], or (low, high]."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low_open and value <= low:
        raise ValueError(f"{name} must be > {low:g}, got {value}")
    if not low_open and value < low:
        raise ValueError(f"{name} must be >= {low:g}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high:g}, got {value}")
