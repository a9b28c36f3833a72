"""Build prometheus_client metric objects from :mod:`common.metrics.names` specs on a service's own registry.

Each service gets its own ``CollectorRegistry`` (never the global default one): several services can then
run in one process (the in-process test cluster) without their series colliding.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from common.metrics.names import MetricSpec

disable_created_metrics()  # no `*_created` series: they double a scrape's size and no dashboard reads them
_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def build(specs: Iterable[MetricSpec], registry: CollectorRegistry) -> dict[str, object]:
    """One metric object per spec, registered on ``registry``; keyed by the spec's name."""
    out: dict[str, object] = {}
    for spec in specs:
        cls = _KINDS[spec.kind]
        kwargs = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
        out[spec.name] = cls(spec.name, spec.help, labelnames=spec.labels, registry=registry, **kwargs)
    return out
