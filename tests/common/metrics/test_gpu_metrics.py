"""GPU gauges and the /healthz ``gpu`` entry from NVML, with a fake NVML module (no GPU, no pynvml needed)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.engine.engine_loop import EngineStats
from common.metrics import names
from common.metrics.gpu import GpuMonitor, GpuRef
from common.metrics.worker import WorkerMetrics

GiB = 1 << 30


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The NVML calls common.metrics.gpu makes, over a table of GPUs keyed by NVML index."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: dict[int, dict], *, init_fails: bool = False) -> None:
        self.gpus = gpus  # NVML index -> {"uuid", "name", "used", "total", "util"} ("fail": queries raise)
        self.init_fails = init_fails
        self.calls: list[str] = []

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_fails:
            raise FakeNVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index, gpu in self.gpus.items():
            if gpu["uuid"] == uuid:
                return index
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetHandleByIndex(self, index):
        if index not in self.gpus:
            raise FakeNVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetName(self, handle):
        return self.gpus[handle]["name"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        gpu = self.gpus[handle]
        if gpu.get("fail"):
            raise FakeNVMLError("GPU is lost")
        return SimpleNamespace(used=gpu["used"], total=gpu["total"], free=gpu["total"] - gpu["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        if self.gpus[handle]["util"] is None:  # a MIG instance
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(gpu=self.gpus[handle]["util"], memory=0)


def h200(uuid: str, used: int, util: int) -> dict:
    return {"uuid": uuid, "name": b"NVIDIA H200", "used": used, "total": 141 * GiB, "util": util}


def gpu_samples(metrics: WorkerMetrics) -> dict[tuple[str, str], float]:
    """{(series, gpu label): value} of the pdserve:gpu_* series of a scrape."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, s.labels["gpu"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("pdserve:gpu_")
    }


def worker_metrics(gpu: GpuMonitor | None) -> WorkerMetrics:
    return WorkerMetrics("decode", lambda: EngineStats(kv_blocks_total=8), lambda: True, gpu=gpu)


def test_the_gauges_show_each_gpu_with_its_cuda_index_read_at_scrape_time():
    nvml = FakeNVML({0: h200("GPU-aaa", 10 * GiB, 0), 3: h200("GPU-bbb", 60 * GiB, 87)})
    monitor = GpuMonitor(nvml, [GpuRef(1, "GPU-bbb")])  # CUDA 1 is NVML 3: found by UUID
    metrics = worker_metrics(monitor)
    assert gpu_samples(metrics) == {
        ("pdserve:gpu_memory_used_bytes", "1"): 60 * GiB,
        ("pdserve:gpu_memory_total_bytes", "1"): 141 * GiB,
        ("pdserve:gpu_utilization_ratio", "1"): 0.87,
    }
    nvml.gpus[3]["used"], nvml.gpus[3]["util"] = 70 * GiB, 5  # read again at the next scrape, not cached
    s = gpu_samples(metrics)
    assert s[("pdserve:gpu_memory_used_bytes", "1")] == 70 * GiB
    assert s[("pdserve:gpu_utilization_ratio", "1")] == 0.05


def test_a_mig_instance_is_found_by_its_mig_uuid():
    """torch names a MIG instance's UUID as a GPU's ("GPU-" + it); NVML as "MIG-" + it, and its index 0 would be
    another instance or the whole GPU."""
    nvml = FakeNVML({0: h200("GPU-aaa", 1 * GiB, 1), 1: h200("MIG-bbb", 9 * GiB, 40)})
    monitor = GpuMonitor(nvml, [GpuRef(0, "GPU-bbb")])
    assert [(s.index, s.memory_used_bytes) for s in monitor.sample()] == [(0, 9 * GiB)]


def test_a_mig_instance_shows_its_memory_without_a_utilization():
    """NVML answers NOT_SUPPORTED for a MIG instance's utilization, not for its memory: the memory gauges stay,
    the utilization series is absent and /healthz says null (before, the whole GPU was left out)."""
    nvml = FakeNVML({0: h200("GPU-aaa", 1 * GiB, 30), 1: h200("MIG-bbb", 9 * GiB, None)})
    monitor = GpuMonitor(nvml, [GpuRef(0, "GPU-aaa"), GpuRef(1, "GPU-bbb")])
    assert [(s.index, s.memory_used_bytes, s.utilization) for s in monitor.sample()] == [(0, GiB, 0.3),
                                                                                      (1, 9 * GiB, None)]
    assert monitor.health()[1]["utilization"] is None
    assert gpu_samples(worker_metrics(monitor)) == {
        ("pdserve:gpu_memory_used_bytes", "0"): GiB, ("pdserve:gpu_memory_used_bytes", "1"): 9 * GiB,
        ("pdserve:gpu_memory_total_bytes", "0"): 141 * GiB, ("pdserve:gpu_memory_total_bytes", "1"): 141 * GiB,
        ("pdserve:gpu_utilization_ratio", "0"): 0.3,
    }


