"""API keys and the :class:`Authenticator` of pdserve's public fronts (the router's gRPC API and HTTP front, a
worker's admin route).

Configuration (router and workers alike; see ``RouterConfig`` / ``WorkerConfig``):

- ``--api-key-file FILE``: one key per line; blank lines and lines starting with ``#`` are skipped, whitespace
  around a key is stripped;
- ``PDSERVE_API_KEYS``: keys separated by commas or newlines (a Kubernetes Secret can fill this or the file);
- ``--jwt-secret-file`` (HS256) or ``--jwt-public-key-file`` (RS256/ES256 PEM), with optional ``--jwt-issuer``
  and ``--jwt-audience``: see :mod:`common.security.jwt_auth`.

With none of these set, :meth:`Authenticator.from_config` returns None: auth is off and every front is open.

Keys live in memory only as SHA-256 digests, compared with :func:`hmac.compare_digest` against every digest held
(no early exit), so neither the plain key nor the timing of a comparison gives a key away.

A credential arrives as ``authorization: Bearer <token>`` (HTTP header or gRPC metadata; the scheme is
case-insensitive) or as ``x-api-key: <key>`` (:func:`credential_of`). The principal (who is calling) is
``key:`` + the first 12 hex digits of the key's digest for an API key, the ``sub`` claim for a JWT. The fronts
record it on the call's context (gRPC) or request object (HTTP) under :data:`PRINCIPAL_ATTR`;
:func:`principal_of` reads it back (None: auth is off).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from common.security.errors import AuthError
from common.security.jwt_auth import JwtValidator, looks_like_jwt

__all__ = ["API_KEYS_ENV", "PRINCIPAL_ATTR", "ApiKeys", "AuthError", "Authenticator", "credential_of",
           "principal_of"]  # fmt: skip

API_KEYS_ENV = "PDSERVE_API_KEYS"
PRINCIPAL_ATTR = "auth_principal"  # the attribute of a call's context (or HTTP request) naming who calls
KEY_PRINCIPAL_PREFIX = "key:"
PRINCIPAL_DIGEST_HEX = 12  # hex digits of a key's digest in its principal
AUTHORIZATION = "authorization"
API_KEY_HEADER = "x-api-key"
_ENV_SEPARATORS = re.compile(r"[,\n]")


class ApiKeys:
    """A set of API keys, held as SHA-256 digests only. Immutable after construction, so thread-safe."""

    def __init__(self, keys: Iterable[str]) -> None:
        """``keys``: each non-empty printable ASCII without whitespace (what HTTP headers and gRPC metadata can
        carry). ValueError names the key's position, never the key."""
        digests = []
        for i, key in enumerate(keys):
            digests.append(_digest(_checked(key, f"API key #{i + 1}")))
        self._digests: tuple[bytes, ...] = tuple(dict.fromkeys(digests))  # a duplicate counts once

    @classmethod
    def load(cls, *, key_file: str = "", env: Mapping[str, str] = os.environ) -> ApiKeys:
        """The keys of ``key_file`` (if given) plus those of ``env[PDSERVE_API_KEYS]`` (if set).

        A given file that holds no key is ValueError (a misconfiguration must not turn auth off); a missing file
        is FileNotFoundError naming it. An empty variable adds nothing.
        """
        keys = []
        if key_file:
            keys += parse_key_file(_read_text(key_file), key_file)
            if not keys:
                raise ValueError(f"--api-key-file {key_file} holds no key (only blank lines or # comments)")
        keys += parse_env_keys(env.get(API_KEYS_ENV, ""))
        return cls(keys)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys)"

    def match(self, key: str) -> str | None:
        """The principal of ``key`` (``key:`` + 12 hex digits of its digest) if it is one of these keys, else
        None. Compares against every digest in constant time per digest."""
        digest = _digest(key)
        found = None
        for held in self._digests:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(held, digest):
                found = held
        return None if found is None else key_principal(found)


def key_principal(digest: bytes) -> str:
    """The principal of the API key with this SHA-256 ``digest``: stable, and safe to log or put in metrics."""
    return KEY_PRINCIPAL_PREFIX + digest.hex()[:PRINCIPAL_DIGEST_HEX]


def parse_key_file(text: str, path: str = "<file>") -> list[str]:
    """The keys of an API key file's ``text``: one per line, ``#`` comments and blank lines skipped, stripped.
    ValueError names the file and line of a bad key (never the key)."""
    keys = []
    for lineno, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if key and not key.startswith("#"):
            keys.append(_checked(key, f"--api-key-file {path} line {lineno}"))
    return keys


