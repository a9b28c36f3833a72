"""API keys, JWTs and the Authenticator (common/security/auth.py, jwt_auth.py): parsing, hashing, constant-time
comparison, every refusal reason, HS256, RS256 and ES256."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from common.security import auth
from common.security.auth import (
    API_KEYS_ENV,
    ApiKeys,
    Authenticator,
    credential_of,
    parse_env_keys,
    parse_key_file,
    principal_of,
)
from common.security.errors import AuthError
from common.security.jwt_auth import JwtValidator, looks_like_jwt

SECRET = b"0123456789abcdef0123456789abcdef-hs256"  # 38 bytes
KEY_A, KEY_B = "sk-alpha-0001", "sk-beta-0002"


def principal(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass
class Settings:  # the five fields RouterConfig and WorkerConfig share
    api_key_file: str = ""
    jwt_secret_file: str = ""
    jwt_public_key_file: str = ""
    jwt_issuer: str = ""
    jwt_audience: str = ""


def token(key, algorithm="HS256", *, exp_in_s: float | None = 60.0, **claims) -> str:
    body = {"sub": "alice", **claims}
    if exp_in_s is not None:
        body["exp"] = int(time.time() + exp_in_s)
    return jwt.encode(body, key, algorithm=algorithm)


def reason(authenticator: Authenticator, credential: str | None) -> str:
    with pytest.raises(AuthError) as err:
        authenticator.authenticate(credential)
    return err.value.reason


# -- API keys: sources --------------------------------------------------------------------------------------


def test_key_file_skips_blank_lines_and_comments_and_strips_whitespace():
    text = "# keys of team A\n\n  sk-alpha-0001  \n\t\n   # indented comment\nsk-beta-0002\r\n"
    assert parse_key_file(text) == [KEY_A, KEY_B]


def test_env_keys_split_on_commas_and_newlines():
    assert parse_env_keys(" sk-1 ,sk-2\nsk-3,, \n") == ["sk-1", "sk-2", "sk-3"]
    assert parse_env_keys("") == []


def test_load_takes_the_file_and_the_environment_together(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n")
    keys = ApiKeys.load(key_file=str(path), env={API_KEYS_ENV: f"{KEY_B},{KEY_A}"})
    assert len(keys) == 2  # KEY_A from both sources counts once
    assert keys.match(KEY_A) == principal(KEY_A) and keys.match(KEY_B) == principal(KEY_B)
    assert keys.match("sk-gamma") is None


def test_a_key_file_without_keys_is_an_error_not_auth_off(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match=f"--api-key-file {path} holds no key"):
        ApiKeys.load(key_file=str(path), env={})
    with pytest.raises(FileNotFoundError, match=f"API key file not found: {tmp_path / 'absent'}"):
        ApiKeys.load(key_file=str(tmp_path / "absent"), env={})


def test_a_bad_key_is_named_by_its_line_never_shown(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\nsk secret with spaces\n")
    with pytest.raises(ValueError) as err:
        ApiKeys.load(key_file=str(path), env={})
    assert str(err.value) == (f"--api-key-file {path} line 2: an API key must be printable ASCII without spaces "
                              "(21 characters, not shown)")
    with pytest.raises(ValueError, match=f"^{API_KEYS_ENV} item 2: an API key must be printable ASCII"):
        parse_env_keys("sk-ok,sk-é")


# -- API keys: hashing and comparison ------------------------------------------------------------------------


def test_only_digests_are_held_never_the_plain_key():
    keys = ApiKeys([KEY_A, KEY_B])
    held = vars(keys)
    assert list(held) == ["_digests"]
    assert held["_digests"] == (hashlib.sha256(KEY_A.encode()).digest(), hashlib.sha256(KEY_B.encode()).digest())
    assert KEY_A not in repr(held) and KEY_A not in repr(keys) and repr(keys) == "ApiKeys(2 keys)"


def test_match_compares_digests_in_constant_time_against_every_key(monkeypatch):
    calls, real = [], hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = ApiKeys([KEY_A, KEY_B, "sk-third-0003"])
    assert keys.match(KEY_A) == principal(KEY_A)
    digest_a = hashlib.sha256(KEY_A.encode()).digest()
    assert len(calls) == 3  # no early exit on the first key's match
    assert all(b == digest_a and len(a) == 32 for a, b in calls)


def test_principal_is_the_first_12_hex_of_the_digest():
    assert ApiKeys([KEY_A]).match(KEY_A) == "key:" + hashlib.sha256(b"sk-alpha-0001").hexdigest()[:12]


# -- credentials from headers / metadata --------------------------------------------------------------------


def test_credential_of_reads_bearer_then_x_api_key():
    assert credential_of([("Authorization", "Bearer  tok-1 ")]) == "tok-1"
    assert credential_of([("authorization", "bearer tok-1")]) == "tok-1"
    assert credential_of([("X-API-Key", " k-2 ")]) == "k-2"
    assert credential_of([("x-api-key", "k-2"), ("authorization", "Bearer tok-1")]) == "tok-1"
    assert credential_of([("user-agent", "curl"), ("sig-bin", b"\x00")]) is None
    assert credential_of([("authorization", "Bearer ")]) is None
    with pytest.raises(AuthError, match="^authorization must be 'Bearer <token>'$"):
        credential_of([("authorization", "Basic dXNlcjpwYXNz")])


def test_principal_of_reads_the_attribute_the_fronts_set():
    class Context:
        auth_principal = "key:0123456789ab"

    assert principal_of(Context()) == "key:0123456789ab"
    assert principal_of(object()) is None


# -- the Authenticator with API keys ------------------------------------------------------------------------


def test_api_key_accepted_missing_and_wrong_refused_without_echo():
    authenticator = Authenticator(ApiKeys([KEY_A]))
    assert authenticator.authenticate(KEY_A) == principal(KEY_A)
    assert reason(authenticator, None) == "missing credentials"
    assert reason(authenticator, "") == "missing credentials"
    assert reason(authenticator, "sk-alpha-0002") == "invalid API key"


def test_from_config_is_none_when_nothing_is_configured_and_strict_otherwise(tmp_path):
    assert Authenticator.from_config(Settings(), env={}) is None
    assert Authenticator.from_config(Settings(), env={API_KEYS_ENV: ""}) is None
    from_env = Authenticator.from_config(Settings(), env={API_KEYS_ENV: KEY_B})
    assert from_env.authenticate(KEY_B) == principal(KEY_B) and from_env.jwt is None
    with pytest.raises(ValueError, match="^--jwt-issuer needs --jwt-secret-file or --jwt-public-key-file"):
        Authenticator.from_config(Settings(jwt_issuer="https://idp"), env={})
    with pytest.raises(ValueError, match="^--jwt-audience needs"):
        Authenticator.from_config(Settings(jwt_audience="pdserve"), env={})
    with pytest.raises(ValueError, match="needs at least one API key or a JWT validator"):
        Authenticator(ApiKeys([]))


# -- JWT: HS256 -----------------------------------------------------------------------------------------------


@pytest.fixture
def hs256(tmp_path) -> Authenticator:
    path = tmp_path / "jwt-secret"
    path.write_bytes(SECRET + b"\n")  # a Secret's trailing newline is stripped
    settings = Settings(jwt_secret_file=str(path), jwt_issuer="https://idp.example", jwt_audience="pdserve")
    return Authenticator.from_config(settings, env={})


def test_hs256_valid_token_gives_its_subject(hs256):
    assert hs256.authenticate(token(SECRET, iss="https://idp.example", aud="pdserve")) == "alice"
    assert hs256.authenticate(token(SECRET, iss="https://idp.example", aud=["other", "pdserve"])) == "alice"
    assert hs256.describe() == "JWT (HS256, exp required, issuer 'https://idp.example', audience 'pdserve')"


def test_hs256_refusals_name_their_reason(hs256):
    good = dict(iss="https://idp.example", aud="pdserve")
    assert reason(hs256, token(SECRET, exp_in_s=-120, **good)) == "token expired"
    assert reason(hs256, token(SECRET, exp_in_s=None, **good)) == "token has no 'exp' claim"
    assert reason(hs256, token(SECRET, iss="https://evil.example", aud="pdserve")) == "wrong issuer"
    assert reason(hs256, token(SECRET, aud="pdserve")) == "token has no 'iss' claim"
    assert reason(hs256, token(SECRET, iss="https://idp.example", aud="other")) == "wrong audience"
    assert reason(hs256, token(b"another-secret-of-at-least-32-bytes!", **good)) == "bad token signature"
    assert reason(hs256, token(SECRET, nbf=int(time.time()) + 600, **good)) == "token not yet valid"
    assert reason(hs256, token(SECRET, sub="", **good)) == "token has no subject"
    assert reason(hs256, token(None, "none", **good)) == "token algorithm not allowed"
    assert reason(hs256, "eyJhbGciOi.not-base64.x") == "malformed token"
    assert reason(hs256, "sk-looks-like-a-key") == "malformed token"  # JWT only: a key is no token


def test_expiry_has_a_small_leeway(hs256):
    good = dict(iss="https://idp.example", aud="pdserve")
    assert hs256.authenticate(token(SECRET, exp_in_s=-5, **good)) == "alice"


def test_keys_and_jwts_together(tmp_path):
    keys = ApiKeys([KEY_A])
    authenticator = Authenticator(keys, JwtValidator(secret=SECRET))
    assert authenticator.authenticate(KEY_A) == principal(KEY_A)
    assert authenticator.authenticate(token(SECRET)) == "alice"
    assert reason(authenticator, token(SECRET, exp_in_s=-120)) == "token expired"
    assert reason(authenticator, "sk-nope") == "invalid API key"
    assert authenticator.describe() == "1 API key or JWT (HS256, exp required)"
    assert Authenticator(ApiKeys([KEY_A, KEY_B])).describe() == "2 API keys"


def test_a_short_or_missing_secret_is_refused_at_start(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"too-short\n")
    with pytest.raises(ValueError) as err:
        Authenticator.from_config(Settings(jwt_secret_file=str(path)), env={})
    assert str(err.value) == f"--jwt-secret-file {path}: a JWT HS256 secret must be at least 32 bytes, got 9"
    with pytest.raises(FileNotFoundError, match=f"JWT key file not found: {tmp_path / 'none'}"):
        Authenticator.from_config(Settings(jwt_secret_file=str(tmp_path / "none")), env={})
    with pytest.raises(ValueError, match="give one of --jwt-secret-file or --jwt-public-key-file, not both"):
        JwtValidator.from_files(secret_file=str(path), public_key_file=str(path))


# -- JWT: RS256 and ES256 -------------------------------------------------------------------------------------


def pem_of_public(private_key) -> bytes:
    return private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)  # fmt: skip


@pytest.fixture(scope="module")
def rsa_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def test_rs256_valid_and_forged_tokens(tmp_path, rsa_key):
    path = tmp_path / "jwt.pub"
    path.write_bytes(pem_of_public(rsa_key))
    authenticator = Authenticator.from_config(Settings(jwt_public_key_file=str(path), jwt_audience="pdserve"),
                                              env={})  # fmt: skip
    assert authenticator.jwt.algorithm == "RS256"
    assert authenticator.authenticate(token(rsa_key, "RS256", aud="pdserve", sub="svc-batch")) == "svc-batch"
    assert reason(authenticator, token(rsa_key, "RS256", aud="else")) == "wrong audience"
    assert reason(authenticator, token(rsa_key, "RS256")) == "token has no 'aud' claim"
    assert reason(authenticator, token(rsa_key, "RS256", exp_in_s=-120, aud="pdserve")) == "token expired"
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert reason(authenticator, token(other, "RS256", aud="pdserve")) == "bad token signature"
    assert reason(authenticator, token(SECRET, aud="pdserve")) == "token algorithm not allowed"


def test_rs256_refuses_an_hs256_token_signed_with_the_public_key(tmp_path, rsa_key):
    """The classic algorithm confusion: the (public) PEM used as an HMAC secret."""
    pem = pem_of_public(rsa_key)
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = _b64(json.dumps({"sub": "eve", "aud": "pdserve", "exp": int(time.time()) + 60}).encode())
    signature = _b64(hmac.new(pem, f"{header}.{payload}".encode(), hashlib.sha256).digest())
    validator = JwtValidator(public_key_pem=pem, audience="pdserve")
    with pytest.raises(AuthError) as err:
        validator.validate(f"{header}.{payload}.{signature}")
    assert err.value.reason == "token algorithm not allowed"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_es256_public_key(tmp_path):
    private = ec.generate_private_key(ec.SECP256R1())
    validator = JwtValidator(public_key_pem=pem_of_public(private))
    assert validator.algorithm == "ES256"
    assert validator.validate(token(private, "ES256", sub="bob")) == "bob"


def test_a_public_key_file_that_is_no_key_is_named(tmp_path):
    path = tmp_path / "jwt.pub"
    path.write_text("-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ValueError, match=f"^--jwt-public-key-file {path}: not a PEM public key"):
        JwtValidator.from_files(public_key_file=str(path))
    p384 = ec.generate_private_key(ec.SECP384R1())
    with pytest.raises(ValueError, match="ES256\\), got an EC key on curve secp384r1$"):
        JwtValidator(public_key_pem=pem_of_public(p384))


def test_looks_like_jwt():
    assert looks_like_jwt(token(SECRET))
    assert looks_like_jwt(token(None, "none"))  # unsigned: empty signature, still a token (refused later)
    assert not looks_like_jwt("sk-alpha-0001") and not looks_like_jwt("eyJ.x") and not looks_like_jwt("a.b.c")
