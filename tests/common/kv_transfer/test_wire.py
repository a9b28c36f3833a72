"""The KV chunk wire format and the receiver-side assembler: exact bytes, exact errors."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.kv_cache import KVCacheSpec
from common.kv_transfer.wire import (
    FLAG_LAST,
    ChecksumError,
    ChunkHeader,
    ChunkRejectedError,
    TransferAssembler,
    WireFormatError,
    decode_chunk,
    decode_header,
    encode_chunk,
    iter_layer_chunks,
)

# decode_chunk over immutable bytes (what gRPC hands over) makes torch warn once that the views are read-only
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def random_kv(shape, dtype, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of random bit patterns (NaNs and infinities included): only a bit-exact path keeps them."""
    g = torch.Generator().manual_seed(seed)
    bits = _BITS[dtype]
    info = torch.iinfo(bits)
    k, v = (torch.randint(info.min, info.max, shape, dtype=bits, generator=g).view(dtype) for _ in range(2))
    return k, v


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


# -- encode / decode --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 16, 2, 8), (5, 4, 8, 64)])
def test_round_trip_is_bit_exact(dtype, shape):
    k, v = random_kv(shape, dtype)
    chunk = encode_chunk("req-1", 7, 2, k, v, seq=3, total_chunks=9)
    num_payload = 2 * k.numel() * k.element_size()
    assert chunk.header == ChunkHeader(
        request_id="req-1", layer=7, first_block=2, num_blocks=shape[0], dtype=dtype, shape=shape,
        payload_bytes=num_payload, checksum=zlib.crc32(k.view(_BITS[dtype]).numpy().tobytes()
                                                       + v.view(_BITS[dtype]).numpy().tobytes()),
        seq=3, total_chunks=9, flags=0,
    )  # fmt: skip
    assert chunk.num_bytes == len(bytes(chunk)) == 128 + num_payload

    header, k2, v2 = decode_chunk(bytes(chunk))
    assert header == chunk.header and same_bits(k2, k) and same_bits(v2, v)
    # the (header, payload) form, as a transport that read them separately has them
    header, k3, v3 = decode_chunk((chunk.header_buf, bytes(chunk)[len(chunk.header_buf) :]))
    assert header == chunk.header and same_bits(k3, k) and same_bits(v3, v)
    assert decode_header(bytes(chunk)) == chunk.header


def test_encode_views_the_tensors_and_decode_views_the_buffer():
    kv = torch.randn(2, 3, 4, 2, 8)  # [K|V, n, bs, H, D], as read_blocks makes them
    chunk = encode_chunk("req-1", 0, 0, kv[0], kv[1], seq=0)
    assert [address(p) for p in chunk.payload_parts] == [kv[0].data_ptr(), kv[1].data_ptr()]

    buf = bytearray(bytes(chunk))
    _, k, v = decode_chunk(buf)
    assert k.data_ptr() == address(buf) + 128 and v.data_ptr() == address(buf) + 128 + 3 * 4 * 2 * 8 * 4
    buf[128:132] = struct.pack("<f", 1.5)  # a view, not a copy
    assert k[0, 0, 0, 0].item() == 1.5

    strided = torch.randn(4, 3, 2, 8).transpose(0, 1)  # not contiguous: copied once, still exact
    _, k, v = decode_chunk(bytes(encode_chunk("req-1", 0, 0, strided, strided, seq=0)))
    assert torch.equal(k, strided) and torch.equal(v, strided)


def test_header_bytes_follow_the_documented_layout():
    k, v = random_kv((2, 4, 2, 8), torch.float16)
    chunk = encode_chunk("ab", 3, 5, k, v, seq=6, total_chunks=7, flags=FLAG_LAST)
    buf = chunk.header_buf
    assert len(buf) == 128 and buf[:4] == b"PDKV"
    fields = struct.unpack_from("<HHIIIIIIBBH4IQII", buf, 4)
    assert fields[:-1] == (1, 128, FLAG_LAST, 3, 5, 2, 6, 7, 1, 2, 2, 2, 4, 2, 8, 512, chunk.header.checksum)
    assert fields[-1] == zlib.crc32(buf[68:], zlib.crc32(buf[:64]))  # the header checksum skips itself
    assert buf[68:70] == b"ab" and buf[70:] == bytes(58)
    assert chunk.header.is_last and chunk.header.num_header_bytes == 128


