"""The flags each ``pdserve`` subcommand accepts, read from its ``--help`` (the installed CLI, run as a process), and
a checker of an argument list against them: what the deployment tests use for container commands and args."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from dataclasses import dataclass

from pdserve.commands.up import flag_value  # noqa: F401  (the deployment tests' one flag reader, as up's)

# In the usage section: "[--port PORT]" and "--arch {llama,qwen2}" take a value, "[--prefix-caching |
# --no-prefix-caching]" does not.
_USAGE_FLAG = re.compile(r"(--[a-z0-9][a-z0-9-]*)(?: ([A-Z][A-Z0-9_]*|\{[^}]*\}))?")
HELP_TIMEOUT_S = 30


@dataclass(frozen=True)
class Flags:
    """``takes_value[flag]``: whether ``--flag`` needs a value (``--flag V`` or ``--flag=V``)."""

    command: tuple[str, ...]
    takes_value: dict[str, bool]


@functools.cache
def flags_of(*command: str) -> Flags:
    """The flags of ``pdserve COMMAND... --help``: ``flags_of("prefill")``, ``flags_of("model", "build-tiny")``."""
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", *command, "--help"],
        capture_output=True, text=True, timeout=HELP_TIMEOUT_S, check=True,
    ).stdout
    # the usage block ends at the first blank line; argparse wraps it anywhere, "--out" and "OUT" on two lines too
    usage = " ".join(out.split("\n\n", 1)[0].split())
    takes_value = {m[1]: bool(m[2]) for m in _USAGE_FLAG.finditer(usage)}
    if not takes_value:
        raise ValueError(f"no flags found in the usage of pdserve {' '.join(command)}:\n{usage}")
    return Flags(command, takes_value)


def subcommand_of(argv: list[str]) -> tuple[str, ...]:
    """The subcommand path at the head of ``argv``: ``("prefill",)`` or ``("model", "build-tiny")``."""
    if not argv:
        raise ValueError("empty pdserve argument list")
    return tuple(argv[:2]) if argv[0] == "model" else (argv[0],)


def bad_args(argv: list[str]) -> list[str]:
    """What is wrong with ``pdserve ARGV`` as far as ``--help`` tells: unknown flags, flags missing their value,
    stray positional words. Empty when every flag is one the subcommand accepts."""
    command = subcommand_of(argv)
    flags = flags_of(*command).takes_value
    problems = []
    rest = argv[len(command):]
    i = 0
    while i < len(rest):
        arg = rest[i]
        name, eq, _ = arg.partition("=")
        if not name.startswith("--"):
            problems.append(f"pdserve {' '.join(command)}: unexpected positional argument {arg!r}")
        elif name not in flags:
            problems.append(f"pdserve {' '.join(command)}: unknown flag {name!r}")
        elif flags[name] and not eq:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                problems.append(f"pdserve {' '.join(command)}: {name} needs a value")
            i += 1
        elif not flags[name] and eq:
            problems.append(f"pdserve {' '.join(command)}: {name} takes no value, got {arg!r}")
        i += 1
    return problems
