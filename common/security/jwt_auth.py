"""JWT validation for the public fronts: one key (an HS256 shared secret, or an RS256/ES256 public key), optional
issuer and audience, expiry always checked.

A token is accepted when all of these hold, else :class:`~common.security.errors.AuthError` says which failed:

- its signature verifies with the configured key, under the one algorithm that key allows (HS256 for a secret,
  RS256 for an RSA public key, ES256 for a P-256 EC public key); ``alg: none`` or another algorithm is refused;
- it has ``exp`` (required) and ``exp`` is not past, ``nbf`` (if present) not in the future, each give or take
  ``leeway_s``;
- ``iss`` equals the configured issuer and ``aud`` holds the configured audience, each when one is configured
  (then the claim is required);
- it has a non-empty string ``sub``: the principal.

Reasons (``AuthError.reason``, sent to the client; never the token): "token expired", "token not yet valid",
"wrong issuer", "wrong audience", "bad token signature", "token has no 'exp' claim" (any required claim),
"token has no subject", "token algorithm not allowed", "malformed token", "invalid token".
"""

from __future__ import annotations

import os
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from common.security.errors import AuthError

DEFAULT_LEEWAY_S = 30.0  # clock skew allowed on exp and nbf
MIN_SECRET_BYTES = 32  # RFC 7518 3.2: an HS256 key is at least the hash's size


class JwtValidator:
    """Validates bearer JWTs against one key. Thread-safe (no mutable state)."""

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        public_key_pem: bytes | None = None,
        issuer: str = "",
        audience: str = "",
        leeway_s: float = DEFAULT_LEEWAY_S,
    ) -> None:
        """Exactly one of ``secret`` (HS256, at least 32 bytes) or ``public_key_pem`` (an RSA or P-256 EC public
        key in PEM). ``issuer``/``audience``: "" = not checked. Raises ValueError (never showing the key)."""
        if (secret is None) == (public_key_pem is None):
            raise ValueError("JWT validation needs exactly one of a shared secret (HS256) or a public key "
                             "(RS256/ES256), got " + ("both" if secret is not None else "neither"))
        if not leeway_s >= 0:
            raise ValueError(f"JWT leeway must be >= 0 seconds, got {leeway_s!r}")
        if secret is not None:
            if len(secret) < MIN_SECRET_BYTES:
                raise ValueError(f"a JWT HS256 secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
            self._key, self.algorithm = secret, "HS256"
        else:
            self._key, self.algorithm = _public_key(public_key_pem)
        self.issuer, self.audience, self.leeway_s = issuer, audience, float(leeway_s)

    @classmethod
    def from_files(cls, *, secret_file: str = "", public_key_file: str = "", issuer: str = "",
                   audience: str = "", leeway_s: float = DEFAULT_LEEWAY_S) -> JwtValidator:  # fmt: skip
        """From ``--jwt-secret-file`` (its content, surrounding whitespace stripped) or ``--jwt-public-key-file``
        (PEM). A missing file is FileNotFoundError naming it; a bad key is ValueError naming the file."""
        if bool(secret_file) == bool(public_key_file):
            raise ValueError("give one of --jwt-secret-file or --jwt-public-key-file, not "
                             + ("both" if secret_file else "neither"))
        path = secret_file or public_key_file
        raw = _read(path)
        try:
            if secret_file:
                return cls(secret=raw.strip(), issuer=issuer, audience=audience, leeway_s=leeway_s)
            return cls(public_key_pem=raw, issuer=issuer, audience=audience, leeway_s=leeway_s)
        except ValueError as exc:
            raise ValueError(f"{'--jwt-secret-file' if secret_file else '--jwt-public-key-file'} {path}: {exc}") \
                from None

    def describe(self) -> str:
        """What is checked, for the start-up log (never the key)."""
        checks = [self.algorithm, "exp required"]
        if self.issuer:
            checks.append(f"issuer {self.issuer!r}")
        if self.audience:
            checks.append(f"audience {self.audience!r}")
        return "JWT (" + ", ".join(checks) + ")"

    def validate(self, token: str) -> str:
        """The token's ``sub`` when it is valid, else raises AuthError with the reason."""
        required = ["exp", *(["iss"] if self.issuer else []), *(["aud"] if self.audience else [])]
        try:
            claims = jwt.decode(
                token, self._key, algorithms=[self.algorithm], issuer=self.issuer or None,
                audience=self.audience or None, leeway=self.leeway_s,
                options={"require": required, "verify_aud": bool(self.audience), "verify_sub": False},
            )  # fmt: skip
        except jwt.ExpiredSignatureError:
            raise AuthError("token expired") from None
        except jwt.ImmatureSignatureError:
            raise AuthError("token not yet valid") from None
        except jwt.MissingRequiredClaimError as exc:
            raise AuthError(f"token has no {exc.claim!r} claim") from None
        except jwt.InvalidIssuerError:
            raise AuthError("wrong issuer") from None
        except jwt.InvalidAudienceError:
            raise AuthError("wrong audience") from None
        except jwt.InvalidSignatureError:
            raise AuthError("bad token signature") from None
        except jwt.InvalidAlgorithmError:
            raise AuthError("token algorithm not allowed") from None
        except jwt.DecodeError:
            raise AuthError("malformed token") from None
        except jwt.InvalidTokenError:
            raise AuthError("invalid token") from None
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise AuthError("token has no subject")
        return subject


def looks_like_jwt(credential: str) -> bool:
    """A compact JWS: three base64url segments (header and payload non-empty; an unsigned token's signature is
    empty), the header a JSON object (``eyJ`` = ``{"``)."""
    parts = credential.split(".")
    return len(parts) == 3 and credential.startswith("eyJ") and all(parts[:2])


def _public_key(pem: bytes):
    try:
        key = load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a PEM public key ({type(exc).__name__})") from None
    if isinstance(key, rsa.RSAPublicKey):
        return key, "RS256"
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return key, "ES256"
    found = f"an EC key on curve {key.curve.name}" if isinstance(key, ec.EllipticCurvePublicKey) else type(key).__name__
    raise ValueError(f"a JWT public key is RSA (RS256) or EC P-256 (ES256), got {found}")


def _read(path: str | os.PathLike[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"JWT key file not found: {path}") from None
    except OSError as exc:
        raise ValueError(f"cannot read JWT key file {path}: {exc.strerror or exc}") from None
