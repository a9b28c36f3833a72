"""The Dockerfile, parsed with the official BuildKit parser (the ``dockerfile`` package): both targets exist, every
COPY source is in the repository and passes .dockerignore, the runtime targets run as a non-root user with the
``pdserve`` entry point, a health check and the model volume, base images are pinned, nothing secret is baked in.
No Docker engine runs here, so the image itself is not built (see docs/operations.md, "Containers")."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy.cli_flags import flags_of

dockerfile = pytest.importorskip("dockerfile", reason="the `dockerfile` package (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
HEALTHCHECK_SCRIPT = ROOT / "deploy" / "docker" / "healthcheck.py"
TARGETS = ("cpu", "cuda")
DEFAULT_TARGET = "cpu"  # the last stage: what a plain `docker build .` produces
NON_ROOT_UID = 10001
SECRET_NAME = re.compile(r"(?i)(^|_)(password|passwd|secret|token|api_?keys?|private_key|credentials?)(_|$)")
SECRET_FILE = re.compile(r"(?i)(\.pem|\.key|\.crt|\.p12|id_rsa|\.env|keys?\.txt)$")


@dataclass
class Stage:
    name: str
    base: str  # as written: an image reference, ${ARG} or an earlier stage's name
    commands: list = field(default_factory=list)

    def all(self, cmd: str) -> list:
        return [c for c in self.commands if c.cmd == cmd]

    def last(self, cmd: str):
        found = self.all(cmd)
        return found[-1] if found else None


@pytest.fixture(scope="module")
def parsed():
    return dockerfile.parse_file(str(DOCKERFILE))


@pytest.fixture(scope="module")
def global_args(parsed) -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults."""
    out = {}
    for c in parsed:
        if c.cmd == "FROM":
            break
        if c.cmd == "ARG":
            name, _, default = c.value[0].partition("=")
            out[name] = default
    return out


@pytest.fixture(scope="module")
def stages(parsed) -> dict[str, Stage]:
    out: dict[str, Stage] = {}
    current = None
    for c in parsed:
        if c.cmd == "FROM":
            assert len(c.value) == 3 and c.value[1].upper() == "AS", f"line {c.start_line}: unnamed stage"
            current = Stage(name=c.value[2], base=c.value[0])
            assert current.name not in out, f"stage {current.name!r} defined twice"
            out[current.name] = current
        elif current is not None:
            current.commands.append(c)
    return out


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], text)


def base_chain(stages: dict[str, Stage], name: str) -> list[str]:
    """Stage names from ``name`` down to the one built on an external image."""
    chain = [name]
    while stages[chain[-1]].base in stages:
        chain.append(stages[chain[-1]].base)
    return chain


# -- .dockerignore, with Docker's semantics (moby/patternmatcher) -------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """(negated, regex) per pattern: ``**`` spans directories, ``*`` and ``?`` stay within one."""
    out = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        out.append((negated, re.compile(regex + r"\Z")))
    return out


