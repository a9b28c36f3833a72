"""Encryption of KV blocks at rest: AES-256-GCM, bound to the name the block is stored under.

Wherever KV bytes leave process memory (today: the prefix cache's shared tier in Redis,
:class:`common.engine.kv_tiers.RedisKVStore`), they are sealed with a :class:`KVCipher`:

    sealed = nonce (12 random bytes) + AES-256-GCM(key, nonce, data, associated data = name)   # + 16-byte tag

The associated data is the block's full storage name (its Redis key), so a block copied under another name,
a flipped byte, a truncated value or a value sealed with another key fails :meth:`KVCipher.open` with
:class:`KVIntegrityError`; the caller then treats the block as missing and recomputes it. A random 96-bit
nonce per seal keeps the chance of a repeat negligible up to ~2^32 seals per key (rotate the key well before).

:attr:`KVCipher.fingerprint` (8 hex digits of the key's SHA-256) names the key without revealing it: stores
put it in their key space, so engines with different keys (or none) never read each other's blocks.

The key is read by :func:`read_key_file`: 32 raw bytes, 64 hex digits, or base64 of 32 bytes. Nothing here
ever logs or formats the key itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import string
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

log = logging.getLogger(__name__)

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # GCM's standard 96-bit nonce
TAG_BYTES = 16
OVERHEAD_BYTES = NONCE_BYTES + TAG_BYTES  # sealed length = plaintext length + this
_HEX_DIGITS = frozenset(string.hexdigits)


class KVIntegrityError(ValueError):
    """A sealed block failed authentication: tampered, truncated, stored under another name, or another key."""


class KVCipher:
    """Seals and opens KV blocks with one AES-256-GCM key. Thread-safe (no mutable state)."""

    def __init__(self, key: bytes) -> None:
        """``key``: exactly 32 bytes. Raises ValueError giving the length found (never the key)."""
        if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
            found = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
            raise ValueError(f"a KV encryption key is {KEY_BYTES} bytes, got {found}")
        self._aead = AESGCM(bytes(key))
        self.fingerprint = hashlib.sha256(key).hexdigest()[:8]  # names the key; never the key

    @classmethod
    def from_key_file(cls, path: str | os.PathLike[str]) -> KVCipher:
        return cls(read_key_file(path))

    def seal(self, name: bytes, data: bytes) -> bytes:
        """``nonce + ciphertext + tag`` of ``data``, authenticated together with ``name`` (not stored in it)."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, bytes(data), bytes(name))

    def open(self, name: bytes, sealed: bytes) -> bytes:
        """The plaintext :meth:`seal` was given for ``name``. Raises :class:`KVIntegrityError` when ``sealed`` is
        too short, altered, sealed under another name or with another key; never returns unauthenticated bytes."""
        if len(sealed) < OVERHEAD_BYTES:
            raise KVIntegrityError(f"sealed KV block of {len(sealed)} bytes is shorter than nonce + tag "
                                   f"({OVERHEAD_BYTES} bytes)")
        try:
            return self._aead.decrypt(bytes(sealed[:NONCE_BYTES]), bytes(sealed[NONCE_BYTES:]), bytes(name))
        except InvalidTag:
            raise KVIntegrityError(f"sealed KV block of {len(sealed)} bytes failed authentication (altered, "
                                   f"stored under another name, or sealed with a key other than "
                                   f"{self.fingerprint})") from None

    def __repr__(self) -> str:
        return f"KVCipher(fingerprint={self.fingerprint!r})"


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The 32-byte key in file ``path``: 32 raw bytes, or 64 hex digits, or base64 of 32 bytes (text forms may
    be surrounded by whitespace). Raises ValueError naming the file and describing what it holds (its length
    and form, never its content); warns when the file can be read by group or others."""
    file = Path(path)
    try:
        raw = file.read_bytes()
        mode = file.stat().st_mode
    except OSError as exc:
        raise ValueError(f"cannot read KV encryption key file {file}: {exc.strerror or exc}") from None
    if mode & 0o077:
        log.warning("KV encryption key file %s is readable by group or others (mode %o); chmod 600 it",
                    file, mode & 0o777)
    if len(raw) == KEY_BYTES:
        return raw
    expected = "32 raw bytes, 64 hex digits or base64 of 32 bytes"
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"KV encryption key file {file}: expected {expected}, found {len(raw)} bytes of "
                         "binary data") from None
    if len(text) == 2 * KEY_BYTES and set(text) <= _HEX_DIGITS:
        return bytes.fromhex(text)
    try:
        decoded = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        decoded = None
    if decoded is not None and len(decoded) == KEY_BYTES:
        return decoded
    if decoded is not None and text:
        found = f"{len(text)} characters of base64 decoding to {len(decoded)} bytes"
    elif text and set(text) <= _HEX_DIGITS:
        found = f"{len(text)} hex digits"
    else:
        found = f"{len(raw)} bytes of text that is neither hex nor base64" if text else "no key (empty)"
    raise ValueError(f"KV encryption key file {file}: expected {expected}, found {found}")
