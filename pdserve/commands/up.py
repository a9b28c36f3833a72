"""``pdserve up``: the whole cluster as local processes: Redis, prefill and decode workers, the router.

    pdserve up [--model DIR] [--prefill N] [--decode M] [--redis-url URL] [--port P] [--http-port H]
               [--api-key-file FILE] [--tls-dir DIR]

Without ``--model`` it builds (once) and serves the embedded tiny model. Without ``--redis-url`` it starts
a ``redis-server`` on a free port. Every service gets free ports (the router ``--port`` and ``--http-port``
if given; each worker's ``/metrics`` port is listed by ``pdserve status --json``). Another process may be handed
such a port as an ephemeral one before the service binds it (each worker holds its gRPC port from its first
moment): a service that exits with code 75 (``pdserve.cli.EXIT_PORT_TAKEN``) is started again on new ports, 3
times in all, with a line on stderr (``pdserve up: NAME could not listen (...); starting it again on other
ports``); the router on ports the user gave is not. When
every service answers its gRPC health check and the router has had time to see every worker in the
registry, it prints one line on stdout:

    pdserve ready: ROUTER_ADDRESS prefill=N decode=M redis=URL logs=DIR http=ROUTER_HTTP_ADDRESS

(``http=``: the router's HTTP front, ``/metrics``, ``/healthz``, ``/readyz``; later keys may be appended.)

With ``--api-key-file FILE`` the router (its gRPC API and HTTP front, all but health, ``/healthz``, ``/readyz``,
``/metrics``) and the workers' ``/admin/warmup`` need one of its keys; ``PDSERVE_API_KEYS`` in ``up``'s
environment reaches every service too (children inherit it). Readiness is checked through the open health
checks, so it works either way.

With ``--tls-dir DIR`` every gRPC connection between services uses mutual TLS: ``up`` writes a throwaway CA
(``DIR/ca.pem``, its key is never written) and one certificate and key per service (``DIR/router.pem``,
``DIR/prefill-0.pem``, ..., ``DIR/NAME.key``; SAN 127.0.0.1 and localhost) plus ``DIR/client.pem`` /
``DIR/client.key`` for tools (``up``'s own health probes, ``grpcurl -cacert DIR/ca.pem -cert DIR/client.pem
-key DIR/client.key``), and passes ``--tls-cert-file``, ``--tls-key-file``, ``--tls-ca-file`` to each
service. The workers' gRPC ports then refuse any peer without a certificate from that CA; the router's
public API stays plaintext. The ready line then ends with `` tls=DIR``. Production should use real
certificates (cert-manager in Kubernetes): see docs/operations.md.

Workers given ``--device cuda`` without an index (``--worker-arg=--device=cuda``) are spread over the GPUs
torch sees, ``cuda:0``, ``cuda:1``, ... in turn; where more workers than GPUs share one, each gets
``--kv-cache-memory`` of its share of the default 0.8 of the free memory (unless it sets its own).

Ctrl-C or SIGTERM stops everything it started (router, workers, Redis, in that order) and exits 0; no
process is left behind, even if ``up`` itself is killed (children get SIGTERM when their parent dies). A
worker that dies is reported on stderr; the rest keep serving (the registry drops it within its TTL).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_DIR = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve")) / "models" / "tiny-llama"
READY_TIMEOUT_S = 300.0
PORT_RETRIES = 3  # services started again, in all, after another process took a port given to them
ROUTER_REFRESH_S = 0.5  # services.router.config.RouterConfig.registry_refresh_s (default)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("up", help="start a whole local cluster (Redis, router, prefill and decode workers)")
    p.add_argument("--model", default=None, help=f"model directory (default: the tiny model in {DEFAULT_MODEL_DIR})")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--port", type=int, default=None, help="router gRPC port (default: a free one)")
    p.add_argument("--http-port", type=int, default=None, help="router HTTP port (default: a free one)")
    p.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS",
                   help="prompts shorter than this are prefilled on the decode worker (default 0: never)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API keys, one per line: the router and the workers' admin routes then require one")
    p.add_argument("--tls-dir", default=None, metavar="DIR",
                   help="mutual TLS between the services with a throwaway CA and certificates written into DIR "
                        "(a local test setup: production should use real certificates, e.g. cert-manager)")
    p.add_argument("--log-dir", default=None, help="where each service writes its log (default: a temp dir)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every worker, e.g. --worker-arg=--kv-cache-memory=1e9 (repeatable)")
    p.add_argument("--prefill-arg", action="append", default=[], metavar="ARG", help="extra prefill argument")
    p.add_argument("--decode-arg", action="append", default=[], metavar="ARG", help="extra decode argument")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG", help="extra router argument")
    p.set_defaults(func=up)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``; the last one wins, as argparse takes
    it), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _num_gpus(workers: list[tuple[str, str, list[str]]]) -> int:
    """The GPUs torch sees, asked only where a worker wants ``--device cuda`` (importing torch takes a second)."""
    if not any(flag_value(argv, "--device") == "cuda" for _, _, argv in workers):
        return 0
    import torch

    return torch.cuda.device_count()


def cuda_placement(workers: list[list[str]], num_gpus: int) -> list[list[str]]:
    """Arguments to append to each worker's (``workers``: their argv) so that workers asking for ``--device cuda``
    without an index spread over the machine's ``num_gpus`` GPUs (``cuda:i``, round robin) and, where several
    share one GPU, each takes its share of the KV memory a lone worker would (the default is 80% of the GPU's
    free memory, measured as each starts: two at once would each take 80%) unless it sets
    ``--kv-cache-memory`` itself."""
    cuda = [i for i, argv in enumerate(workers) if flag_value(argv, "--device") == "cuda"]
    extra: list[list[str]] = [[] for _ in workers]
    if not cuda or num_gpus < 1:
        return extra
    from common.engine.config import DEFAULT_CUDA_KV_CACHE_FRACTION

    for n, i in enumerate(cuda):
        gpu = n % num_gpus
        sharing = len(range(gpu, len(cuda), num_gpus))  # the workers placed on this GPU
        extra[i] += ["--device", f"cuda:{gpu}"]
        if sharing > 1 and flag_value(workers[i], "--kv-cache-memory") is None:
            extra[i] += ["--kv-cache-memory", f"{DEFAULT_CUDA_KV_CACHE_FRACTION / sharing:.4g}"]
    return extra


def up(args: argparse.Namespace) -> int:
    from common.cluster.net import free_port as any_free_port
    from common.cluster.net import wait_for_grpc_health
    from common.cluster.supervisor import Supervisor
    from common.rpc.server import stop_on_signals
    from pdserve.cli import EXIT_PORT_TAKEN

    if args.prefill < 1 or args.decode < 1:
        raise ValueError(f"a cluster needs >= 1 prefill and >= 1 decode worker, got {args.prefill}, {args.decode}")
    auth_args = []
    if args.api_key_file:  # read here first: a missing or empty file fails before anything starts
        from common.security.auth import ApiKeys

        ApiKeys.load(key_file=args.api_key_file, env={})
        auth_args = ["--api-key-file", os.path.abspath(args.api_key_file)]
    model = args.model or str(_tiny_model())
    worker_names = [f"{role}-{i}" for role, count in (("decode", args.decode), ("prefill", args.prefill))
                    for i in range(count)]  # fmt: skip
    tls_args, client_tls = _write_tls(args.tls_dir, worker_names) if args.tls_dir else ({}, None)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    stop = threading.Event()
    stop_on_signals(stop)
    py = [sys.executable, "-m", "pdserve", "--log-level", "INFO"]
    given: set[int] = set()

    def free_port() -> int:  # each service its own: the OS may hand a just-closed port out twice
        while (port := any_free_port()) in given:
            pass
        given.add(port)
        return port

    with Supervisor(grace_s=30.0) as sup:
        redis_url = args.redis_url
        if redis_url is None:
            port = free_port()
            sup.start_redis(port, log_dir / "redis")
            redis_url = f"redis://127.0.0.1:{port}/0"
        endpoints: dict[str, str] = {}
        # each service's command line on new ports: one that exits with EXIT_PORT_TAKEN (another process took a
        # port of its between free_port and its bind) starts again on others, PORT_RETRIES times in all
        commands: dict[str, Callable[[], list[str]]] = {}
        pools = (("decode", args.decode, args.decode_arg), ("prefill", args.prefill, args.prefill_arg))
        workers = [(f"{role}-{i}", role, [*args.worker_arg, *extra]) for role, count, extra in pools
                   for i in range(count)]  # fmt: skip
        placement = cuda_placement([argv for _, _, argv in workers], _num_gpus(workers))
        for (name, role, worker_args), placed in zip(workers, placement):

            def worker_argv(name=name, role=role, worker_args=worker_args, placed=placed) -> list[str]:
                port = free_port()
                endpoints[name] = f"127.0.0.1:{port}"
                argv = [*py, role, "--model", model, "--port", str(port), "--redis-url", redis_url,
                        "--worker-id", name, *auth_args, *tls_args.get(name, []), *worker_args, *placed]
                if role == "decode":  # its shm socket lives with the logs, even if the worker is killed
                    argv += ["--kv-shm-dir", str(log_dir / "kv")]
                return argv

            commands[name] = worker_argv
            sup.spawn(name, worker_argv(), log_path=log_dir / f"{name}.log")
        http_port = args.http_port

        def router_argv() -> list[str]:
            nonlocal http_port
            router_port, http_port = args.port or free_port(), args.http_port or free_port()
            endpoints["router"] = f"127.0.0.1:{router_port}"
            return [*py, "router", "--model", model, "--port", str(router_port), "--http-port", str(http_port),
                    "--redis-url", redis_url, "--local-prefill-threshold", str(args.local_prefill_threshold),
                    *auth_args, *tls_args.get("router", []), *args.router_arg]

        commands["router"] = router_argv
        sup.spawn("router", router_argv(), log_path=log_dir / "router.log")
        retries = PORT_RETRIES

        def started_again(exited: tuple[str, int]) -> bool:
            """Whether the child that exited, ``(name, code)``, had lost a port to another process and now starts
            again on new ones (not the router on ports the user gave)."""
            nonlocal retries
            name, code = exited
            if code != EXIT_PORT_TAKEN or retries == 0 or (name == "router" and args.port and args.http_port):
                return False
            retries -= 1
            print(f"pdserve up: {name} could not listen ({sup[name].tail(1).strip()}); starting it again on "
                  "other ports", file=sys.stderr, flush=True)
            sup.respawn(name, commands[name]())
            return True

        deadline = time.monotonic() + READY_TIMEOUT_S
        for name in endpoints:  # endpoints[name] changes when that service starts again on another port
            probe_tls = None if name == "router" else client_tls  # the router's public port stays plaintext
            while not wait_for_grpc_health(endpoints[name], timeout_s=1.0, tls=probe_tls):
                exited = sup.first_exited()
                if exited is not None and exited[0] in commands and started_again(exited):
                    continue
                if exited is not None or stop.is_set() or time.monotonic() > deadline:
                    why = "stopped" if stop.is_set() else "timeout"
                    if exited:
                        why = f"{exited[0]} exited with {exited[1]}"
                    report = sup[exited[0]].exit_report() if exited else ""
                    failed = exited[0] if exited else name  # the one that exited, not the one awaited
                    print(f"pdserve up: {failed} did not become ready ({why}) {report}", file=sys.stderr)
                    return 1
        if not _wait_router_sees_workers(redis_url, args.prefill + args.decode, deadline, sup):
            exited = sup.first_exited()
            report = f": {sup[exited[0]].exit_report()}" if exited else ""
            print(f"pdserve up: the workers did not all appear in the registry{report}", file=sys.stderr)
            return 1
        print(f"pdserve ready: {endpoints['router']} prefill={args.prefill} decode={args.decode} "
              f"redis={redis_url} logs={log_dir} http=127.0.0.1:{http_port}"
              + (f" tls={os.path.abspath(args.tls_dir)}" if args.tls_dir else ""), flush=True)
        reported: set[str] = set()
        while not stop.wait(0.5):
            for proc in sup.processes:
                if proc.name not in reported and proc.popen.poll() is not None:
                    reported.add(proc.name)
                    print(f"pdserve up: {proc.exit_report()}", file=sys.stderr, flush=True)
    return 0


def _write_tls(directory: str, worker_names: list[str]):
    """A throwaway CA and certificates in ``directory`` (:func:`common.security.certs.write_service_certs`):
    returns each service's ``--tls-*`` flags by name, and the files of ``client`` (for up's own probes)."""
    from common.security.certs import write_service_certs

    files = write_service_certs(directory, ["router", *worker_names, "client"])
    flags = {name: ["--tls-cert-file", f.cert_file, "--tls-key-file", f.key_file, "--tls-ca-file", f.ca_file]
             for name, f in files.items() if name != "client"}  # fmt: skip
    print(f"pdserve up: mutual TLS between services, throwaway certificates in {directory}", file=sys.stderr)
    return flags, files["client"]


def _wait_router_sees_workers(redis_url: str, count: int, deadline: float, sup) -> bool:
    """Every worker registers before it reports SERVING; the router re-reads the registry every
    ``ROUTER_REFRESH_S``. Wait until the registry lists them all, then one refresh more, so that the first
    requests after the ready line can reach every worker. False at the deadline, or at once when a process of
    ``sup`` exited (a worker that could not start: its health probe may have reached another's port)."""
    from common.state.redis_client import connect
    from common.state.registry import WorkerRegistry

    registry = WorkerRegistry(connect(redis_url))
    while len(registry.list_workers()) < count:
        if time.monotonic() > deadline or sup.first_exited() is not None:
            return False
        time.sleep(0.1)
    time.sleep(2 * ROUTER_REFRESH_S)
    return True


def _tiny_model() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        from common.models.tiny import build_tiny

        print(f"pdserve up: building the tiny model in {DEFAULT_MODEL_DIR}", file=sys.stderr)
        build_tiny("llama", DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR
