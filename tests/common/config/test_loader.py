"""Config precedence (flag > env > file > default), typing of each source, and the errors operators see."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, field

import pytest

from common.config.loader import add_config_args, load_config, resolve_config


@dataclass
class Small:
    model: str = field(default="default-model", metadata={"help": "model directory"})
    port: int = field(default=1, metadata={"help": "gRPC port"})
    kv_cache_memory: float | None = field(default=None, metadata={"help": "KV cache size, GiB (100% = all)"})


@dataclass
class Kinds:
    enable_prefix_caching: bool = False
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    scales: list[float] | None = None
    dtype: str = field(default="float32", metadata={"choices": ("float32", "bfloat16")})
    redis_url: str = field(default="redis://x", metadata={"secret": True})


@dataclass
class Required:
    model: str


def parse(schema, argv, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser, schema, **kw)
    return parser.parse_args(argv)


def write(tmp_path, text: str, name: str = "cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# (flag argv, env var, file line) per field of Small, each with a value unique to its source
SOURCES = {
    "model": (["--model", "flag-m"], ("PDSERVE_MODEL", "env-m"), "model: file-m", "default-model"),
    "port": (["--port", "11"], ("PDSERVE_PORT", "22"), "port: 33", 1),
    "kv_cache_memory": (["--kv-cache-memory", "0.5"], ("PDSERVE_KV_CACHE_MEMORY", "1.5"), "kv-cache-memory: 2.5", None),
}
VALUES = {
    "model": {"flag": "flag-m", "env": "env-m", "file": "file-m"},
    "port": {"flag": 11, "env": 22, "file": 33},
    "kv_cache_memory": {"flag": 0.5, "env": 1.5, "file": 2.5},
}


def _combo_id(given: tuple[bool, bool, bool]) -> str:
    return "+".join(name for name, on in zip(("flag", "env", "file"), given) if on) or "none"


@pytest.mark.parametrize("given", list(itertools.product([False, True], repeat=3)), ids=_combo_id)
def test_precedence_in_every_combination(tmp_path, given):
    use_flag, use_env, use_file = given
    argv, env, lines = [], {}, []
    for flag_argv, (var, value), file_line, _ in SOURCES.values():
        if use_flag:
            argv += flag_argv
        if use_env:
            env[var] = value
        if use_file:
            lines.append(file_line)
    if use_file:
        argv += ["--config", str(write(tmp_path, "\n".join(lines)))]
    resolved = resolve_config(Small, parse(Small, argv), env=env)
    expected_source = "flag" if use_flag else "env" if use_env else "file" if use_file else "default"
    for name, (*_, default) in SOURCES.items():
        want = default if expected_source == "default" else VALUES[name][expected_source]
        assert getattr(resolved.config, name) == want
        assert resolved.sources[name] == expected_source


def test_each_field_takes_its_own_highest_source(tmp_path):
    cfg = write(tmp_path, "model: file-m\nport: 33\n")
    args = parse(Small, ["--config", str(cfg), "--kv-cache-memory", "0.25"])
    resolved = resolve_config(Small, args, env={"PDSERVE_PORT": "22", "PDSERVE_KV_CACHE_MEMORY": "9"})
    assert resolved.config == Small(model="file-m", port=22, kv_cache_memory=0.25)
    assert resolved.sources == {"model": "file", "port": "env", "kv_cache_memory": "flag"}
    assert resolved.describe() == (f"model = 'file-m'  (file {cfg})\nport = 22  (env)\nkv_cache_memory = 0.25  (flag)")


def test_config_path_from_env_and_flag_wins(tmp_path):
    from_env = write(tmp_path, "port: 5", "env.yaml")
    from_flag = write(tmp_path, "port: 6", "flag.yaml")
    env = {"PDSERVE_CONFIG": str(from_env)}
    assert load_config(Small, parse(Small, []), env=env).port == 5
    assert load_config(Small, parse(Small, ["--config", str(from_flag)]), env=env).port == 6


def test_custom_env_prefix_and_no_args():
    assert load_config(Small, None, env={"DECODE_PORT": "7", "PDSERVE_PORT": "8"}, env_prefix="DECODE_").port == 7


def test_bool_flags():
    assert load_config(Kinds, parse(Kinds, ["--enable-prefix-caching"]), env={}).enable_prefix_caching is True
    env = {"PDSERVE_ENABLE_PREFIX_CACHING": "yes"}
    resolved = resolve_config(Kinds, parse(Kinds, ["--no-enable-prefix-caching"]), env=env)
    assert resolved.config.enable_prefix_caching is False and resolved.sources["enable_prefix_caching"] == "flag"
    for text, want in [("1", True), ("TRUE", True), ("on", True), ("0", False), ("No", False), ("off", False)]:
        assert (
            load_config(Kinds, parse(Kinds, []), env={"PDSERVE_ENABLE_PREFIX_CACHING": text}).enable_prefix_caching
            is want
        )


def test_optional_floats_and_ints():
    args = parse(Small, [])
    assert load_config(Small, args, env={}).kv_cache_memory is None
    assert load_config(Small, args, env={"PDSERVE_KV_CACHE_MEMORY": "0.75"}).kv_cache_memory == 0.75
    assert load_config(Small, args, env={"PDSERVE_KV_CACHE_MEMORY": ""}).kv_cache_memory is None
    assert load_config(Kinds, parse(Kinds, ["--max-tokens", "16"]), env={}).max_tokens == 16


def test_optional_null_in_file_and_int_for_float(tmp_path):
    cfg = write(tmp_path, "kv_cache_memory: 2\n")
    value = load_config(Small, parse(Small, ["--config", str(cfg)]), env={}).kv_cache_memory
    assert value == 2.0 and type(value) is float
    cfg = write(tmp_path, "kv_cache_memory: null\n", "null.yaml")
    resolved = resolve_config(Small, parse(Small, ["--config", str(cfg)]), env={"X": "1"})
    assert resolved.config.kv_cache_memory is None and resolved.sources["kv_cache_memory"] == "file"


def test_lists_from_flags_env_and_file(tmp_path):
    assert load_config(Kinds, parse(Kinds, ["--stop", "a", "--stop", "b c"]), env={}).stop == ["a", "b c"]
    assert load_config(Kinds, parse(Kinds, []), env={"PDSERVE_STOP": "x, y,,z"}).stop == ["x", "y", "z"]
    assert load_config(Kinds, parse(Kinds, []), env={"PDSERVE_SCALES": "1,2.5"}).scales == [1.0, 2.5]
    cfg = write(tmp_path, "stop: [u, v]\nscales: [1, 0.5]\n")
    got = load_config(Kinds, parse(Kinds, ["--config", str(cfg)]), env={})
    assert (got.stop, got.scales) == (["u", "v"], [1.0, 0.5])
    assert load_config(Kinds, parse(Kinds, []), env={}).stop == []


def test_choices_checked_for_every_source(tmp_path):
    with pytest.raises(SystemExit):
        parse(Kinds, ["--dtype", "float16"])
    with pytest.raises(ValueError, match=r"environment variable PDSERVE_DTYPE: 'float16' is not one of"):
        load_config(Kinds, parse(Kinds, []), env={"PDSERVE_DTYPE": "float16"})
    cfg = write(tmp_path, "dtype: int8\n")
    with pytest.raises(ValueError, match=rf"key 'dtype' in {cfg}: 'int8' is not one of \['float32', 'bfloat16'\]"):
        load_config(Kinds, parse(Kinds, ["--config", str(cfg)]), env={})


def test_secret_values_are_not_described():
    resolved = resolve_config(Kinds, parse(Kinds, []), env={"PDSERVE_REDIS_URL": "redis://:hunter2@h:1/0"})
    assert resolved.config.redis_url == "redis://:hunter2@h:1/0"
    assert "redis_url = ***  (env)" in resolved.describe() and "hunter2" not in resolved.describe()


def test_url_passwords_are_not_described():
    @dataclass
    class WithUrl:
        redis_url: str = "redis://127.0.0.1:6379/0"
        note: str = "a://b@c is not a password"

    resolved = resolve_config(WithUrl, None, env={"PDSERVE_REDIS_URL": "redis://user:hunter2@h:1/0"})
    assert resolved.describe() == (
        "redis_url = 'redis://user:***@h:1/0'  (env)\nnote = 'a://b@c is not a password'  (default)"
    )
    assert resolved.config.redis_url == "redis://user:hunter2@h:1/0"


def test_unknown_key_names_key_and_file(tmp_path):
    cfg = write(tmp_path, "model: m\nkv_cach_memory: 0.5\n")
    with pytest.raises(ValueError) as err:
        load_config(Small, parse(Small, ["--config", str(cfg)]), env={})
    assert str(err.value) == (
        f"unknown key 'kv_cach_memory' in {cfg} (known: kv_cache_memory, model, port); did you mean 'kv_cache_memory'?"
    )


def test_same_setting_twice_in_file_is_an_error(tmp_path):
    cfg = write(tmp_path, "kv-cache-memory: 1\nkv_cache_memory: 2\n")
    with pytest.raises(ValueError, match="key 'kv_cache_memory' in .* sets 'kv_cache_memory', which 'kv-cache-memory'"):
        load_config(Small, parse(Small, ["--config", str(cfg)]), env={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port: '8000'\n", "key 'port' in {cfg}: expected int, got '8000' (str)"),
        ("port: true\n", "key 'port' in {cfg}: expected int, got True (bool)"),
        ("port: null\n", "key 'port' in {cfg}: expected int, got null"),
        ("model: 1.5\n", "key 'model' in {cfg}: expected str, got 1.5 (float)"),
        ("kv-cache-memory: lots\n", "key 'kv-cache-memory' in {cfg}: expected float | None, got 'lots' (str)"),
    ],
)
def test_wrongly_typed_file_value_names_key_and_value(tmp_path, text, message):
    cfg = write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        load_config(Small, parse(Small, ["--config", str(cfg)]), env={})
    assert str(err.value) == message.format(cfg=cfg)


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("PDSERVE_PORT", "80.5", "an int"),
        ("PDSERVE_KV_CACHE_MEMORY", "half", "a float"),
    ],
)
def test_bad_env_value_names_the_variable(var, value, expected):
    with pytest.raises(ValueError) as err:
        load_config(Small, parse(Small, []), env={var: value})
    assert str(err.value).startswith(f"environment variable {var}={value!r}: expected {expected}")


def test_bad_env_bool_names_the_variable():
    with pytest.raises(ValueError, match=r"PDSERVE_ENABLE_PREFIX_CACHING='maybe': expected a bool"):
        load_config(Kinds, parse(Kinds, []), env={"PDSERVE_ENABLE_PREFIX_CACHING": "maybe"})


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("just a string\n", "str"), ("3\n", "int")])
def test_yaml_that_is_not_a_mapping(tmp_path, text, kind):
    cfg = write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        load_config(Small, parse(Small, ["--config", str(cfg)]), env={})
    assert str(err.value) == f"config file {cfg} must hold a mapping of setting names to values, got a {kind}"


def test_empty_file_sets_nothing(tmp_path):
    cfg = write(tmp_path, "# nothing here\n")
    resolved = resolve_config(Small, parse(Small, ["--config", str(cfg)]), env={})
    assert resolved.config == Small() and set(resolved.sources.values()) == {"default"}


def test_invalid_yaml_names_file_and_line(tmp_path):
    cfg = write(tmp_path, "model: m\nport: [1, 2\n")
    with pytest.raises(ValueError, match=rf"^config file {cfg} is not valid YAML: .* at line \d+, column \d+$"):
        load_config(Small, parse(Small, ["--config", str(cfg)]), env={})


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError) as err:
        load_config(Small, parse(Small, ["--config", str(missing)]), env={})
    assert str(err.value) == f"config file not found: {missing}"


def test_required_field(tmp_path):
    with pytest.raises(ValueError, match="setting 'model' is required: give --model, PDSERVE_MODEL, or key 'model'"):
        load_config(Required, parse(Required, []), env={})
    assert load_config(Required, parse(Required, []), env={"PDSERVE_MODEL": "m"}).model == "m"


def test_flags_default_to_none_and_exclude():
    args = parse(Small, [], exclude=("port",))
    assert vars(args) == {"model": None, "kv_cache_memory": None, "config": None}
    with pytest.raises(ValueError, match=r"exclude names no field of Small: \['prot'\]"):
        parse(Small, [], exclude=("prot",))


def test_help_lists_flag_env_and_default(capsys):
    parser = argparse.ArgumentParser()
    add_config_args(parser, Small)
    parser.print_help()
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "--kv-cache-memory KV_CACHE_MEMORY KV cache size, GiB (100% = all) (default None; env PDSERVE_KV_CACHE_MEMORY)"
        in out
    )
    assert "--config FILE" in out


def test_unsupported_field_type_and_reserved_name():
    @dataclass
    class BadType:
        sizes: dict[str, int] = field(default_factory=dict)

    @dataclass
    class Reserved:
        config: str = ""

    with pytest.raises(TypeError, match=r"config field BadType.sizes: unsupported type"):
        add_config_args(argparse.ArgumentParser(), BadType)
    with pytest.raises(ValueError, match="may not have a field named 'config'"):
        add_config_args(argparse.ArgumentParser(), Reserved)


def test_dataclass_validation_still_runs():
    @dataclass
    class Validated:
        port: int = 0

        def __post_init__(self) -> None:
            if not 0 <= self.port < 65536:
                raise ValueError(f"port must be in [0, 65536), got {self.port}")

    with pytest.raises(ValueError, match="port must be in"):
        load_config(Validated, parse(Validated, ["--port", "70000"]), env={})
