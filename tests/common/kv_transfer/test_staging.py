"""Staging KV to the host before encoding: no copy for contiguous CPU tensors, exact bytes otherwise.

The CUDA path (pinned memory, non-blocking copies) is tested in tests/gpu/test_cuda_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from common.kv_transfer.staging import to_host
from common.kv_transfer.wire import decode_chunk, iter_layer_chunks
from tests.common.kv_transfer.test_wire import random_kv

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def test_contiguous_cpu_tensors_come_back_as_they_are():
    k, v = random_kv((3, 4, 2, 8), torch.bfloat16)
    hk, hv = to_host(k, v)
    assert hk.data_ptr() == k.data_ptr() and hv.data_ptr() == v.data_ptr()


def test_non_contiguous_cpu_tensors_are_copied_contiguous_bit_exact():
    k, v = random_kv((3, 2, 4, 8), torch.float16)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [3, 4, 2, 8], strided like the cache's head-major layout
    hk, hv = to_host(k, v)
    assert hk.is_contiguous() and hv.is_contiguous()
    assert hk.device.type == "cpu" and hk.shape == k.shape
    assert torch.equal(hk.view(torch.int16), k.view(torch.int16))
    assert torch.equal(hv.view(torch.int16), v.view(torch.int16))


def test_a_layer_staged_once_splits_into_chunks_that_decode_to_the_input():
    k, v = random_kv((2, 5, 4, 8), torch.float32, seed=3)
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [5, 2, 4, 8], not contiguous
    bytes_per_block = 2 * k[0].numel() * 4
    chunks = list(iter_layer_chunks("r1", 2, k, v, max_chunk_bytes=2 * bytes_per_block + 128, last=True))
    assert [c.header.num_blocks for c in chunks] == [2, 2, 1]
    got_k = torch.cat([decode_chunk(bytes(c))[1] for c in chunks])
    got_v = torch.cat([decode_chunk(bytes(c))[2] for c in chunks])
    assert torch.equal(got_k.view(torch.int32), k.contiguous().view(torch.int32))
    assert torch.equal(got_v.view(torch.int32), v.contiguous().view(torch.int32))
