"""The synthetic workload of ``pdserve bench``: sessions of turns, prompt token ids, and arrival times.

Pure and seeded: the same :class:`WorkloadSpec` and seed give the same sessions and the same schedule.

- Lengths. A length with mean ``L`` and range ratio ``r`` (like vLLM's ``--random-range-ratio``) is drawn
  uniformly from the integers in :func:`length_bounds` ``(L, r)`` = ``[max(1, round(L(1-r))), round(L(1+r))]``;
  ``r = 0`` gives exactly ``L``. Each turn draws its own input and output length.
- Token ids are uniform in ``[MIN_TOKEN_ID, vocab_size)``: below ``MIN_TOKEN_ID`` live the special tokens of
  the usual tokenizers (the tiny test models: ids 0-3).
- Shared prefix. One random sequence is drawn first; the first prompt of every session of ``n`` tokens starts
  with its first ``round(shared_prefix_ratio * n)`` ids, so that fraction of each prompt is a prefix all
  requests share (with lengths that vary, the shorter prefixes are prefixes of the longer ones).
- Multi-turn. ``num_requests`` requests form ``ceil(num_requests / turns)`` sessions of ``turns`` turns
  (the last session gets the remainder). Turn 0's prompt is its user tokens; turn ``k``'s prompt is
  :func:`next_prompt` of turn ``k-1``'s prompt, its output and turn ``k``'s new user tokens (all random; the
  input length distribution gives their number). The runner sends the turns of a session one after another.
- Arrivals. :func:`arrival_times_s` gives each session's start as an offset from the start of the pass:
  the first at 0, then gaps of ``1/rate`` (``fixed``) or exponential with mean ``1/rate`` (``poisson``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MIN_TOKEN_ID = 10
ARRIVALS = ("poisson", "fixed")


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; lengths in tokens. Raises ValueError naming a bad value."""

    num_requests: int
    input_len: int
    output_len: int
    input_len_range: float = 0.0  # ratio r: lengths uniform in [L(1-r), L(1+r)]
    output_len_range: float = 0.0
    shared_prefix_ratio: float = 0.0  # fraction of each first prompt shared by all sessions
    turns: int = 1  # requests per session
    vocab_size: int = 256  # token ids are drawn from [MIN_TOKEN_ID, vocab_size)

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("input_len_range", "output_len_range"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if not 0.0 <= self.shared_prefix_ratio <= 1.0:
            raise ValueError(f"shared_prefix_ratio must be in [0, 1], got {self.shared_prefix_ratio!r}")
        if self.vocab_size <= MIN_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {MIN_TOKEN_ID}, got {self.vocab_size!r}")


@dataclass(frozen=True)
class Turn:
    """One request of a session: the new user tokens it adds and its exact output length (``max_tokens``)."""

    user_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    index: int
    turns: list[Turn]


def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive ``(low, high)`` of a length with mean ``mean`` and range ratio ``range_ratio``; low >= 1."""
    low = max(1, round(mean * (1.0 - range_ratio)))
    return low, max(low, round(mean * (1.0 + range_ratio)))


def build_sessions(spec: WorkloadSpec, seed: int) -> list[Session]:
    """The sessions of ``spec`` (``spec.num_requests`` turns in all), a pure function of ``(spec, seed)``."""
    rng = random.Random(seed)
    in_low, in_high = length_bounds(spec.input_len, spec.input_len_range)
    out_low, out_high = length_bounds(spec.output_len, spec.output_len_range)
    shared = random_ids(rng, round(spec.shared_prefix_ratio * in_high), spec.vocab_size)
    num_sessions = math.ceil(spec.num_requests / spec.turns)
    sessions = []
    for index in range(num_sessions):
        num_turns = min(spec.turns, spec.num_requests - index * spec.turns)
        turns = []
        for k in range(num_turns):
            num_input = rng.randint(in_low, in_high)
            max_tokens = rng.randint(out_low, out_high)
            num_shared = round(spec.shared_prefix_ratio * num_input) if k == 0 else 0
            user_ids = shared[:num_shared] + random_ids(rng, num_input - num_shared, spec.vocab_size)
            turns.append(Turn(user_ids=user_ids, max_tokens=max_tokens))
        sessions.append(Session(index=index, turns=turns))
    return sessions


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids uniform in ``[MIN_TOKEN_ID, vocab_size)``."""
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)]


def next_prompt(prev_prompt: list[int], prev_output: list[int], user_ids: list[int]) -> list[int]:
    """The prompt of a session's next turn: the previous prompt, its output, then the new user tokens."""
    return prev_prompt + prev_output + user_ids


def arrival_times_s(num: int, rate_per_s: float, arrival: str, seed: int) -> list[float]:
    """``num`` start offsets in seconds (non-decreasing, the first 0.0) for ``rate_per_s`` starts per second.

    ``rate_per_s`` may be ``inf`` (everything at once). The schedule is a pure function of the arguments.
    """
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if not rate_per_s > 0:
        raise ValueError(f"request rate must be > 0, got {rate_per_s!r}")
    rng = random.Random(f"{seed}:arrivals")
    times_s, now_s = [], 0.0
    for i in range(num):
        if i and math.isfinite(rate_per_s):
            now_s += rng.expovariate(rate_per_s) if arrival == "poisson" else 1.0 / rate_per_s
        times_s.append(now_s)
    return times_s