def test_health_lists_index_name_memory_and_utilization():
    monitor = GpuMonitor(FakeNVML({0: h200("GPU-aaa", 3 * GiB, 50)}), [GpuRef(0, "GPU-aaa")])
    assert monitor.health() == [
        {
            "index": 0,
            "name": "NVIDIA H200",
            "memory_used_bytes": 3 * GiB,
            "memory_total_bytes": 141 * GiB,
            "utilization": 0.5,
        }
    ]


def test_the_gpu_specs_are_worker_gauges_labelled_by_gpu():
    for spec in (names.GPU_MEMORY_USED, names.GPU_MEMORY_TOTAL, names.GPU_UTILIZATION):
        assert spec in names.WORKER_METRICS and spec not in names.ROUTER_METRICS
        assert (spec.kind, spec.labels) == ("gauge", ("gpu",))


def test_without_a_monitor_a_worker_exposes_no_gpu_series():
    assert gpu_samples(worker_metrics(None)) == {}
    text = generate_latest(worker_metrics(None).registry).decode()
    assert "pdserve:gpu_" not in text and "pdserve:kv_cache_blocks_total 8.0" in text


def test_without_a_uuid_the_index_goes_through_cuda_visible_devices(monkeypatch):
    nvml = FakeNVML({0: h200("GPU-aaa", 1 * GiB, 0), 2: h200("GPU-ccc", 2 * GiB, 0)})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [s.memory_used_bytes for s in GpuMonitor(nvml, [GpuRef(0)]).sample()] == [2 * GiB]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ccc")  # UUIDs: not indices, NVML index = CUDA index
    assert [s.memory_used_bytes for s in GpuMonitor(nvml, [GpuRef(0, "GPU-unknown")]).sample()] == [1 * GiB]


def test_a_gpu_that_fails_a_query_is_left_out_of_that_sample_only():
    nvml = FakeNVML({0: h200("GPU-aaa", 1 * GiB, 10), 1: h200("GPU-bbb", 2 * GiB, 20)})
    monitor = GpuMonitor(nvml, [GpuRef(0, "GPU-aaa"), GpuRef(1, "GPU-bbb")])
    nvml.gpus[0]["fail"] = True
    assert [s.index for s in monitor.sample()] == [1]
    nvml.gpus[0]["fail"] = False
    assert [s.index for s in monitor.sample()] == [0, 1]


def test_a_gpu_nvml_cannot_find_is_left_out():
    monitor = GpuMonitor(FakeNVML({0: h200("GPU-aaa", GiB, 0)}), [GpuRef(5, "GPU-zzz")])
    assert monitor.indices == [] and monitor.sample() == []


def test_for_device_is_none_on_the_cpu_without_touching_nvml():
    nvml = FakeNVML({0: h200("GPU-aaa", GiB, 0)})
    assert GpuMonitor.for_device("cpu", nvml=nvml) is None
    assert nvml.calls == []


def test_for_device_is_none_without_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert GpuMonitor.for_device("cuda:0") is None


def test_for_device_is_none_when_nvml_does_not_start():
    nvml = FakeNVML({0: h200("GPU-aaa", GiB, 0)}, init_fails=True)
    assert GpuMonitor.for_device("cuda:0", nvml=nvml) is None
    assert nvml.calls == ["init"]


def test_for_device_is_none_and_shuts_nvml_down_when_the_device_is_not_found():
    nvml = FakeNVML({0: h200("GPU-aaa", GiB, 0)})
    assert GpuMonitor.for_device("cuda:4", nvml=nvml) is None
    assert nvml.calls == ["init", "shutdown"]


def test_for_device_watches_the_engine_device_and_close_is_idempotent():
    nvml = FakeNVML({0: h200("GPU-aaa", GiB, 0), 1: h200("GPU-bbb", 2 * GiB, 40)})
    monitor = GpuMonitor.for_device("cuda:1", nvml=nvml)  # no CUDA here: no UUID, found by index
    assert monitor is not None and monitor.indices == [1]
    assert monitor.health()[0]["memory_used_bytes"] == 2 * GiB
    monitor.close()
    monitor.close()
    assert nvml.calls == ["init", "shutdown"] and monitor.sample() == []


def test_for_device_watches_every_tensor_parallel_rank():
    nvml = FakeNVML({i: h200(f"GPU-{i}", i * GiB, 10 * i) for i in range(4)})
    monitor = GpuMonitor.for_device("cuda:0", nvml=nvml, ranks=2)  # ranks on cuda:0 and cuda:1
    assert monitor is not None and monitor.indices == [0, 1]
    assert [s.memory_used_bytes for s in monitor.sample()] == [0, GiB]
