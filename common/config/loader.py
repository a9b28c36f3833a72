"""Filling a service's config dataclass from flags, environment variables, a YAML file and defaults.

Each service declares its settings once, as a dataclass whose fields carry their help text::

    @dataclass
    class DecodeConfig:
        model: str = field(default="", metadata={"help": "model directory"})
        port: int = field(default=0, metadata={"help": "gRPC port (0 = pick a free one)"})
        kv_cache_memory: float | None = field(default=None, metadata={"help": "KV cache size, GiB"})

and its entry point does::

    add_config_args(parser, DecodeConfig)          # --model, --port, --kv-cache-memory, --config FILE
    resolved = resolve_config(DecodeConfig, parser.parse_args())
    logger.info("config:\\n%s", resolved.describe())
    config = resolved.config

Each field's value comes from the first of these that sets it (precedence flag > environment > file >
default):

1. the flag ``--field-name`` (underscores become dashes);
2. the environment variable ``PDSERVE_FIELD_NAME`` (what the Helm chart sets);
3. the key ``field_name`` (or ``field-name``) of the YAML mapping in ``--config FILE`` (or the file named
   by ``PDSERVE_CONFIG`` when no ``--config`` is given);
4. the dataclass default (a field without one is required: not set anywhere is an error).

Supported field types: ``int``, ``float``, ``str``, ``bool``, ``list[int|float|str]``, and any of them
``| None``. Flags: a bool field is ``--flag/--no-flag``; a list field is a repeatable flag; no flag can
set ``None``. Environment values are text: bools are ``1/0/true/false/yes/no/on/off``; lists are
comma-separated; an empty value means ``None`` for an optional non-string field. File values must have
the field's type already (an ``int`` is accepted for a ``float``; quote a string that YAML would read as
a number). Field metadata ``choices`` (allowed values, checked for every source) and ``secret``
(``describe`` shows ``***``; it always hides URL passwords) are honoured.

Errors are ``ValueError`` naming the bad flag, variable or key and its value (a missing file is
``FileNotFoundError`` naming the path): the CLI prints them as one line. An unknown key in the file is an
error, since a misspelled key would otherwise be silently ignored. Unknown ``PDSERVE_*`` variables are
not errors: services share an environment and each reads only its own fields.

Nothing here blocks except reading the file; nothing is global.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import urlsplit

import yaml

T = TypeVar("T")
Source = Literal["flag", "env", "file", "default"]

DEFAULT_ENV_PREFIX = "PDSERVE_"
CONFIG_DEST = "config"  # the argparse dest of --config, so no field may be named this
_SCALARS = (int, float, str, bool)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class _Kind:
    """A field's type, reduced to what parsing needs."""

    base: type  # int, float, str, bool or list
    item: type | None  # the element type of a list, else None
    optional: bool  # the annotation was ``X | None``

    def describe(self) -> str:
        name = f"list[{self.item.__name__}]" if self.base is list else self.base.__name__
        return f"{name} | None" if self.optional else name


@dataclass(frozen=True)
class ResolvedConfig(Generic[T]):
    """A loaded config and where each of its values came from (for the start-up log)."""

    config: T
    sources: dict[str, Source]  # field name -> where its value came from
    config_path: str | None  # the YAML file that was read, if any

    def describe(self) -> str:
        """One line per field, ``name = value  (source)``, safe to log: values of ``secret`` fields are
        shown as ``***``, and so is the password of any URL (``redis://:***@host:6379/0``)."""
        lines = []
        for f in dataclasses.fields(self.config):
            value = "***" if f.metadata.get("secret") else repr(_redact_url_password(getattr(self.config, f.name)))
            where = self.sources[f.name]
            if where == "file":
                where = f"file {self.config_path}"
            lines.append(f"{f.name} = {value}  ({where})")
        return "\n".join(lines)


def _redact_url_password(value: Any) -> Any:
    if not isinstance(value, str) or "://" not in value:
        return value
    try:
        parts = urlsplit(value)
        if parts.password is None:
            return value
    except ValueError:  # not a URL after all (e.g. a bad port): shown as is
        return value
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()


def env_var_name(field_name: str, env_prefix: str = DEFAULT_ENV_PREFIX) -> str:
    """The environment variable that sets ``field_name``: ``PDSERVE_KV_CACHE_MEMORY`` for ``kv_cache_memory``."""
    return f"{env_prefix}{field_name.upper()}"


