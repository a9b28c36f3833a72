"""Device → host staging of KV blocks on their way to the wire (the sender's one copy off the device).

``.cpu()`` of a CUDA tensor copies into pageable memory, which the driver bounces through a pinned buffer of
its own at a fraction of the link's bandwidth. :func:`to_host` copies K and V instead into one pinned host
tensor taken from torch's caching host allocator, with non-blocking copies and one synchronize. The allocator
is the reusable buffer: a freed pinned block goes back to its cache (sizes rounded up to a power of two) and
is handed out again only once the copies recorded on it completed, so after the first layers staging takes
cached pinned blocks instead of pinning new memory, and concurrent senders never share a block in use.
Other tensors take the path they always took, ``.contiguous().cpu()``: for a contiguous CPU tensor that is
the tensor itself (no copy), so nothing changes on a CPU worker.
"""

from __future__ import annotations

import torch


def to_host(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous CPU tensors holding ``k`` and ``v`` (equal shapes and dtypes), ready to be read as bytes.

    Non-CUDA input: ``k.contiguous().cpu()``, likewise ``v`` (contiguous CPU tensors come back as they are, no
    copy). CUDA input: the two halves of one pinned ``[2, *k.shape]`` tensor, filled by non-blocking copies on
    the current stream of ``k``'s device, waited for before returning (:func:`stage_async`): the copies follow every
    kernel queued on that stream before the call (``export_kv``'s ``read_blocks`` on the default stream), and
    the bytes are complete when this returns. Blocks the calling thread for the copy: meant for a transport's
    sending thread, not the engine's (whose layer sink gets host copies already: :func:`stage_async`).
    """
    if k.device.type != "cuda":
        return k.detach().contiguous().cpu(), v.detach().contiguous().cpu()
    host_k, host_v, ready = stage_async(k, v)
    ready.synchronize()
    return host_k, host_v


def stage_async(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
    """CUDA ``k`` and ``v`` (equal shapes and dtypes) into the two halves of one pinned host tensor, by
    non-blocking copies queued on the current stream of their device after the kernels that wrote them, and an
    event recorded after the copies: the halves hold the bytes once the event completed. Returns at once: for the
    engine's thread, which hands a layer's KV off the device as it is computed (a queue of device copies waiting
    on a slow link would hold GPU memory the KV budget does not count)."""
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} differ")
    host = torch.empty((2, *k.shape), dtype=k.dtype, pin_memory=True)
    with torch.cuda.device(k.device):
        host[0].copy_(k.detach(), non_blocking=True)
        host[1].copy_(v.detach(), non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(k.device))
    return host[0], host[1], ready
