"""Start a tensor-parallel engine on one host: this process drives, N-1 spawned processes follow.

:func:`launch_engine` is what ``pdserve run --tensor-parallel-size N`` calls. It spawns ranks 1..N-1 (the
``spawn`` start method, daemon processes: they end with this one), makes this process rank 0, and on every rank
runs the life cycle of :mod:`common.engine.tensor_parallel`: join the process group (rendezvous over TCP on a
free loopback port; gloo on the CPU, NCCL on CUDA), load the model sharded, build the engine. It returns rank
0's engine; ``engine.close()`` stops the followers and joins them.

Rank r uses ``device`` as given on the CPU and ``cuda:r`` on CUDA (one GPU per rank, ranks 0..N-1 on GPUs
0..N-1). A follower that fails logs its traceback to stderr and exits; the driver's next collective then fails
(at worst after ``startup_timeout_s``), so a failed start ends in an exception, never a hang. A follower that
serves ignores SIGINT and SIGTERM (a signal to the process group, e.g. Ctrl-C or a supervisor's SIGTERM, leaves
the driver to drain and stop it); it ends with the driver's close, the driver's death or SIGKILL.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def launch_engine(model_dir: str | os.PathLike[str], config: EngineConfig, *, tensor_parallel_size: int,
                  device: str = "cpu", startup_timeout_s: float | None = None, **load_kwargs: Any) -> LLMEngine:
    """Rank 0's engine of a model sharded over ``tensor_parallel_size`` processes of this host.

    ``load_kwargs`` go to :func:`~common.engine.loader.load_model` on every rank (picklable values). A size of
    1 loads on this process alone. On the CPU, ``config.num_threads`` None becomes torch's default thread count
    divided by the size, per rank. Raises ModelLoadError before starting anything when the size does not divide
    the model's heads, ValueError for a bad size or too few GPUs.
    """
    from common.engine.engine import LLMEngine
    from common.engine.loader import check_tensor_parallel_size, load_model
    from common.engine.tensor_parallel import DEFAULT_STARTUP_TIMEOUT_S, TensorParallelGroup

    size = tensor_parallel_size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return LLMEngine(load_model(model_dir, device=device, **load_kwargs), config)
    check_tensor_parallel_size(model_dir, size)
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices; {torch.cuda.device_count()} "
                         "are visible")
    if not on_cuda and config.num_threads is None:  # N ranks of torch's default would oversubscribe the cores
        config = dataclasses.replace(config, num_threads=max(1, torch.get_num_threads() // size))
    timeout_s = DEFAULT_STARTUP_TIMEOUT_S if startup_timeout_s is None else startup_timeout_s
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = torch.multiprocessing.get_context("spawn")
    followers = [
        ctx.Process(target=_follower_main, name=f"pdserve-tp-rank{rank}", daemon=True,
                    args=(rank, size, init_method, str(model_dir), config, _rank_device(device, rank), timeout_s,
                          load_kwargs))
        for rank in range(1, size)
    ]
    for proc in followers:
        proc.start()
    group = None
    try:
        group = TensorParallelGroup.initialize(0, size, device=device, init_method=init_method,
                                               startup_timeout_s=timeout_s, followers=followers)
        loaded = load_model(model_dir, device=_rank_device(device, 0), tensor_parallel=group, **load_kwargs)
        engine = LLMEngine(loaded, config)
    except BaseException:
        if group is not None:
            group.abort()
        else:
            for proc in followers:
                proc.terminate()
                proc.join(5.0)
        raise
    log.info("tensor parallel engine ready: %d ranks", size)
    return engine


def _follower_main(rank: int, size: int, init_method: str, model_dir: str, config: EngineConfig, device: str,
                   startup_timeout_s: float, load_kwargs: dict[str, Any]) -> None:
    """Entry point of a spawned follower rank: the tensor-parallel life cycle, then exit."""
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model
    from common.engine.tensor_parallel import TensorParallelGroup, run_follower

    os.environ["LOCAL_RANK"] = str(rank)  # transformers binds each rank's accelerator by it
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {rank}: %(levelname)s %(name)s: %(message)s")
    group = TensorParallelGroup.initialize(rank, size, device=device, init_method=init_method,
                                           startup_timeout_s=startup_timeout_s)
    try:
        engine = LLMEngine(load_model(model_dir, device=device, tensor_parallel=group, **load_kwargs), config)
        # Serving, a follower takes its orders from the driver alone: the driver's close stops it and the driver's
        # death ends its next collective. A signal to the whole process group (Ctrl-C in a terminal, a
        # supervisor's SIGTERM) must not end it while the driver drains its requests; SIGKILL still does.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        num_steps = run_follower(engine)
        log.info("stopped after %d steps", num_steps)
    finally:
        group.close()


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
