"""EngineLoop: many threads, one engine thread; outputs routed to the right streams; nothing hangs."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.engine_loop import EngineLoop, StreamClosed
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir("llama"))


@pytest.fixture
def loop(loaded):
    loop = EngineLoop(LLMEngine(loaded, EngineConfig(num_kv_blocks=300))).start()
    yield loop
    loop.stop()


def collect(stream) -> tuple[list[int], str, str]:
    tokens, text, reason = [], "", None
    for out in stream:
        tokens += out.new_token_ids
        text += out.new_text
        reason = out.finish_reason
    return tokens, text, reason.value


def test_concurrent_submitters_get_exactly_their_own_outputs(loop, loaded):
    prompts = make_prompts(4096, lens=[3, 40, 90, 150, 7, 60], seed=21)
    params = [SamplingParams(max_new_tokens=5 + 3 * i, **GREEDY) for i in range(len(prompts))]
    expected = LLMEngine(loaded, EngineConfig(num_kv_blocks=300)).generate(prompts, params)
    results: dict[int, tuple] = {}

    def client(i):
        results[i] = collect(loop.add_request(prompts[i], params[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, exp in enumerate(expected):
        assert results[i] == (exp.token_ids, exp.text, "length")
    assert loop.call(lambda e: e.block_pool.num_used_blocks) == 0
    assert loop.stats.kv_blocks_used == 0 and loop.stats.kv_blocks_total == 300


def test_bad_input_raises_in_the_callers_thread(loop):
    with pytest.raises(ValueError, match="prompt is empty"):
        loop.add_request([], SamplingParams())
    assert loop.running


def test_abort_from_another_thread_ends_the_stream_and_frees_blocks(loop):
    stream = loop.add_request(list(range(4, 100)), SamplingParams(max_new_tokens=1000, **GREEDY))
    first = stream.get(timeout_s=30)
    assert first.new_token_ids and not first.finished
    assert loop.abort(stream.request_id)
    outs = []
    while True:
        out = stream.get(timeout_s=30)
        outs.append(out)
        if out.finished:
            break
    assert outs[-1].finish_reason.value == "abort"
    deadline = time.monotonic() + 10.0
    while loop.stats.kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.call(lambda e: e.block_pool.num_used_blocks) == 0


def test_idle_loop_expires_reservation_leases(loop):
    loop.call(lambda e: e.reserve_kv("r", 50, lease_s=0.1))
    assert loop.stats.kv_blocks_reserved == 4
    deadline = time.monotonic() + 10.0
    while loop.stats.kv_blocks_reserved and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loop.stats.kv_blocks_reserved == 0 and loop.stats.kv_blocks_used == 0


def test_stop_fails_open_streams_and_later_calls(loaded):
    loop = EngineLoop(LLMEngine(loaded, EngineConfig(num_kv_blocks=300))).start()
    stream = loop.add_request(list(range(4, 50)), SamplingParams(max_new_tokens=1000, **GREEDY))
    stream.get(timeout_s=30)
    loop.stop()
    with pytest.raises(StreamClosed):
        while True:
            stream.get(timeout_s=5)
    with pytest.raises(StreamClosed):
        loop.call(lambda e: 1)
    assert loop.engine.block_pool.num_used_blocks == 0


def test_a_failing_step_fails_streams_and_the_loop_keeps_serving(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=300))
    loop = EngineLoop(engine).start()
    try:
        real_run = engine.runner.run
        engine.runner.run = lambda batch: (_ for _ in ()).throw(RuntimeError("injected fault"))
        stream = loop.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, **GREEDY))
        with pytest.raises(StreamClosed, match="injected fault"):
            stream.get(timeout_s=10)
        engine.runner.run = real_run
        tokens, _, reason = collect(loop.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, **GREEDY)))
        assert len(tokens) == 4 and reason == "length"
        assert loop.call(lambda e: e.block_pool.num_used_blocks) == 0
    finally:
        loop.stop()


def test_get_times_out_instead_of_hanging(loop):
    loop.call(lambda e: e.reserve_kv("r2", 20, lease_s=10))
    stream = loop.open_stream(lambda e: "r2")  # a stream nobody will feed
    with pytest.raises(queue.Empty):
        stream.get(timeout_s=0.05)
    loop.call(lambda e: e.release_kv("r2"))


def _out(tokens, text, *, finished=False, logprobs=None):
    from common.engine.request import FinishReason, RequestOutput

    return RequestOutput("r", tokens, text, finished, FinishReason.LENGTH if finished else None, logprobs)


@pytest.fixture(params=["thread", "asyncio"])
def read(request):
    """``get_pending`` from a thread, or ``get_pending_async`` on an event loop of its own (the decode worker's
    gRPC loop) while other threads feed the stream: ``read(stream, **kwargs)``, same results and errors."""
    if request.param == "thread":
        yield lambda stream, **kwargs: stream.get_pending(**kwargs)
        return
    event_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=event_loop.run_forever, daemon=True)
    thread.start()
    yield lambda stream, **kwargs: asyncio.run_coroutine_threadsafe(stream.get_pending_async(**kwargs),
                                                                    event_loop).result(10)  # fmt: skip
    event_loop.call_soon_threadsafe(event_loop.stop)
    thread.join(5)
    event_loop.close()


def test_get_async_waits_for_a_later_put_and_times_out_instead_of_hanging():
    from common.engine.engine_loop import RequestStream

    stream = RequestStream("r")

    async def later_put_then_timeout():
        threading.Timer(0.05, stream._put, args=(_out([7], "x"),)).start()
        got = await stream.get_async(timeout_s=5)
        t0 = time.monotonic()
        with pytest.raises(queue.Empty):
            await stream.get_async(timeout_s=0.05)
        return got.new_token_ids, time.monotonic() - t0

    tokens, waited = asyncio.run(later_put_then_timeout())
    assert tokens == [7] and 0.04 <= waited < 1


def test_get_pending_merges_what_is_queued_and_never_waits_for_more(read):
    from common.engine.engine_loop import RequestStream

    stream = RequestStream("r")
    stream._put(_out([1], "a"))
    assert read(stream, timeout_s=1).new_token_ids == [1]  # alone: returned at once, as it is
    stream._put(_out([2], "b"))
    stream._put(_out([3], "c", logprobs=["lp3"]))
    stream._put(_out([4, 5], "de", finished=True))
    stream._put(_out([9], "late"))  # never merged past the finished output
    merged = read(stream, timeout_s=1)
    assert (merged.new_token_ids, merged.new_text, merged.finished) == ([2, 3, 4, 5], "bcde", True)
    assert merged.new_logprobs == [None, "lp3", None, None]  # aligned with the tokens
    assert read(stream, timeout_s=1).new_token_ids == [9]
    with pytest.raises(queue.Empty):
        read(stream, timeout_s=0.05)


def test_get_pending_returns_what_came_before_an_error_then_raises(read):
    from common.engine.engine_loop import RequestStream

    stream = RequestStream("r")
    stream._put(_out([1], "a"))
    stream._put(_out([2], "b"))
    stream._fail(RuntimeError("step failed"))
    assert read(stream, timeout_s=1).new_token_ids == [1, 2]
    with pytest.raises(StreamClosed, match="step failed"):
        read(stream, timeout_s=1)


def test_a_stream_interval_waits_for_that_many_tokens_but_never_past_the_linger_or_the_end(read):
    from common.engine.engine_loop import RequestStream

    stream = RequestStream("r")

    def feed(items, gap_s):
        for item in items:
            time.sleep(gap_s)
            stream._put(item)

    stream._put(_out([1], "a"))
    threading.Thread(target=feed, args=([_out([2], "b"), _out([3], "c"), _out([4], "d")], 0.02)).start()
    merged = read(stream, timeout_s=1, min_tokens=3, linger_s=5)
    assert merged.new_token_ids == [1, 2, 3]  # waited for the two later outputs, not for the fourth
    assert read(stream, timeout_s=1).new_token_ids == [4]

    stream._put(_out([5], "e"))  # nothing follows: given up after the linger, held back no longer
    t0 = time.monotonic()
    assert read(stream, timeout_s=1, min_tokens=4, linger_s=0.1).new_token_ids == [5]
    assert 0.08 <= time.monotonic() - t0 < 1

    stream._put(_out([6], "f"))
    threading.Thread(target=feed, args=([_out([7], "g", finished=True)], 0.02)).start()
    t0 = time.monotonic()
    merged = read(stream, timeout_s=1, min_tokens=10, linger_s=5)  # the end cuts the wait short
    assert (merged.new_token_ids, merged.finished) == ([6, 7], True)
    assert time.monotonic() - t0 < 1

    for i in range(9, 14):  # a reader behind by five outputs: caught up in messages of the interval, not more
        stream._put(_out([i], "x"))
    assert read(stream, timeout_s=1, min_tokens=4, linger_s=5).new_token_ids == [9, 10, 11, 12]
    assert read(stream, timeout_s=1, min_tokens=4, linger_s=0.05).new_token_ids == [13]

    stream._put(_out([8], "h"))
    stream._fail(RuntimeError("step failed"))  # an error too: what came before it first, then the error
    assert read(stream, timeout_s=1, min_tokens=5, linger_s=5).new_token_ids == [8]
    with pytest.raises(StreamClosed, match="step failed"):
        read(stream, timeout_s=1, min_tokens=5)



def test_one_steps_outputs_wake_their_async_readers_in_one_hand_off(loaded):
    """The engine thread wakes an event loop once a step, not once a stream: the readers of that step's outputs
    then run in the same turn of the loop (a DecodeMany stream sends their tokens as one message)."""
    from common.engine.engine_loop import RequestStream
    from common.engine.request import RequestOutput

    engine_loop = EngineLoop(LLMEngine(loaded, EngineConfig(num_kv_blocks=300)))  # not started: _route by hand
    streams = {rid: RequestStream(rid) for rid in ("a", "b", "c")}
    engine_loop._streams.update(streams)

    async def main():
        event_loop = asyncio.get_running_loop()
        hand_offs = []
        original = event_loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if callback.__module__ == "common.engine.engine_loop":  # not to_thread's own hand-offs
                hand_offs.append(args)
            return original(callback, *args, **kwargs)

        event_loop.call_soon_threadsafe = counting
        readers = [asyncio.ensure_future(s.get_async(timeout_s=10)) for s in streams.values()]
        await asyncio.sleep(0.01)  # all three wait
        outputs = [RequestOutput(rid, [i], f"<{i}>", rid == "b", None) for i, rid in enumerate(streams)]
        await asyncio.to_thread(engine_loop._route, outputs)
        got = await asyncio.gather(*readers)
        return [(o.request_id, o.new_token_ids) for o in got], hand_offs

    got, hand_offs = asyncio.run(main())
    assert got == [("a", [0]), ("b", [1]), ("c", [2])]
    assert len(hand_offs) == 1 and len(hand_offs[0][0]) == 3  # one call carrying the three readers' futures
    assert set(engine_loop._streams) == {"a", "c"}  # "b" finished


def test_a_cancelled_async_reader_is_cancelled_even_when_its_output_arrives_at_that_moment():
    """The decode worker cancels a request's task when its client leaves (or its deadline passes); the task must
    end then even if a token arrived in the same turn (asyncio.wait_for on Python 3.11 returned the token and
    dropped the cancellation: the request went on decoding for nobody)."""
    from common.engine.engine_loop import RequestStream

    stream = RequestStream("r")

    async def main():
        reader = asyncio.ensure_future(stream.get_async(timeout_s=30))
        await asyncio.sleep(0.01)  # it waits
        stream._put(_out([7], "x"))  # resolves its future on the next turn...
        await asyncio.sleep(0)
        reader.cancel()  # ...and the cancellation meets that result
        try:
            await reader
        except asyncio.CancelledError:
            return "cancelled"
        return "swallowed"

    assert asyncio.run(main()) == "cancelled"
