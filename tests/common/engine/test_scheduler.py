"""Scheduler decisions on tiny factories: exact chunks, block ids, admission and preemption order."""

from __future__ import annotations

from common.engine.block_pool import BlockPool
from common.engine.request import Request, RequestStatus
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler


class _NullDetok:
    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def make_request(rid: str, prompt_len: int) -> Request:
    from common.engine.stop_strings import StopStringMatcher

    return Request(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        sampling=SamplingParams(),
        eos_token_ids=frozenset(),
        max_model_len=1024,
        detokenizer=_NullDetok(),
        stop_matcher=StopStringMatcher(()),
    )


def run_step(scheduler: Scheduler, sample: bool = True):
    """Pretend the model ran: mark the chunks computed and append a token where a request samples."""
    out = scheduler.schedule()
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        if sample and r.num_computed_tokens == r.num_tokens:
            r.all_token_ids.append(0)
            r.output_token_ids.append(0)
    return out


def test_prompts_are_chunked_within_the_token_budget():
    pool = BlockPool(32)
    s = Scheduler(pool, block_size=4, max_num_seqs=8, max_num_batched_tokens=10, prefill_chunk_size=6)
    a, b = make_request("a", 9), make_request("b", 5)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 6), ("b", 4)]
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 3), ("b", 1)]
    assert a.block_ids == [0, 1, 3] and b.block_ids == [2, 4]
    out = run_step(s)  # both decode one token each
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]


def test_admission_respects_max_num_seqs():
    s = Scheduler(BlockPool(32), block_size=4, max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk_size=64)
    a, b = make_request("a", 3), make_request("b", 3)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert b.status is RequestStatus.WAITING and s.num_waiting == 1


def test_newest_request_is_preempted_and_recomputed_first_in_line():
    pool = BlockPool(4)
    s = Scheduler(pool, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64)
    a, b = make_request("a", 8), make_request("b", 7)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 8 tokens → blocks [0, 1]; b: 7 tokens → blocks [2, 3]; both sampled one token
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    out = run_step(s)  # a needs a third block: none free → b (newest) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    assert a.block_ids == [0, 1, 3]  # a freed request gives back its last block first
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and s.waiting[0] is b
    assert b.num_uncomputed_tokens == 8  # prompt + the token it had generated, recomputed as one prompt


def test_a_request_that_cannot_fit_preempts_itself_when_it_is_the_newest():
    pool = BlockPool(3)
    s = Scheduler(pool, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64)
    a, b = make_request("a", 4), make_request("b", 7)
    s.add(a)
    s.add(b)
    run_step(s)  # a → [0], b → [1, 2]
    # a decodes into a new block (needs 1, none free): b is newest, preempted; a runs
    out = run_step(s)
    assert [r.request_id for r in out.preempted] == ["b"] and a.block_ids == [0, 2]
    s2 = Scheduler(BlockPool(2), block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64)
    c = make_request("c", 8)
    s2.add(c)
    run_step(s2)  # c fills both blocks; its next token needs a third: it is alone, so it preempts itself
    out = run_step(s2)
    assert [r.request_id for r in out.preempted] == ["c"] and out.scheduled == []


def test_remove_frees_blocks_unless_told_not_to():
    pool = BlockPool(8)
    s = Scheduler(pool, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64)
    a, b = make_request("a", 5), make_request("b", 5)
    s.add(a)
    s.add(b)
    run_step(s)
    s.remove(a)
    assert pool.num_free_blocks == 6 and a.block_ids == []
    s.remove(b, free_blocks=False)
    assert pool.num_free_blocks == 6 and b.block_ids == [2, 3] and not s.has_work()
