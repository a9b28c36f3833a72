"""The ``pdserve`` command: one argparse tree, one module per subcommand.

Each module in ``pdserve.commands`` exposes ``add_parser(subparsers)``, which registers its subcommand and
sets ``func`` on the parser's defaults to a callable ``func(args) -> int`` (the exit status). Subcommand
modules import heavy dependencies (torch, transformers) inside ``func`` only, so ``pdserve --help`` and
client-side commands start fast.

Exit status: 0 done, 2 a user error (one line on stderr, no traceback), 130 Ctrl-C, ``EXIT_PORT_TAKEN`` (75,
EX_TEMPFAIL) when a port the command was to listen on is taken (EADDRINUSE, one line on stderr: another port, or
the same later, may work; ``pdserve up`` starts such a service again on new ports), 1 anything else.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

from pdserve import __version__
from pdserve.commands import bench as bench_cmd
from pdserve.commands import generate as generate_cmd
from pdserve.commands import model as model_cmd
from pdserve.commands import run as run_cmd
from pdserve.commands import serve as serve_cmd
from pdserve.commands import status as status_cmd
from pdserve.commands import trace as trace_cmd
from pdserve.commands import up as up_cmd

_SERVICES = ("router", "prefill", "decode")
EXIT_PORT_TAKEN = 75  # os.EX_TEMPFAIL: a port to listen on was taken
_COMMANDS = (up_cmd, serve_cmd, generate_cmd, status_cmd, trace_cmd, run_cmd, model_cmd, bench_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level for stderr (default INFO)")
    parser.add_argument(
        "--log-format", choices=("auto", "json", "text"), default=os.environ.get("PDSERVE_LOG_FORMAT", "auto"),
        help="stderr log lines: json (one object per line, with request and trace ids) or text; auto (default): "
             "json for the services (router, prefill, decode), text for the rest ($PDSERVE_LOG_FORMAT)",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmt = args.log_format if args.log_format != "auto" else ("json" if args.command in _SERVICES else "text")
    if fmt == "json" or args.command in _SERVICES:
        from common.obs.logs import setup_logging  # imports OpenTelemetry: only where it is used

        setup_logging(args.log_level, fmt, service=args.command)
    else:
        logging.basicConfig(
            level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:  # user errors: one clear line, no traceback
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"pdserve {args.command}: error: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_PORT_TAKEN


if __name__ == "__main__":
    sys.exit(main())
