"""Memory and utilization of the GPU a worker runs on, from NVML: gauges on ``/metrics``, an entry in ``/healthz``.

NVML comes from the optional package ``nvidia-ml-py`` (module ``pynvml``; ``pip install 'pdserve[gpu]'``).
:meth:`GpuMonitor.for_device` returns a monitor for the engine's CUDA device, or None when there is nothing
to watch: a CPU device, no ``pynvml`` module, NVML failing to start (no driver) or the device not found.
None means no gauges, no ``gpu`` entry in ``/healthz`` and no error. Figures are read when asked (per scrape,
per health probe), never cached; a GPU whose NVML query fails is left out of that one sample.

The ``gpu`` label and the ``index`` of a health entry are the CUDA device index as the worker numbers it
(``--device cuda:N``); the NVML device behind it is found by UUID (by index through ``CUDA_VISIBLE_DEVICES``
when torch gives no UUID), so NVML's own numbering cannot mix two GPUs up.

NVML calls used, so that any object with these names can stand in for ``pynvml`` (tests inject a fake):
``nvmlInit``, ``nvmlShutdown``, ``nvmlDeviceGetHandleByUUID``, ``nvmlDeviceGetHandleByIndex``,
``nvmlDeviceGetName``, ``nvmlDeviceGetMemoryInfo`` (``.used``, ``.total`` in bytes),
``nvmlDeviceGetUtilizationRates`` (``.gpu`` in percent) and the exception class ``NVMLError``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.metrics import names as n

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuRef:
    """One CUDA device of this process: its index as torch numbers it, and NVML's UUID for it when known."""

    index: int
    uuid: str | None = None  # "GPU-xxxxxxxx-..." as NVML spells it


@dataclass(frozen=True)
class GpuSample:
    """What one GPU reported at one moment (the shape of a ``/healthz`` ``gpu`` entry)."""

    index: int  # CUDA device index (the ``gpu`` label)
    name: str
    memory_used_bytes: int  # by every process on the GPU, not only this one
    memory_total_bytes: int
    # 0-1: share of NVML's last sample period (1/6 s to 1 s) in which a kernel ran; None where NVML does not say
    # (a MIG instance: utilization is NOT_SUPPORTED there, its memory is not)
    utilization: float | None


class GpuMonitor:
    """Reads NVML for a fixed set of GPUs; thread-safe (NVML is), so scrapes and health probes may overlap."""

    def __init__(self, nvml: Any, gpus: Sequence[GpuRef]) -> None:
        """``nvml``: an NVML module on which ``nvmlInit`` succeeded (the monitor calls ``nvmlShutdown`` in
        :meth:`close`). Each GPU's NVML handle and name are looked up here, by UUID first, else by index
        (through ``CUDA_VISIBLE_DEVICES`` when it lists indices); a GPU NVML cannot find is left out and logged.
        """
        self._nvml = nvml
        self._error = getattr(nvml, "NVMLError", Exception)
        self._devices: list[tuple[int, str, Any]] = []  # (CUDA index, name, NVML handle)
        for ref in gpus:
            try:
                handle = self._handle(ref)
                self._devices.append((ref.index, _text(nvml.nvmlDeviceGetName(handle)), handle))
            except self._error as exc:
                log.warning(
                    "NVML cannot find CUDA device %d (uuid %s): %s; no GPU figures for it", ref.index, ref.uuid, exc
                )
        self._closed = False

    @classmethod
    def for_device(cls, device: Any, nvml: Any = None, ranks: int = 1) -> GpuMonitor | None:
        """A monitor of the CUDA ``device`` (``torch.device`` or its name); None for a CPU device, without
        ``pynvml``, when NVML does not start or does not find the device. ``nvml``: the NVML module to use
        (default: ``import pynvml``). ``ranks`` > 1: a tensor-parallel engine's GPUs, ``cuda:0`` to
        ``cuda:ranks-1`` (one a rank, as :mod:`common.engine.tp_launcher` places them). Never raises for a missing
        or broken NVML."""
        import torch

        device = torch.device(device)
        if device.type != "cuda":
            return None
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                log.info("no GPU metrics: the pynvml module is not installed (pip install nvidia-ml-py)")
                return None
        try:
            nvml.nvmlInit()
        except getattr(nvml, "NVMLError", Exception) as exc:
            log.info("no GPU metrics: NVML did not start: %s", exc)
            return None
        if ranks > 1:
            indices = list(range(ranks))
        else:
            indices = [device.index if device.index is not None else torch.cuda.current_device()]
        monitor = cls(nvml, [GpuRef(index, _cuda_uuid(index)) for index in indices])
        if not monitor._devices:
            monitor.close()
            return None
        return monitor

    @property
    def indices(self) -> list[int]:
        """The CUDA indices of the GPUs this monitor reads."""
        return [index for index, _, _ in self._devices]

    def sample(self) -> list[GpuSample]:
        """Each GPU's figures now, in index order; a GPU whose memory query fails is left out, one whose
        utilization query fails has ``utilization`` None (both logged at debug)."""
        out = []
        for index, name, handle in self._devices:
            try:
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except self._error as exc:
                log.debug("NVML memory query of GPU %d failed: %s", index, exc)
                continue
            try:
                utilization = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0
            except self._error as exc:
                log.debug("NVML utilization query of GPU %d failed: %s", index, exc)
                utilization = None
            out.append(GpuSample(index, name, int(memory.used), int(memory.total), utilization))
        return out

    def health(self) -> list[dict]:
        """:meth:`sample` as the list of plain dicts ``/healthz`` shows under ``gpu``."""
        return [asdict(s) for s in self.sample()]

    def close(self) -> None:
        """Shut NVML down (once; idempotent). The monitor reads nothing afterwards."""
        if self._closed:
            return
        self._closed = True
        self._devices = []
        try:
            self._nvml.nvmlShutdown()
        except self._error as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    def _handle(self, ref: GpuRef) -> Any:
        if ref.uuid:  # torch gives a MIG instance's UUID as a GPU's: NVML names it "MIG-..."
            for uuid in (ref.uuid, "MIG-" + ref.uuid.removeprefix("GPU-")):
                try:
                    return self._nvml.nvmlDeviceGetHandleByUUID(uuid)
                except self._error:
                    pass
        return self._nvml.nvmlDeviceGetHandleByIndex(_nvml_index(ref.index))


class GpuCollector(Collector):
    """The GPU gauges of :mod:`common.metrics.names`, read from a :class:`GpuMonitor` at each scrape."""

    def __init__(self, monitor: GpuMonitor) -> None:
        self._monitor = monitor

    def collect(self):
        samples = self._monitor.sample()
        for spec, value_of in ((n.GPU_MEMORY_USED, lambda s: s.memory_used_bytes),
                               (n.GPU_MEMORY_TOTAL, lambda s: s.memory_total_bytes),
                               (n.GPU_UTILIZATION, lambda s: s.utilization)):  # fmt: skip
            family = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
            for s in samples:
                value = value_of(s)
                if value is not None:  # no series for a figure NVML does not give (a MIG instance's utilization)
                    family.add_metric((str(s.index),), value)
            yield family


def _cuda_uuid(index: int) -> str | None:
    """NVML's UUID ("GPU-...") of CUDA device ``index``, or None when torch does not tell it."""
    try:
        import torch

        uuid = torch.cuda.get_device_properties(index).uuid
    except Exception:  # noqa: BLE001 - an old torch, no CUDA: the caller falls back to the index
        return None
    return f"GPU-{uuid}" if uuid else None


def _nvml_index(cuda_index: int) -> int:
    """NVML's index of CUDA device ``cuda_index``: through ``CUDA_VISIBLE_DEVICES`` when it lists indices."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if cuda_index < len(visible) and visible[cuda_index].isdigit():
        return int(visible[cuda_index])
    return cuda_index


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
