"""One request's state inside an engine, and what the engine reports about it.

Life cycle of a request in one engine:

1. ``WAITING``: added (or preempted, or imported with its KV); in the scheduler's waiting queue.
2. ``RUNNING``: in the running batch. Each step computes the KV of ``num_new`` of its known tokens
   (a prompt chunk, a recompute after preemption, or the last sampled token); when every known token has
   its KV, the step samples one more token.
3. ``PREFILLED``: a ``prefill_only`` request that sampled its first token; its blocks are held for
   :meth:`~common.engine.engine.LLMEngine.export_kv` (the disaggregated hand-off).
4. ``FINISHED``: stopped (EOS, stop token/string), hit its length limit, or aborted; blocks freed.

Preemption (blocks ran out) sends a RUNNING request back to WAITING with its blocks freed and
``num_computed_tokens = 0``: its prompt and the tokens it already generated are recomputed as one prompt.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from common.engine.counters import RequestTimes
from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.sampler import TokenLogprobs
from common.engine.sampling_params import SamplingParams
from common.engine.stop_strings import StopStringMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the model's context
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    generator: torch.Generator | None = None
    prefill_only: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in this engine's cache
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    pending_text: str = ""  # emitted text not yet reported in a RequestOutput
    pending_token_ids: list[int] = field(default_factory=list)  # sampled tokens not yet reported
    pending_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    imported: bool = False  # admitted with its KV from another engine (no prompt compute here)
    num_imported_tokens: int = 0  # output tokens sampled by that other engine
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    block_names: list[bytes] = field(default_factory=list)  # prefix-cache names of its full blocks so far
    num_named_blocks: int = 0  # of block_ids, how many are named in the pool (their KV is computed)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (last admission)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one step (or a whole run) produced for one request: deltas since the last report."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprobs | None] | None = None
    prefilled: bool = False  # a prefill_only request's KV is ready for export_kv
    times: RequestTimes | None = None  # its stage times, on the output that finishes it (or says prefilled)


@dataclass
class CompletionResult:
    """The whole result of one request, as the blocking ``generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # includes the EOS / stop token that ended generation, as HF generate does
    text: str  # never includes EOS, stop tokens or stop strings
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs | None] | None = None
    num_preemptions: int = 0
