"""HTTP for pdserve's services: the threaded HTTP front every service runs (``/metrics``, ``/healthz``,
``/readyz``; the router adds the OpenAI-compatible API and a WebSocket stream)."""
