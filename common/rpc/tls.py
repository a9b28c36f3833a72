"""TLS of pdserve's gRPC connections: which PEM files a service uses, and the gRPC credentials made of them.

Mutual TLS between services (``--tls-cert-file``, ``--tls-key-file``, ``--tls-ca-file``, all three or none):

- a worker's gRPC server presents its certificate and *requires* a client certificate signed by the CA: a
  peer without one, or with one from another CA, is refused during the handshake (the call fails with
  UNAVAILABLE before any method, health and reflection included, runs);
- the router's channels to the workers and the prefill worker's KV channel to the decode workers present
  the service's certificate and accept only a server certificate signed by the CA and issued for the host
  they dial (an IP address must be an IP SAN of the certificate);
- ``--tls-server-name NAME`` (optional) checks every server certificate for ``NAME`` instead of the dialled
  host (``grpc.ssl_target_name_override``): for workers that advertise IP addresses (pods) and share one
  certificate issued for a DNS name, and for test or dev setups. It weakens nothing else: the chain must
  still lead to the CA.

Server-side TLS only (the router's public port, ``--public-tls-*``): :class:`TlsFiles` without ``ca_file``;
the server then asks no client certificate.

Files are read when a server is built or a channel is opened (a renewed certificate reaches new channels;
a server reads its files once, at start). Error messages name the file and the problem, never its bytes.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of :class:`TlsFiles`, checked (see :meth:`TlsFiles.load`)."""

    certificate_chain: bytes  # the service's certificate, then any intermediates
    private_key: bytes = field(repr=False)
    root_certificates: bytes | None  # the CA bundle; None: no peer certificate is checked (server-side TLS only)


@dataclass(frozen=True)
class TlsFiles:
    """Paths of one service's TLS identity; the files are read by :meth:`load` (never at construction).

    ``ca_file`` "" is allowed only for a server that asks for no client certificate. ``server_name``: the
    name a server's certificate must carry, checked instead of the host a channel dials ("" = that host).
    """

    cert_file: str
    key_file: str
    ca_file: str = ""
    server_name: str = ""

    @classmethod
    def from_config(cls, config, *, prefix: str = "tls", mutual: bool = True) -> TlsFiles | None:
        """The files named by ``config``'s fields ``{prefix}_cert_file``, ``{prefix}_key_file`` and (``mutual``)
        ``{prefix}_ca_file`` and ``{prefix}_server_name``; None when none of the files is set.

        Raises ValueError naming the flags when only some of the files are set, or a server name without them.
        """
        names = ["cert_file", "key_file", *(["ca_file"] if mutual else [])]
        values = {name: getattr(config, f"{prefix}_{name}") or "" for name in names}
        server_name = (getattr(config, f"{prefix}_server_name", "") or "") if mutual else ""
        flags = {name: "--" + f"{prefix}_{name}".replace("_", "-") for name in names}
        missing = [flags[name] for name in names if not values[name]]
        if len(missing) == len(names):
            if server_name:
                raise ValueError(f"--{prefix.replace('_', '-')}-server-name {server_name!r} needs "
                                 f"{', '.join(flags.values())}")  # fmt: skip
            return None
        if missing:
            given = ", ".join(f"{flags[n]} {values[n]!r}" for n in names if values[n])
            raise ValueError(f"TLS needs {', '.join(flags.values())} together: {given} given, "
                             f"{', '.join(missing)} missing")  # fmt: skip
        return cls(values["cert_file"], values["key_file"], values.get("ca_file", ""), server_name)

    def load(self) -> TlsMaterial:
        """Read and check the files: PEM certificates, an unencrypted PEM private key that belongs to the
        certificate, a certificate still valid now. ValueError naming the file and the problem otherwise."""
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives import serialization

        chain = _read(self.cert_file, "certificate")
        key = _read(self.key_file, "private key")
        roots = _read(self.ca_file, "CA") if self.ca_file else None
        certs = _certificates(chain, self.cert_file, "certificate")
        if roots is not None:
            _certificates(roots, self.ca_file, "CA")
        try:
            private_key = serialization.load_pem_private_key(key, password=None)
        except (TypeError, ValueError, UnsupportedAlgorithm):
            raise ValueError(f"TLS private key file {self.key_file!r} is not an unencrypted PEM private key") from None
        spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        if certs[0].public_key().public_bytes(*spki) != private_key.public_key().public_bytes(*spki):
            raise ValueError(f"TLS private key file {self.key_file!r} does not belong to the certificate in "
                             f"{self.cert_file!r}")  # fmt: skip
        expires = certs[0].not_valid_after_utc
        if expires <= datetime.datetime.now(datetime.timezone.utc):
            raise ValueError(f"TLS certificate {self.cert_file!r} expired at {expires.isoformat()}")
        return TlsMaterial(chain, key, roots)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Credentials of a server port: presents ``tls``'s certificate; with a ``ca_file`` it requires every
    client to present a certificate signed by that CA (refused at the handshake otherwise)."""
    material = tls.load()
    return grpc.ssl_server_credentials(
        [(material.private_key, material.certificate_chain)],
        root_certificates=material.root_certificates,
        require_client_auth=material.root_certificates is not None,
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Credentials of a client channel: presents ``tls``'s certificate, trusts only servers signed by its CA."""
    if not tls.ca_file:
        raise ValueError(f"a TLS channel needs a CA file to check the server against (certificate {tls.cert_file!r})")
    material = tls.load()
    return grpc.ssl_channel_credentials(
        root_certificates=material.root_certificates,
        private_key=material.private_key,
        certificate_chain=material.certificate_chain,
    )


def open_channel(address: str, tls: TlsFiles | None, options: Sequence[tuple[str, object]] = (), *,
                 use_asyncio: bool = False) -> grpc.Channel:
    """A channel to ``address`` (``host:port``) with ``options``: plaintext when ``tls`` is None, else mutual
    TLS (with ``tls.server_name`` as the name checked in the server's certificate, when set). ``use_asyncio``:
    a ``grpc.aio`` channel."""
    api = grpc.aio if use_asyncio else grpc
    if tls is None:
        return api.insecure_channel(address, options=list(options))
    extra = [(TARGET_NAME_OVERRIDE, tls.server_name)] if tls.server_name else []
    return api.secure_channel(address, channel_credentials(tls), options=[*options, *extra])


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"TLS {what} file {path!r} cannot be read: {exc.strerror or exc}") from None


def _certificates(data: bytes, path: str, what: str) -> list:
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise ValueError(f"TLS {what} file {path!r} holds no PEM certificate")
    return certs