def is_ignored(path: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether ``path`` (relative to the context) is left out: the last pattern that matches it or one of its
    parent directories decides."""
    parts = Path(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negated, regex in patterns:
        if any(regex.match(c) for c in candidates):
            ignored = not negated
    return ignored


def context_files(source: Path) -> list[Path]:
    """The files under a COPY source that matter: caches and build leftovers left out."""
    if source.is_file():
        return [source]
    return [p for p in source.rglob("*") if p.is_file()
            and not any(part == "__pycache__" or part.endswith(".egg-info") for part in p.parts)
            and p.suffix != ".pyc"]


# -- the tests -----------------------------------------------------------------------------------------------


def test_both_targets_exist_and_cpu_is_the_default(stages):
    assert set(TARGETS) <= set(stages), f"stages: {sorted(stages)}"
    assert list(stages)[-1] == DEFAULT_TARGET


def test_every_stage_is_built_on_a_pinned_image_or_an_earlier_stage(stages, global_args):
    names = list(stages)
    for i, stage in enumerate(stages.values()):
        if stage.base in stages:
            assert names.index(stage.base) < i, f"stage {stage.name}: base stage {stage.base} comes later"
            continue
        image = expand(stage.base, global_args)
        assert "@sha256:" in image or re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*", image), (
            f"stage {stage.name}: base {image!r} is not pinned to a versioned tag"
        )
    cuda_base = expand(stages[base_chain(stages, "cuda")[-1]].base, global_args)
    assert cuda_base.startswith("nvidia/cuda:") and "-runtime-" in cuda_base, cuda_base


def test_copy_sources_exist_in_the_repository_and_pass_dockerignore(parsed, stages):
    patterns = dockerignore_patterns()
    checked = 0
    for c in parsed:
        if c.cmd not in ("COPY", "ADD"):
            continue
        from_stage = next((f.split("=", 1)[1] for f in c.flags if f.startswith("--from=")), None)
        if from_stage is not None:
            assert from_stage in stages and list(stages).index(from_stage) < _stage_index(stages, c), (
                f"line {c.start_line}: --from={from_stage} is not an earlier stage"
            )
            continue
        assert c.cmd == "COPY", f"line {c.start_line}: use COPY, not ADD ({c.original!r})"
        for src in c.value[:-1]:
            source = ROOT / src
            assert source.exists(), f"line {c.start_line}: COPY source {src!r} is not in the repository"
            assert not SECRET_FILE.search(src), f"line {c.start_line}: {src!r} looks like a secret"
            files = context_files(source)
            assert files, f"line {c.start_line}: {src!r} holds no files"
            for f in files:
                rel = f.relative_to(ROOT).as_posix()
                assert not is_ignored(rel, patterns), f"line {c.start_line}: {rel} is excluded by .dockerignore"
                checked += 1
    assert checked > 50  # pyproject, README, the healthcheck and the three packages' modules


def _stage_index(stages: dict[str, Stage], command) -> int:
    for i, stage in enumerate(stages.values()):
        if any(c is command for c in stage.commands):
            return i
    raise AssertionError(f"line {command.start_line} is in no stage")


def test_dockerignore_keeps_local_state_and_secrets_out_of_the_context():
    patterns = dockerignore_patterns()
    for path in (".venv/bin/python", "build/tiny-llama/model.safetensors", ".git/HEAD", ".pytest_cache/v/x",
                 "common/__pycache__/x.cpython-311.pyc", "pdserve.egg-info/PKG-INFO", "tests/deploy/test_x.py",
                 "api-keys.txt", "tls/server.key", ".env"):
        assert is_ignored(path, patterns), f"{path} would be sent to the builder"
    for path in ("pyproject.toml", "common/config/loader.py", "deploy/docker/healthcheck.py"):
        assert not is_ignored(path, patterns), path


@pytest.mark.parametrize("target", TARGETS)
def test_runtime_target_runs_pdserve_as_non_root_with_health_check_and_model_volume(stages, target):
    stage = stages[target]
    user = stage.last("USER")
    assert user is not None, f"{target}: no USER"
    uid, _, gid = user.value[0].partition(":")
    assert uid.isdigit() and int(uid) == NON_ROOT_UID and (not gid or int(gid) != 0), user.original
    assert stage.commands.index(user) > max((stage.commands.index(c) for c in stage.all("RUN")), default=-1), (
        f"{target}: a RUN after USER runs as that user; keep USER after all set-up"
    )
    entrypoint = stage.last("ENTRYPOINT")
    assert entrypoint is not None and entrypoint.json and list(entrypoint.value) == ["pdserve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pdserve"] == "pdserve.cli:main"
    cmd = stage.last("CMD")
    assert cmd.json and cmd.value[0] in ("router", "prefill", "decode")
    healthcheck = stage.last("HEALTHCHECK")
    assert healthcheck is not None and healthcheck.json and healthcheck.value[:2] == ("CMD", "pdserve-healthcheck")
    copied = [c for c in stage.all("COPY") if c.value[-1] == "/usr/local/bin/pdserve-healthcheck"]
    assert copied and "--chmod=0755" in copied[0].flags
    assert "/models" in stage.last("VOLUME").value
    env = _env(stage)
    assert env["PDSERVE_MODEL"].startswith("/models/")
    assert env["PDSERVE_HOST"] == "0.0.0.0"  # reachable from outside the container
    assert "/opt/venv/bin" in env["PATH"].split(":")
    assert stage.all("COPY")[0].flags == (f"--from={target}-venv",)


def _env(stage: Stage) -> dict[str, str]:
    out = {}
    for c in stage.all("ENV"):
        out.update(zip(c.value[::2], c.value[1::2]))
    return out


def test_runtime_targets_are_configured_alike(stages):
    """The two runtime blocks differ only in where their venv comes from (FROM and the first COPY)."""
    cpu, cuda = ([c.original for c in stages[t].commands[1:]] for t in TARGETS)
    assert cpu == cuda


@pytest.mark.parametrize("target", TARGETS)
def test_images_carry_prebuilt_cpu_kernels_where_the_runtime_looks(stages, target):
    """The venv stage compiles the CPU kernels' variants (a compiler there, none at run time) into the venv, and
    the runtime points PDSERVE_CPU_KERNELS_DIR at that folder, which the venv copy brings along."""
    folder = _env(stages[target])["PDSERVE_CPU_KERNELS_DIR"]
    assert folder.startswith("/opt/venv/")
    runs = [" ".join(c.value) for c in stages[f"{target}-venv"].all("RUN")]
    prebuild = [r for r in runs if "-m common.engine.cpu_kernels --prebuild" in r]
    assert prebuild and prebuild[0].split("--prebuild", 1)[1].split()[0] == folder
    assert "g++" in prebuild[0] and prebuild[0].index("g++") < prebuild[0].index("--prebuild")
    assert any(c.value[-1] == "/opt/venv" and f"--from={target}-venv" in c.flags for c in stages[target].all("COPY"))


def test_torch_comes_from_the_right_index_and_satisfies_pyproject(stages, global_args):
    from packaging.specifiers import SpecifierSet

    torch_pin = global_args["TORCH_VERSION"]
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = SpecifierSet(next(d for d in deps if d.startswith("torch")).removeprefix("torch"))
    assert torch_pin in spec, f"TORCH_VERSION {torch_pin} outside pyproject's torch{spec}"
    index = {"cpu": "https://download.pytorch.org/whl/cpu", "cuda": "https://download.pytorch.org/whl/cu128"}
    for target in TARGETS:
        runs = " ".join(" ".join(c.value) for name in base_chain(stages, f"{target}-venv")
                        for c in stages[name].all("RUN"))
        assert '"torch==${TORCH_VERSION}"' in runs and f"--index-url {index[target]}" in runs, target


def test_nothing_secret_is_baked_in(parsed):
    for c in parsed:
        if c.cmd in ("ENV", "ARG", "LABEL"):
            names = c.value[::2] if c.cmd == "ENV" else [v.split("=", 1)[0] for v in c.value]
            for name in names:
                assert not SECRET_NAME.search(name), f"line {c.start_line}: {c.cmd} {name} looks like a secret"


# -- the health check script -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthcheck():
    spec = importlib.util.spec_from_file_location("pdserve_healthcheck", HEALTHCHECK_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_finds_the_role_and_port_from_the_command_line(healthcheck):
    venv = ["/opt/venv/bin/python", "/opt/venv/bin/pdserve"]
    assert healthcheck.role_and_port([*venv, "router"], {}) == ("router", 8000)
    assert healthcheck.role_and_port([*venv, "router", "--http-port", "8080"], {}) == ("router", 8080)
    assert healthcheck.role_and_port([*venv, "prefill", "--metrics-port=9200"], {}) == ("prefill", 9200)
    assert healthcheck.role_and_port([*venv, "decode"], {"PDSERVE_METRICS_PORT": "9300"}) == ("decode", 9300)
    assert healthcheck.role_and_port([*venv, "decode", "--metrics-port", "9400"],
                                     {"PDSERVE_METRICS_PORT": "9300"}) == ("decode", 9400)
    assert healthcheck.role_and_port([*venv, "model", "build-tiny"], {}) == (None, None)


def test_healthcheck_port_flags_and_defaults_match_the_cli_and_the_image(healthcheck, stages):
    for role, flag in healthcheck.PORT_FLAG.items():
        assert flag in flags_of(role).takes_value, f"pdserve {role} has no {flag}"
    env = _env(stages[DEFAULT_TARGET])
    assert healthcheck.DEFAULT_PORT["prefill"] == int(env["PDSERVE_METRICS_PORT"])
    assert healthcheck.DEFAULT_PORT["router"] == 8000  # pdserve router's --http-port default
    assert fnmatch.fnmatch(HEALTHCHECK_SCRIPT.read_text().splitlines()[0], "#!*python3")
