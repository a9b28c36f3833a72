"""KVCipher: sealed blocks round-trip, and anything altered, moved or under another key is refused; key files."""

from __future__ import annotations

import base64
import hashlib
import logging

import pytest

from common.security.kv_crypto import OVERHEAD_BYTES, KVCipher, KVIntegrityError, read_key_file

KEY = bytes(range(32))
NAME = b"pdserve:kvblock:space:00ff"
DATA = bytes(range(256)) * 8  # 2 KiB, like a (tiny) block


@pytest.fixture
def cipher() -> KVCipher:
    return KVCipher(KEY)


def test_round_trip_and_layout(cipher):
    sealed = cipher.seal(NAME, DATA)
    assert len(sealed) == len(DATA) + OVERHEAD_BYTES == len(DATA) + 28
    assert DATA not in sealed and DATA[:64] not in sealed  # the plaintext does not appear
    assert cipher.open(NAME, sealed) == DATA
    assert cipher.seal(NAME, DATA)[:12] != sealed[:12]  # a fresh random nonce per seal
    assert KVCipher(KEY).open(NAME, sealed) == DATA  # another instance with the same key


@pytest.mark.parametrize("offset", [0, 11, 12, 500, -1])  # nonce, first ciphertext byte, middle, tag
def test_a_flipped_byte_is_refused(cipher, offset):
    sealed = bytearray(cipher.seal(NAME, DATA))
    sealed[offset] ^= 0x01
    with pytest.raises(KVIntegrityError, match="failed authentication"):
        cipher.open(NAME, bytes(sealed))


def test_a_block_moved_under_another_name_is_refused(cipher):
    sealed = cipher.seal(NAME, DATA)
    with pytest.raises(KVIntegrityError, match="failed authentication"):
        cipher.open(NAME[:-1] + b"e", sealed)


def test_another_key_is_refused_and_names_only_the_fingerprint(cipher):
    sealed = cipher.seal(NAME, DATA)
    other = KVCipher(bytes(32))
    with pytest.raises(KVIntegrityError, match=f"key other than {other.fingerprint}") as info:
        other.open(NAME, sealed)
    assert bytes(32).hex() not in str(info.value)


def test_truncated_values_are_refused(cipher):
    sealed = cipher.seal(NAME, DATA)
    with pytest.raises(KVIntegrityError, match="failed authentication"):
        cipher.open(NAME, sealed[:-1])
    with pytest.raises(KVIntegrityError, match="27 bytes is shorter than nonce \\+ tag \\(28 bytes\\)"):
        cipher.open(NAME, sealed[:27])


def test_fingerprint_is_8_hex_of_the_key_digest_and_repr_hides_the_key(cipher):
    assert cipher.fingerprint == hashlib.sha256(KEY).hexdigest()[:8]
    assert KVCipher(bytes(32)).fingerprint != cipher.fingerprint
    assert repr(cipher) == f"KVCipher(fingerprint='{cipher.fingerprint}')"


@pytest.mark.parametrize(("key", "found"), [(b"x" * 16, "16 bytes"), (b"", "0 bytes"), ("k" * 32, "str")])
def test_a_key_of_another_length_or_type_is_refused(key, found):
    with pytest.raises(ValueError, match=f"32 bytes, got {found}$"):
        KVCipher(key)


@pytest.mark.parametrize(
    "content",
    [KEY, KEY.hex().encode(), KEY.hex().upper().encode() + b"\n", base64.b64encode(KEY),
     b"  " + base64.b64encode(KEY) + b"\r\n"],
    ids=["raw", "hex", "HEX-newline", "base64", "base64-spaces"],
)
def test_key_file_forms(tmp_path, content):
    path = tmp_path / "kv.key"
    path.write_bytes(content)
    path.chmod(0o600)
    assert read_key_file(path) == KEY
    assert KVCipher.from_key_file(str(path)).fingerprint == KVCipher(KEY).fingerprint


@pytest.mark.parametrize(
    ("content", "found"),
    [(b"", "no key \\(empty\\)"),
     (b"\n\n", "no key \\(empty\\)"),
     (b"ab" * 31, "62 hex digits"),
     (base64.b64encode(bytes(range(16))), "24 characters of base64 decoding to 16 bytes"),
     (b"not a key at all!", "17 bytes of text that is neither hex nor base64"),
     (b"\xff" * 33, "33 bytes of binary data")],
)
def test_bad_key_files_name_the_file_and_what_it_holds_never_the_key(tmp_path, content, found):
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"^KV encryption key file {path}: expected 32 raw bytes, 64 hex digits or "
                                         f"base64 of 32 bytes, found {found}$") as info:
        read_key_file(path)
    if content.strip():
        assert content.strip().decode(errors="replace") not in str(info.value)


def test_a_missing_key_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"^cannot read KV encryption key file {tmp_path / 'none.key'}: "
                                         "No such file or directory$"):
        read_key_file(tmp_path / "none.key")


def test_a_key_file_readable_by_others_is_warned_about(tmp_path, caplog):
    path = tmp_path / "open.key"
    path.write_bytes(KEY)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="common.security.kv_crypto"):
        read_key_file(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"KV encryption key file {path} is readable by group or others (mode 644); chmod 600 it"]
    caplog.clear()
    path.chmod(0o600)
    read_key_file(path)
    assert caplog.records == []