def parse_env_keys(value: str) -> list[str]:
    """The keys of ``PDSERVE_API_KEYS``: separated by commas or newlines, stripped, empty items skipped."""
    items = [item.strip() for item in _ENV_SEPARATORS.split(value)]
    return [_checked(key, f"{API_KEYS_ENV} item {i + 1}") for i, key in enumerate(k for k in items if k)]


class Authenticator:
    """Turns a bearer credential (an API key or a JWT) into a principal. Thread-safe (immutable)."""

    def __init__(self, api_keys: ApiKeys | None = None, jwt: JwtValidator | None = None) -> None:
        """At least one of a non-empty ``api_keys`` or ``jwt`` (ValueError otherwise: that would be auth off)."""
        if not api_keys and jwt is None:
            raise ValueError("an Authenticator needs at least one API key or a JWT validator")
        self.api_keys = api_keys if api_keys else None
        self.jwt = jwt

    @classmethod
    def from_config(cls, config: Any, *, env: Mapping[str, str] = os.environ) -> Authenticator | None:
        """From a config with fields ``api_key_file``, ``jwt_secret_file``, ``jwt_public_key_file``,
        ``jwt_issuer``, ``jwt_audience`` (RouterConfig, WorkerConfig) and ``env[PDSERVE_API_KEYS]``.

        None when none of them is set (auth off). ``--jwt-issuer``/``--jwt-audience`` without a JWT key is
        ValueError; so is a bad key or key file (FileNotFoundError for a missing one).
        """
        keys = ApiKeys.load(key_file=config.api_key_file, env=env)
        jwt = None
        if config.jwt_secret_file or config.jwt_public_key_file:
            jwt = JwtValidator.from_files(secret_file=config.jwt_secret_file,
                                          public_key_file=config.jwt_public_key_file,
                                          issuer=config.jwt_issuer, audience=config.jwt_audience)  # fmt: skip
        elif config.jwt_issuer or config.jwt_audience:
            flag = "--jwt-issuer" if config.jwt_issuer else "--jwt-audience"
            raise ValueError(f"{flag} needs --jwt-secret-file or --jwt-public-key-file to check tokens with")
        if not keys and jwt is None:
            return None
        return cls(keys, jwt)

    def describe(self) -> str:
        """What is accepted, for the start-up log (counts and settings, never a key)."""
        n = len(self.api_keys) if self.api_keys else 0
        parts = [f"{n} API key{'s' if n > 1 else ''}"] if n else []
        if self.jwt is not None:
            parts.append(self.jwt.describe())
        return " or ".join(parts)

    def authenticate(self, credential: str | None) -> str:
        """The principal of ``credential`` (from :func:`credential_of`), or AuthError with the reason.

        An API key is tried first; then, if JWTs are configured and the credential looks like one, the JWT's
        own reason ("token expired", "wrong audience", ...); else "invalid API key" ("malformed token" when only
        JWTs are configured).
        """
        if not credential:
            raise AuthError("missing credentials")
        if self.api_keys is not None:
            principal = self.api_keys.match(credential)
            if principal is not None:
                return principal
        if self.jwt is not None and (self.api_keys is None or looks_like_jwt(credential)):
            if not looks_like_jwt(credential):
                raise AuthError("malformed token")
            return self.jwt.validate(credential)
        raise AuthError("invalid API key")


def credential_of(pairs: Iterable[tuple[str, Any]]) -> str | None:
    """The bearer credential in HTTP headers or gRPC metadata (``(name, value)`` pairs, names any case):
    ``authorization: Bearer <token>``, else ``x-api-key: <key>``, else None. An ``authorization`` value of
    another scheme is AuthError."""
    bearer = api_key = None
    for name, value in pairs:
        if not isinstance(value, str):  # binary metadata (-bin keys)
            continue
        lowered = name.lower()
        if lowered == AUTHORIZATION and bearer is None:
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() != "bearer":
                raise AuthError("authorization must be 'Bearer <token>'")
            bearer = token.strip()
        elif lowered == API_KEY_HEADER and api_key is None:
            api_key = value.strip()
    return bearer or api_key or None


def principal_of(context: Any) -> str | None:
    """Who is calling: the principal the front authenticated for this call's context (a gRPC servicer context, or
    the HTTP request object an :class:`~common.http.server.HttpFront` route gets), None when auth is off."""
    return getattr(context, PRINCIPAL_ATTR, None)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _checked(key: str, where: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: an API key must be a non-empty string")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"{where}: an API key must be printable ASCII without spaces ({len(key)} characters, "
                         "not shown)")
    return key


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"API key file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read API key file {path}: {exc}") from None