def test_flipped_payload_byte_raises_checksum_error_naming_request_layer_and_seq():
    k, v = random_kv((2, 4, 2, 8), torch.bfloat16)
    chunk = encode_chunk("req-9", 4, 0, k, v, seq=11)
    buf = bytearray(bytes(chunk))
    buf[128 + 300] ^= 0x01
    actual = zlib.crc32(buf[128:])
    expected_message = (
        f"checksum mismatch in request 'req-9', layer 4, blocks [0, 2), seq 11: "
        f"expected {chunk.header.checksum:#010x}, got {actual:#010x}"
    )
    with pytest.raises(ChecksumError) as err:
        decode_chunk(buf)
    assert str(err.value) == expected_message


def _reseal(buf: bytearray) -> bytearray:
    """Recompute the header checksum after a test edited a field (so the field's own check is reached)."""
    num_header_bytes = struct.unpack_from("<H", buf, 6)[0]
    struct.pack_into("<I", buf, 64, zlib.crc32(buf[68:num_header_bytes], zlib.crc32(buf[:64])))
    return buf


def _edit(offset: int, fmt: str, value, reseal: bool = True):
    def edit(buf: bytearray) -> bytearray:
        struct.pack_into(fmt, buf, offset, value)
        return _reseal(buf) if reseal else buf

    return edit


@pytest.mark.parametrize(
    "damage, message",
    [
        (_edit(0, "<4s", b"XXXX"), "bad magic b'XXXX', expected b'PDKV': not a pdserve KV chunk"),
        (_edit(4, "<H", 2), "wire format version 2 is not supported (this build reads 1)"),
        (lambda b: b[:40], "truncated header: 40 bytes, a header has at least 68"),
        (lambda b: b[:100], "truncated header: 100 bytes, header_bytes says 128"),
        (lambda b: b[:-1], "payload of 511 bytes, header says payload_bytes 512 (request 'req-1', layer 0"),
        (lambda b: b + b"\0", "payload of 513 bytes, header says payload_bytes 512"),
        (_edit(12, "<I", 1, reseal=False), "header checksum mismatch: header says 0x"),
        (_edit(6, "<H", 64), "header_bytes 64 != 128 for a 5-byte request id"),
        (_edit(34, "<H", 0), "request_id_len 0 is outside 1..256"),
        (_edit(33, "<B", 9), "unknown dtype code 9 (known: [1, 2, 3])"),
        (_edit(32, "<B", 2), "unknown chunk kind 2"),
        (_edit(8, "<I", 6), "flags 0x6 has unknown bits"),
        (_edit(36, "<I", 3), "shape[0] 3 != num_blocks 2 (must be >= 1)"),
        (_edit(52, "<Q", 1024), "payload_bytes 1024 != 2 x shape [2, 4, 2, 8] x 2 bytes (512)"),
        (_edit(28, "<I", 1), "seq 1 >= total_chunks 1"),
    ],
)
def test_malformed_chunk_raises_wire_format_error_naming_the_field(damage, message):
    k, v = random_kv((2, 4, 2, 8), torch.float16)
    buf = damage(bytearray(bytes(encode_chunk("req-1", 0, 0, k, v, seq=1))))
    with pytest.raises(WireFormatError) as err:
        decode_chunk(buf)
    assert str(err.value).startswith(message)
    assert not isinstance(err.value, ChecksumError)


