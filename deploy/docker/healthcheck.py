#!/usr/bin/env python3
"""The container image's health check: GET the HTTP health route of the pdserve service this container runs.

    pdserve-healthcheck [healthz|readyz]     (default healthz)

The role and its HTTP port come from PID 1's command line (``pdserve ROLE ... --http-port N`` for the router,
``--metrics-port N`` for a worker; ``--flag=N`` works too), else from ``PDSERVE_HTTP_PORT`` /
``PDSERVE_METRICS_PORT``, else the image's defaults (8000 / 9100). Exit 0 when the route answers 200 within
3 s, 1 otherwise; a container that runs no server (``pdserve model build-tiny``) has nothing to probe: exit 0.
The image's HEALTHCHECK uses ``healthz`` (alive); docker-compose gates start order on ``readyz`` (ready for
traffic: model loaded, registered in Redis).
"""

from __future__ import annotations

import os
import sys
import urllib.request

PORT_FLAG = {"router": "--http-port", "prefill": "--metrics-port", "decode": "--metrics-port"}
PORT_ENV = {"router": "PDSERVE_HTTP_PORT", "prefill": "PDSERVE_METRICS_PORT", "decode": "PDSERVE_METRICS_PORT"}
DEFAULT_PORT = {"router": 8000, "prefill": 9100, "decode": 9100}
TIMEOUT_S = 3.0


def role_and_port(argv: list[str], env: dict[str, str]) -> tuple[str | None, int | None]:
    """The pdserve role in ``argv`` (PID 1's command line) and the HTTP port it serves; (None, None) if none."""
    role = next((a for a in argv if a in PORT_FLAG), None)
    if role is None:
        return None, None
    flag = PORT_FLAG[role]
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return role, int(argv[i + 1])
        if arg.startswith(flag + "="):
            return role, int(arg.split("=", 1)[1])
    return role, int(env.get(PORT_ENV[role]) or DEFAULT_PORT[role])


def main() -> int:
    route = sys.argv[1] if len(sys.argv) > 1 else "healthz"
    if route not in ("healthz", "readyz"):
        raise ValueError(f"route must be healthz or readyz, got {route!r}")
    with open("/proc/1/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    role, port = role_and_port(argv, dict(os.environ))
    if role is None:
        return 0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/{route}", timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except OSError as e:  # URLError and HTTPError (503 from /readyz) are OSErrors
        print(f"{role} http://127.0.0.1:{port}/{route}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
