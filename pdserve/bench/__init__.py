"""``pdserve bench``: a load generator against the router, one concept per module.

- :mod:`pdserve.bench.workload`: the synthetic workload (sessions of turns, prompt token ids, lengths) and the
  arrival schedule (Poisson or fixed rate); pure and seeded;
- :mod:`pdserve.bench.backend`: the :class:`Chunk` a backend streams and the :class:`Backend` protocol;
- :mod:`pdserve.bench.grpc_backend`, :mod:`pdserve.bench.http_backend`: the router's gRPC API and the
  OpenAI-compatible HTTP API (``POST /v1/completions``, server-sent events);
- :mod:`pdserve.bench.runner`: issues the requests (one thread per session in flight) and stamps times;
- :mod:`pdserve.bench.metrics`: per-request TTFT, TPOT, ITL, E2E, percentiles and goodput; pure;
- :mod:`pdserve.bench.report`: a pass's summary, the JSON result and the table for people;
- :mod:`pdserve.bench.plots`: PNG plots (matplotlib, imported lazily).

The command itself (flags, wiring) is :mod:`pdserve.commands.bench`. Nothing here imports torch.
"""