@pytest.mark.parametrize(
    "request_id, k, v, message",
    [
        ("r" * 257, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), "request_id must be 1..256 UTF-8 bytes, got 257"),
        ("", torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), "request_id must be 1..256 UTF-8 bytes, got 0"),
        ("r", torch.zeros(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64),
         "dtype torch.float64 has no wire code"),
        ("r", torch.zeros(2, 1, 1, 1), torch.zeros(1, 1, 1, 1), "K (2, 1, 1, 1) torch.float32 and V (1, 1, 1, 1)"),
        ("r", torch.zeros(0, 1, 1, 1), torch.zeros(0, 1, 1, 1), "K/V shape must be [num_blocks >= 1"),
        ("r", torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), "K/V shape must be [num_blocks >= 1"),
    ],
)  # fmt: skip
def test_encode_rejects_what_the_wire_cannot_carry(request_id, k, v, message):
    with pytest.raises(WireFormatError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        encode_chunk(request_id, 0, 0, k, v, seq=0)


# -- splitting a layer into chunks ------------------------------------------------------------------------------


def test_layer_splits_into_chunks_of_whole_blocks_within_max_chunk_bytes():
    k, v = random_kv((10, 4, 2, 8), torch.float32)  # 512 payload bytes per block (K+V)
    chunks = list(iter_layer_chunks("req-1", 2, k, v, 128 + 3 * 512, first_seq=5, last=True))
    assert [(c.header.first_block, c.header.num_blocks, c.header.seq) for c in chunks] == [
        (0, 3, 5), (3, 3, 6), (6, 3, 7), (9, 1, 8),
    ]  # fmt: skip
    assert [c.header.is_last for c in chunks] == [False, False, False, True]
    assert max(c.num_bytes for c in chunks) == 128 + 3 * 512
    # a block larger than max_chunk_bytes still travels, one per chunk
    assert [c.header.num_blocks for c in iter_layer_chunks("req-1", 2, k, v, 1)] == [1] * 10


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    num_layers=st.integers(1, 3),
    dims=st.tuples(st.integers(1, 9), st.integers(1, 4), st.integers(1, 3), st.integers(1, 8)),
    max_chunk_bytes=st.integers(1, 3000),
    data=st.data(),
)
def test_chunks_in_any_order_reassemble_the_exact_layers(dtype, num_layers, dims, max_chunk_bytes, data):
    num_blocks, block_size, num_kv_heads, head_dim = dims
    spec = KVCacheSpec(num_layers, num_kv_heads, head_dim, block_size, dtype)
    sent = [random_kv(dims, dtype, seed=layer) for layer in range(num_layers)]
    chunks, seq = [], 0
    for layer, (k, v) in enumerate(sent):
        layer_chunks = list(iter_layer_chunks("req-h", layer, k, v, max_chunk_bytes, first_seq=seq))
        seq += len(layer_chunks)
        ranges = [(c.header.first_block, c.header.num_blocks) for c in layer_chunks]
        assert [a for a, _ in ranges] == [0] + [a + n for a, n in ranges[:-1]]  # contiguous, in order
        assert sum(n for _, n in ranges) == num_blocks
        assert all(c.num_bytes <= max_chunk_bytes or c.header.num_blocks == 1 for c in layer_chunks)
        chunks += layer_chunks

    received = torch.full((num_layers, 2, *dims), float("nan"), dtype=dtype)

    def write(layer, first_block, k, v):
        received[layer, 0, first_block : first_block + k.shape[0]] = k
        received[layer, 1, first_block : first_block + k.shape[0]] = v

    assembler = TransferAssembler("req-h", num_layers, num_blocks, spec, write)
    for i, chunk in enumerate(data.draw(st.permutations(chunks))):
        assert not assembler.complete
        assembler.feed(bytes(chunk))
        assert assembler.num_chunks == i + 1
    assert assembler.complete and assembler.missing_ranges() == []
    for layer, (k, v) in enumerate(sent):
        assert same_bits(received[layer, 0], k) and same_bits(received[layer, 1], v)


# -- the assembler's checks ---------------------------------------------------------------------------------------

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)


def chunk(layer: int, first_block: int, num_blocks: int, seq: int, *, request_id="r", block_size=4, dtype=None,
          flags=0) -> bytes:  # fmt: skip
    k, v = random_kv((num_blocks, block_size, 2, 4), dtype or torch.float32, seed=seq)
    return bytes(encode_chunk(request_id, layer, first_block, k, v, seq=seq, flags=flags))


