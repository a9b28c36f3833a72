"""Throwaway certificates (common/security/certs.py): what ``pdserve up --tls-dir`` writes."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.security.certs import write_service_certs


def test_writes_a_ca_and_one_usable_certificate_per_service(tmp_path):
    out = tmp_path / "tls"
    files = write_service_certs(out, ["router", "prefill-0"])
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.pem",
        "prefill-0.key",
        "prefill-0.pem",
        "router.key",
        "router.pem",
    ]  # the CA's key is never written
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    for name, tls in files.items():
        assert (tls.cert_file, tls.key_file, tls.ca_file) == (str(out / f"{name}.pem"), str(out / f"{name}.key"),
                                                              str(out / "ca.pem"))  # fmt: skip
        assert stat.S_IMODE((out / f"{name}.key").stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate((out / f"{name}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
        assert san.get_values_for_type(x509.DNSName) == ["localhost"]
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        tls.load()  # the key belongs to the certificate, which is valid now


def test_rewriting_a_key_file_narrows_its_mode(tmp_path):
    key = tmp_path / "router.key"
    key.write_bytes(b"old")
    key.chmod(0o644)
    write_service_certs(tmp_path, ["router"])
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


@pytest.mark.parametrize("name", ["", "../x", ".hidden"])
def test_a_name_that_is_not_a_plain_file_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError) as info:
        write_service_certs(tmp_path, [name])
    assert str(info.value) == f"certificate name {name!r} is not a plain file name"