def flag_name(field_name: str) -> str:
    """The flag that sets ``field_name``: ``--kv-cache-memory`` for ``kv_cache_memory``."""
    return "--" + field_name.replace("_", "-")


def add_config_args(
    parser: argparse.ArgumentParser,
    schema: type,
    *,
    exclude: Collection[str] = (),
    env_prefix: str = DEFAULT_ENV_PREFIX,
) -> None:
    """Add one flag per field of the dataclass ``schema`` (except those named in ``exclude``) and ``--config``.

    Every flag defaults to ``None``, so :func:`load_config` can tell "not given" from any value. Raises
    TypeError for a field type it cannot parse and ValueError for an ``exclude`` name that is no field.
    """
    kinds = _field_kinds(schema)
    unknown = sorted(set(exclude) - set(kinds))
    if unknown:
        raise ValueError(f"exclude names no field of {schema.__name__}: {unknown} (fields: {sorted(kinds)})")
    group = parser.add_argument_group(f"settings (flag > env {env_prefix}* > --config file > default)")
    for f in dataclasses.fields(schema):
        if f.name in exclude:
            continue
        kind = kinds[f.name]
        help_text = _help(f, env_prefix)
        choices = f.metadata.get("choices")
        if kind.base is bool:
            group.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif kind.base is list:
            group.add_argument(
                flag_name(f.name),
                dest=f.name,
                action="append",
                type=kind.item,
                default=None,
                choices=choices,
                metavar=f.name.upper(),
                help=help_text + " (repeatable)",
            )
        else:
            group.add_argument(
                flag_name(f.name),
                dest=f.name,
                type=kind.base,
                default=None,
                choices=choices,
                metavar=f.name.upper(),
                help=help_text,
            )
    group.add_argument(
        "--" + CONFIG_DEST,
        dest=CONFIG_DEST,
        metavar="FILE",
        default=None,
        help=f"YAML mapping of settings (keys as the flags without '--'; unknown keys are errors); "
        f"default: ${env_prefix}CONFIG if set",
    )


def load_config(
    schema: type[T],
    args: argparse.Namespace | None,
    *,
    env: Mapping[str, str] = os.environ,
    env_prefix: str = DEFAULT_ENV_PREFIX,
) -> T:
    """The ``schema`` instance for these flags, environment and file: :func:`resolve_config`'s ``config``."""
    return resolve_config(schema, args, env=env, env_prefix=env_prefix).config


def resolve_config(
    schema: type[T],
    args: argparse.Namespace | None,
    *,
    env: Mapping[str, str] = os.environ,
    env_prefix: str = DEFAULT_ENV_PREFIX,
) -> ResolvedConfig[T]:
    """Fill ``schema`` field by field: flag (an attribute of ``args`` that is not None), else the variable
    ``{env_prefix}{FIELD}`` in ``env``, else the key in the YAML file (``args.config``, else
    ``env[{env_prefix}CONFIG]``), else the field's default.

    ``args`` may be None or lack attributes (fields excluded from the flags). The dataclass's own
    ``__post_init__`` validation runs as usual. Raises ValueError (bad value, unknown key, required field
    unset) or FileNotFoundError (the config file), each naming what is wrong.
    """
    kinds = _field_kinds(schema)
    config_path = getattr(args, CONFIG_DEST, None) or env.get(env_prefix + "CONFIG") or None
    file_values = _read_file(config_path, kinds) if config_path else {}

    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for f in dataclasses.fields(schema):
        kind = kinds[f.name]
        var = env_var_name(f.name, env_prefix)
        flag_value = getattr(args, f.name, None) if args is not None else None
        if flag_value is not None:
            value, source, origin = flag_value, "flag", flag_name(f.name)
        elif var in env:
            value, source, origin = _from_env(kind, var, env[var]), "env", f"environment variable {var}"
        elif f.name in file_values:
            key, raw = file_values[f.name]
            origin = f"key {key!r} in {config_path}"
            value, source = _from_file(kind, origin, raw), "file"
        elif f.default is not dataclasses.MISSING:
            value, source, origin = f.default, "default", "default"
        elif f.default_factory is not dataclasses.MISSING:
            value, source, origin = f.default_factory(), "default", "default"
        else:
            raise ValueError(
                f"setting {f.name!r} is required: give {flag_name(f.name)}, {var}, or key {f.name!r} in --config"
            )
        _check_choices(f, origin, value)
        values[f.name] = value
        sources[f.name] = source
    return ResolvedConfig(config=schema(**values), sources=sources, config_path=config_path)


