"""``pdserve up``'s placement of CUDA workers: spread over the GPUs, a KV share each where they share one."""

from __future__ import annotations

from pdserve.commands.up import cuda_placement


def test_workers_asking_for_cuda_spread_over_the_gpus():
    workers = [["--device", "cuda"], ["--device=cuda"], ["--device", "cuda"], ["--device", "cuda"]]
    assert cuda_placement(workers, 4) == [["--device", f"cuda:{i}"] for i in range(4)]


def test_workers_sharing_a_gpu_split_its_kv_memory():
    workers = [["--device", "cuda"], ["--device", "cuda"], ["--device", "cuda", "--kv-cache-memory=2e9"]]
    # two GPUs: cuda:0 for the first and third, cuda:1 for the second; the third keeps its own KV size
    assert cuda_placement(workers, 2) == [["--device", "cuda:0", "--kv-cache-memory", "0.4"], ["--device", "cuda:1"],
                                          ["--device", "cuda:0"]]  # fmt: skip
    one_gpu = cuda_placement(workers[:2], 1)
    assert one_gpu == [["--device", "cuda:0", "--kv-cache-memory", "0.4"]] * 2


def test_other_devices_are_left_as_given():
    workers = [[], ["--device", "cpu"], ["--device", "cuda:1"], ["--device", "cuda", "--device", "cpu"]]
    assert cuda_placement(workers, 2) == [[], [], [], []]
    assert cuda_placement([["--device", "cuda"]], 0) == [[]]  # no GPU seen: the worker says so itself
