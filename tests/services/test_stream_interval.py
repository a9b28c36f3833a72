"""``--stream-interval N`` on a decode worker: the first token alone and at once, then messages of up to N
tokens (fewer when a step took longer than the 0.1 s linger), the same tokens as stock ``generate``."""

from __future__ import annotations

import pytest

from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster


@pytest.fixture(scope="module")
def interval_cluster(tiny_model_dir):
    # a Decode call per request: on the shared DecodeMany stream the router merges the pieces queued for a client
    # that fell behind (by design), which on a loaded machine joined the worker's last two messages (4 + 1)
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0", "stream_interval": 4}],
                           router={"decode_mux": False}) as c:  # fmt: skip
        yield c


def test_stream_interval_groups_tokens_after_the_first(interval_cluster, tiny_model_dir, hf_reference):
    prompt = [(13 * i) % 3000 + 4 for i in range(40)]
    pieces = []
    with Client(interval_cluster.router, timeout_s=120) as client:
        list(client.stream(prompt[:8], max_tokens=6, temperature=0.0))  # warm-up: first steps pick kernels
        for piece in client.stream(prompt, max_tokens=18, temperature=0.0, ignore_eos=True):
            if piece.token_ids:
                pieces.append(list(piece.token_ids))
    sizes = [len(p) for p in pieces]
    assert sizes[0] == 1, sizes  # the first token is never held back
    assert sum(sizes) == 18
    assert max(sizes) <= 4, sizes
    # 1 + 4 + 4 + 4 + 4 + 1 on a quiet machine; a step slower than the linger sends what it has
    assert len(sizes) <= 9, sizes
    expected = hf_greedy(hf_reference(tiny_model_dir("llama")), prompt, 18)
    assert [t for p in pieces for t in p] == expected
