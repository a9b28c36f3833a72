"""One pass of ``pdserve bench``: issue every session's requests through a backend and stamp their times.

Life cycle of a pass:

1. ``start_s`` is taken; sessions start either as soon as one of ``concurrency`` slots is free (fixed
   concurrency), or at ``start_s + offset`` from :func:`pdserve.bench.workload.arrival_times_s` (request
   rate; no bound on how many are in flight);
2. each session runs in its own thread and sends its turns one after another, each turn's prompt built by
   :func:`~pdserve.bench.workload.next_prompt` from the previous prompt and output. When the backend does not
   return output token ids (an HTTP front without ``token_ids``), the output is stood in for by as many
   seeded random ids, so prompts still grow by the output's length. A failed turn's next turn builds on
   whatever output arrived;
3. every request ends in a :class:`~pdserve.bench.metrics.RequestRecord`, completed or failed with a status
   name: a request never raises out of the pass;
4. ``end_s`` is taken when the last session ends; :class:`PassResult` holds the records in completion order.

A tqdm progress bar (one tick per request) goes to stderr unless ``progress`` is false.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

from pdserve.bench.backend import Backend
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workload import Session, next_prompt, random_ids


@dataclass
class PassResult:
    """The records of one pass; ``request_rate`` (per second) or ``concurrency`` says how load was offered."""

    records: list[RequestRecord]
    start_s: float
    end_s: float
    request_rate: float | None = None
    concurrency: int | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def run_pass(backend: Backend, sessions: list[Session], *, vocab_size: int, temperature: float = 0.0,
             timeout_s: float | None = None, concurrency: int | None = None,
             start_offsets_s: list[float] | None = None, request_rate: float | None = None,
             progress: bool = True, desc: str = "", session_prefix: str | None = None) -> PassResult:
    """Run ``sessions``; give exactly one of ``concurrency`` or ``start_offsets_s`` (one offset per session).

    ``session_prefix``: a multi-turn session's requests carry the session id ``{session_prefix}-{index}``
    (the router then keeps the conversation's KV on one decode worker); None sends none.

    ``vocab_size`` bounds the stand-in ids of outputs the backend returns no ids for. ``request_rate`` is only
    recorded in the result.
    """
    if (concurrency is None) == (start_offsets_s is None):
        raise ValueError("give exactly one of concurrency or start_offsets_s")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
    if start_offsets_s is not None and len(start_offsets_s) != len(sessions):
        raise ValueError(f"{len(start_offsets_s)} start offsets for {len(sessions)} sessions")
    records: list[RequestRecord] = []
    lock = threading.Lock()
    num_requests = sum(len(s.turns) for s in sessions)
    bar = tqdm(total=num_requests, desc=desc or None, unit="req", file=sys.stderr, disable=not progress)

    def run_session(session: Session) -> None:
        prompt: list[int] = []
        output: list[int] = []
        for k, turn in enumerate(session.turns):
            prompt = next_prompt(prompt, output, turn.user_ids) if k else list(turn.user_ids)
            sid = f"{session_prefix}-{session.index}" if session_prefix and len(session.turns) > 1 else ""
            record, output_ids = issue(backend, prompt, max_tokens=turn.max_tokens, temperature=temperature,
                                       timeout_s=timeout_s, session_index=session.index, turn_index=k,
                                       session_id=sid)
            if output_ids is None:
                output_ids = random_ids(random.Random(f"output:{session.index}:{k}"), record.output_tokens,
                                        vocab_size)
            output = output_ids
            with lock:
                records.append(record)
                bar.update(1)

    max_workers = concurrency if concurrency is not None else max(1, len(sessions))
    start_s = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bench") as pool:
            futures = []
            for i, session in enumerate(sessions):
                if start_offsets_s is not None:
                    time.sleep(max(0.0, start_s + start_offsets_s[i] - time.perf_counter()))
                futures.append(pool.submit(run_session, session))
            for future in futures:
                future.result()  # a bug in the bench itself surfaces here; request errors never do
        end_s = time.perf_counter()
    finally:
        bar.close()
    return PassResult(records=records, start_s=start_s, end_s=end_s, request_rate=request_rate,
                      concurrency=concurrency)


def issue(backend: Backend, prompt_ids: list[int], *, max_tokens: int, temperature: float,
          timeout_s: float | None, session_index: int = 0, turn_index: int = 0,
          session_id: str = "") -> tuple[RequestRecord, list[int] | None]:
    """Send one request and time it. Returns its record and its output ids (``None`` if the backend gave none)."""
    record = RequestRecord(session_index=session_index, turn_index=turn_index, input_tokens=len(prompt_ids),
                           max_tokens=max_tokens, send_s=time.perf_counter(), end_s=0.0)
    output_ids: list[int] | None = []
    reported = None
    try:
        extra = {"session_id": session_id} if session_id else {}
        for chunk in backend.stream(prompt_ids, max_tokens=max_tokens, temperature=temperature,
                                    timeout_s=timeout_s, **extra):
            now_s = time.perf_counter()
            if chunk.num_tokens:
                record.arrivals.append((now_s, chunk.num_tokens))
                if chunk.token_ids is None or output_ids is None:
                    output_ids = None
                else:
                    output_ids += chunk.token_ids
            if chunk.completion_tokens is not None:
                reported = chunk.completion_tokens
    except Exception as exc:  # any failure of one request is a result to report, never the end of the bench
        record.error = backend.status_of(exc)
    record.end_s = time.perf_counter()
    received = sum(num_tokens for _, num_tokens in record.arrivals)
    record.output_tokens = reported if reported is not None else received
    return record, output_ids
