"""Throwaway certificates for a local mutual-TLS cluster (``pdserve up --tls-dir``) and for tests.

One certificate authority per run, and per service one certificate it uses both to serve and to dial
(extended key usage: server and client auth), all EC P-256, each valid for the hosts given (IP addresses
become IP SANs, other names DNS SANs). The CA's private key stays in memory and is never written: once the
run is over no one can issue another certificate under that CA.

Production should use certificates from a real issuer (cert-manager in Kubernetes, a company PKI); these
are a quick way to run and test the mTLS paths on one machine.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from common.rpc.tls import TlsFiles

CA_FILE_NAME = "ca.pem"
LOCAL_HOSTS = ("127.0.0.1", "localhost")
DEFAULT_VALID_S = 7 * 24 * 3600.0
_BACKDATE_S = 300.0  # certificates start a little in the past: a peer's clock may be slightly behind


class CertificateAuthority:
    """A self-signed CA held in memory; :meth:`issue` signs leaf certificates with it."""

    def __init__(self, common_name: str = "pdserve throwaway CA", *, valid_s: float = DEFAULT_VALID_S) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        if valid_s <= 0:
            raise ValueError(f"valid_s must be > 0, got {valid_s}")
        self.valid_s = valid_s
        self._key = ec.generate_private_key(ec.SECP256R1())
        usage = _key_usage(key_cert_sign=True)
        self.certificate = (
            _builder(_name(common_name), _name(common_name), self._key.public_key(), valid_s)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, hosts: Sequence[str]) -> tuple[bytes, bytes]:
        """A new key and a certificate for it signed by this CA, valid for ``hosts`` (at least one) as a server
        and usable as a client; returns ``(cert_pem, key_pem)`` (the key unencrypted, PKCS#8)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        if not hosts:
            raise ValueError(f"a certificate for {common_name!r} needs at least one host")
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(_name(common_name), self.certificate.subject, key.public_key(), self.valid_s)
            .add_extension(x509.SubjectAlternativeName(list(_general_names(hosts))), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )  # fmt: skip
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())  # fmt: skip
        return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_service_certs(
    directory: str | Path,
    names: Iterable[str],
    *,
    hosts: Sequence[str] = LOCAL_HOSTS,
    valid_s: float = DEFAULT_VALID_S,
) -> dict[str, TlsFiles]:
    """A new CA (``ca.pem``) and, per name, ``NAME.pem`` and ``NAME.key`` (mode 0600) in ``directory``
    (created, mode 0700, if missing; files of the same names are replaced). Returns each name's
    :class:`~common.rpc.tls.TlsFiles` (absolute paths, the CA as ``ca_file``)."""
    out = Path(directory).absolute()
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    authority = CertificateAuthority(valid_s=valid_s)
    ca_path = out / CA_FILE_NAME
    ca_path.write_bytes(authority.cert_pem)
    files = {}
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"certificate name {name!r} is not a plain file name")
        cert_pem, key_pem = authority.issue(name, hosts)
        cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
        cert_path.write_bytes(cert_pem)
        write_private(key_path, key_pem)
        files[name] = TlsFiles(str(cert_path), str(key_path), str(ca_path))
    return files


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (mode 0600 from the start, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # the file may have existed with a wider mode
        f.write(data)


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject, issuer, public_key, valid_s: float):
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(seconds=_BACKDATE_S))
            .not_valid_after(now + datetime.timedelta(seconds=valid_s)))  # fmt: skip


def _key_usage(*, digital_signature: bool = False, key_cert_sign: bool = False):
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=digital_signature or key_cert_sign,
        key_cert_sign=key_cert_sign,
        crl_sign=key_cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def _general_names(hosts: Sequence[str]):
    from cryptography import x509

    for host in hosts:
        try:
            yield x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            yield x509.DNSName(host)