class Recorder(TransferAssembler):
    """A transfer whose ``write`` records ``(layer, first_block, num_blocks)``."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int]] = []
        super().__init__("r", 2, 4, SPEC, lambda layer, first, k, v: self.writes.append((layer, first, k.shape[0])))


@pytest.fixture
def assembler():
    """A 2-layer x 4-block transfer of request 'r'."""
    return Recorder()


def test_assembler_completes_only_when_every_block_of_every_layer_arrived(assembler):
    assembler.feed(chunk(1, 0, 4, seq=2))
    assert not assembler.complete and assembler.missing_ranges() == [(0, 0, 4)]
    assembler.feed(chunk(0, 2, 2, seq=1))
    assert not assembler.complete and assembler.missing_ranges() == [(0, 0, 2)]
    assert assembler.describe_progress() == "6 of 8 blocks arrived (2 chunks); missing: layer 0 blocks [0, 2)"
    assembler.feed(chunk(0, 0, 2, seq=0))
    assert assembler.complete and assembler.writes == [(1, 0, 4), (0, 2, 2), (0, 0, 2)]
    assert assembler.num_bytes == 2 * (4 + 2 + 2) * 4 * 2 * 4 * 4


@pytest.mark.parametrize(
    "bad, message",
    [
        (chunk(0, 0, 2, seq=0), "duplicate chunk: request 'r', layer 0, blocks [0, 2), seq 0 repeats seq 0"),
        (chunk(0, 1, 2, seq=5), "request 'r', layer 0, blocks [1, 3), seq 5 overlaps block 1 of layer 0, which "
                                "already arrived"),
        (chunk(2, 0, 1, seq=5), "unknown layer in request 'r', layer 2, blocks [0, 1), seq 5: the transfer has "
                                "layers [0, 2)"),
        (chunk(1, 3, 2, seq=5), "request 'r', layer 1, blocks [3, 5), seq 5 goes past the transfer's 4 blocks"),
        (chunk(1, 0, 2, seq=5, block_size=8), "request 'r', layer 1, blocks [0, 2), seq 5 has K/V [2, 8, 2, 4] "
                                              "torch.float32, the reservation expects [2, 4, 2, 4] torch.float32"),
        (chunk(1, 0, 2, seq=5, dtype=torch.float16), "has K/V [2, 4, 2, 4] torch.float16, the reservation expects "
                                                     "[2, 4, 2, 4] torch.float32"),
        (chunk(1, 0, 2, seq=5, request_id="q"), "chunk of request 'q', layer 1, blocks [0, 2), seq 5 arrived for "
                                                "request 'r'"),
    ],
)  # fmt: skip
def test_assembler_rejects_a_chunk_that_does_not_fit_and_changes_nothing(assembler, bad, message):
    assembler.feed(chunk(0, 0, 2, seq=0))
    with pytest.raises(ChunkRejectedError) as err:
        assembler.feed(bad)
    assert message in str(err.value)
    assert assembler.writes == [(0, 0, 2)] and assembler.num_chunks == 1
    assert assembler.missing_ranges() == [(0, 2, 4), (1, 0, 4)]
    for layer, first, n, seq in [(0, 2, 2, 1), (1, 0, 4, 2)]:  # the rest still goes in
        assembler.feed(chunk(layer, first, n, seq))
    assert assembler.complete


def test_assembler_rejects_chunks_past_the_last_one_and_corrupt_ones(assembler):
    assembler.feed(chunk(0, 0, 2, seq=1, flags=FLAG_LAST))
    with pytest.raises(ChunkRejectedError, match=r"seq 2 is past the last chunk \(seq 1\)"):
        assembler.feed(chunk(0, 2, 2, seq=2))
    corrupt = bytearray(chunk(0, 2, 2, seq=0))
    corrupt[-1] ^= 0x80
    with pytest.raises(ChecksumError, match=r"request 'r', layer 0, blocks \[2, 4\), seq 0: expected"):
        assembler.feed(corrupt)
    assert assembler.writes == [(0, 0, 2)] and assembler.missing_ranges() == [(0, 2, 4), (1, 0, 4)]