def _field_kinds(schema: type) -> dict[str, _Kind]:
    if not dataclasses.is_dataclass(schema) or not isinstance(schema, type):
        raise TypeError(f"config schema must be a dataclass type, got {schema!r}")
    hints = typing.get_type_hints(schema)
    kinds = {}
    for f in dataclasses.fields(schema):
        if f.name == CONFIG_DEST:
            raise ValueError(f"{schema.__name__} may not have a field named {CONFIG_DEST!r}: --config names the file")
        kinds[f.name] = _kind(f"{schema.__name__}.{f.name}", hints[f.name])
    return kinds


def _kind(where: str, annotation: Any) -> _Kind:
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"config field {where}: unsupported union {annotation!r} (only X | None)")
        optional, annotation = True, rest[0]
    if annotation in _SCALARS:
        return _Kind(annotation, None, optional)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (None,)
        if item in (int, float, str):
            return _Kind(list, item, optional)
    raise TypeError(
        f"config field {where}: unsupported type {annotation!r} "
        "(supported: int, float, str, bool, list[int|float|str], and X | None of those)"
    )


def _help(f: dataclasses.Field, env_prefix: str) -> str:
    if f.default is not dataclasses.MISSING:
        default = f"default {f.default!r}"
    elif f.default_factory is not dataclasses.MISSING:
        default = f"default {f.default_factory()!r}"
    else:
        default = "required"
    text = f"{f.metadata.get('help', '')} ({default}; env {env_var_name(f.name, env_prefix)})".strip()
    return text.replace("%", "%%")  # argparse formats help with %


def _parse_scalar(base: type, text: str) -> Any:
    """``text`` as ``base``; ValueError (message not yet naming the source) if it is not one."""
    if base is str:
        return text
    if base is bool:
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError("expected a bool (1/0, true/false, yes/no, on/off)")
    try:
        return base(text.strip())
    except ValueError:
        raise ValueError(f"expected {'an int' if base is int else 'a float'}") from None


def _from_env(kind: _Kind, var: str, raw: str) -> Any:
    if kind.optional and kind.base is not str and raw.strip() == "":
        return None
    try:
        if kind.base is list:
            return [_parse_scalar(kind.item, part.strip()) for part in raw.split(",") if part.strip()]
        return _parse_scalar(kind.base, raw)
    except ValueError as e:
        raise ValueError(f"environment variable {var}={raw!r}: {e}, for a setting of type {kind.describe()}") from None


def _matches(base: type, value: Any) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, base)


def _from_file(kind: _Kind, origin: str, value: Any) -> Any:
    if value is None and kind.optional:
        return None
    ok = (
        isinstance(value, list) and all(_matches(kind.item, v) for v in value)
        if kind.base is list
        else _matches(kind.base, value)
    )
    if not ok:
        shown = "null" if value is None else f"{value!r} ({type(value).__name__})"
        raise ValueError(f"{origin}: expected {kind.describe()}, got {shown}")
    if kind.base is float:
        return float(value)
    if kind.base is list and kind.item is float:
        return [float(v) for v in value]
    return value


def _check_choices(f: dataclasses.Field, origin: str, value: Any) -> None:
    choices = f.metadata.get("choices")
    if choices is None or value is None:
        return
    for v in value if isinstance(value, list) else [value]:
        if v not in choices:
            raise ValueError(f"{origin}: {v!r} is not one of {list(choices)}")


def _read_file(path: str, kinds: Mapping[str, _Kind]) -> dict[str, tuple[str, Any]]:
    """The file's settings as ``{field name: (key as written, value)}``; errors name the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read config file {path}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        raise ValueError(f"config file {path} is not valid YAML: {problem}{where}") from None
    if data is None:  # an empty file sets nothing
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {path} must hold a mapping of setting names to values, got a {type(data).__name__}"
        )
    known = sorted(kinds)
    out: dict[str, tuple[str, Any]] = {}
    for key, value in data.items():
        name = key.replace("-", "_") if isinstance(key, str) else None
        if name not in kinds:
            hint = difflib.get_close_matches(name, known, n=1) if name else []
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(f"unknown key {key!r} in {path} (known: {', '.join(known)}){suggestion}")
        if name in out:
            raise ValueError(f"key {key!r} in {path} sets {name!r}, which {out[name][0]!r} already sets")
        out[name] = (key, value)
    return out
