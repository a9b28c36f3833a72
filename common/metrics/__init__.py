"""Prometheus metrics of pdserve's services: names (one module), the router's and the workers' metric sets,
and the HTTP front that serves ``/metrics``, ``/healthz`` and ``/readyz``."""
