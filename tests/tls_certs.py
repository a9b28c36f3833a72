"""Throwaway TLS material for tests: a CA and a server certificate for 127.0.0.1 / localhost, made by
:mod:`common.security.certs` (EC P-256, valid one day). Never use these outside tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.security.certs import LOCAL_HOSTS, CertificateAuthority, write_private


@dataclass(frozen=True)
class ServerCertFiles:
    ca_cert: Path  # PEM: what clients trust (e.g. ``?ssl_ca_certs=`` of a rediss:// URL)
    server_cert: Path  # PEM, signed by the CA; SAN: IP 127.0.0.1, DNS localhost
    server_key: Path  # PEM, unencrypted, mode 0600


def write_test_certs(directory: str | Path) -> ServerCertFiles:
    """Write ``ca.pem``, ``server.pem`` and ``server.key`` into ``directory`` (which must exist)."""
    out = Path(directory)
    authority = CertificateAuthority("pdserve test CA", valid_s=24 * 3600.0)
    cert_pem, key_pem = authority.issue("127.0.0.1", LOCAL_HOSTS)
    files = ServerCertFiles(out / "ca.pem", out / "server.pem", out / "server.key")
    files.ca_cert.write_bytes(authority.cert_pem)
    files.server_cert.write_bytes(cert_pem)
    write_private(files.server_key, key_pem)
    return files
