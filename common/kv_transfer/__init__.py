"""KV transfer between a prefill and a decode worker: one wire format, one connector interface, transports.

- :mod:`~common.kv_transfer.wire`: the chunk format (header + raw K/V bytes, crc32) and the receiver's
  :class:`~common.kv_transfer.wire.TransferAssembler`;
- :mod:`~common.kv_transfer.connector`: :class:`KVSender` / :class:`KVReceiver`, method by method;
- :mod:`~common.kv_transfer.shm`: same-host transport over shared memory (imported by whoever picks it);
- :mod:`~common.kv_transfer.staging`: device → host copies of the KV to send (pinned memory on CUDA).
"""

from common.kv_transfer.connector import KVReceiver, KVSender, TransferResult, TransferState
from common.kv_transfer.wire import ChecksumError, ChunkRejectedError, TransferAssembler, WireFormatError

__all__ = [
    "ChecksumError",
    "ChunkRejectedError",
    "KVReceiver",
    "KVSender",
    "TransferAssembler",
    "TransferResult",
    "TransferState",
    "WireFormatError",
]
