"""TLS and mutual TLS for every gRPC hop, certificates re-read when renewed on disk, identities checked per RPC.

``--tls-mode off|tls|mtls`` with ``--tls-cert``, ``--tls-key`` and ``--tls-ca``
(PEM files) on every service. ``tls``: servers present their certificate,
clients verify it against the CA. ``mtls``: clients present theirs too, and
servers refuse a peer the CA did not sign, then check its identity (its
``spiffe://tokenmesh/<role>`` URI SAN) against the RPC group it calls
(:data:`ALLOWED`): ``Control/*`` only from the prober (and sibling routers),
``Worker/*`` only from routers and the prober, ``Inference`` from any
identity the CA signed (or those of ``--tls-allowed-clients``).

Rotation without restart: servers use gRPC's dynamic server credentials,
whose fetcher runs at every new handshake and hands over the files' new
contents once they changed on disk (cert-manager renews in place); clients
build each new channel from the files as they are then (:meth:`Tls.channel`).
Connections already open, and the streams on them, keep the certificate they
were made with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tokenmesh.config import ConfigError, check, setting
from tokenmesh.errors import PermissionDenied
from tokenmesh.tracing import Tracing, traced_channel

log = logging.getLogger(__name__)

MODES = ("off", "tls", "mtls")
RENEWAL_POLL_S = 10.0
"""How often a service looks whether its certificate files were renewed (:meth:`Tls.renewals`)."""
SPIFFE_PREFIX = "spiffe://tokenmesh/"

ALLOWED: dict[str, frozenset[str] | None] = {
    "/tokenmesh.v1.Control/": frozenset({"prober"}),
    "/tokenmesh.v1.Worker/": frozenset({"router", "prober"}),
    "/tokenmesh.v1.Inference/": None,
    "/tokenmesh.v1.Router/": None,
    "/grpc.health.v1.Health/": None,
    "/grpc.reflection.v1alpha.ServerReflection/": None,
}
"""The roles each RPC group accepts (None: any identity the CA signed). A method in no group is refused.

A router run as several processes also takes ``Control`` from the router identity: its siblings pass each
table on. A router run as one process has no siblings, and refuses it: another router pushing it weights
is someone else's router."""


@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """TLS settings every service shares (flags ``--tls-*``, env ``TOKENMESH_<SERVICE>_TLS_*``)."""

    tls_mode: str = setting(
        "off",
        "off, tls (servers present a certificate, clients verify it) or mtls (both "
        "sides do; servers check the peer's identity per RPC group)",
    )
    tls_cert: str = setting("", "this service's certificate (PEM), served and presented to peers")
    tls_key: str = setting("", "the private key of --tls-cert (PEM)")
    tls_ca: str = setting("", "the CA bundle (PEM) that peers' certificates must chain to")
    tls_server_name: str = setting(
        "",
        "the name to verify in the certificates of the servers this service "
        "calls; empty = the host of each address (an IP needs an IP SAN)",
    )

    def check_tls(self) -> None:
        """Validate the mode and that every file it needs is a readable PEM that fits (ConfigError names it)."""
        check(self.tls_mode in MODES, f"tls_mode must be one of {', '.join(MODES)}, got {self.tls_mode!r}")
        if self.tls_mode == "off":
            return
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            check(bool(path), f"--tls-mode {self.tls_mode} needs {flag}")
            try:
                Path(path).read_bytes()
            except OSError as exc:
                raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
        cert = _load(self.tls_cert, "--tls-cert", x509.load_pem_x509_certificate)
        key = _load(self.tls_key, "--tls-key", lambda data: serialization.load_pem_private_key(data, password=None))
        _load(self.tls_ca, "--tls-ca", x509.load_pem_x509_certificates)
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        pem = serialization.Encoding.PEM
        check(
            cert.public_key().public_bytes(pem, public) == key.public_key().public_bytes(pem, public),
            f"--tls-key {self.tls_key} is not the key of --tls-cert {self.tls_cert}",
        )


def _load(path: str, flag: str, parse: Any) -> Any:
    try:
        return parse(Path(path).read_bytes())
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{flag} {path}: not a PEM file of that kind ({exc})") from None


def open_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: tuple[tuple[str, Any], ...] = (),
    tracing: Tracing | None = None,
) -> grpc.aio.Channel:
    """A channel to address: plaintext without credentials, else TLS (every channel to a mesh peer opens here).

    With tracing on, each call on it gets an RPC span (:func:`tokenmesh.tracing.traced_channel`); the channel
    has no grpc.aio interceptor, on or off.
    """
    if credentials is None:
        channel = grpc.aio.insecure_channel(address, options=options)
    else:
        channel = grpc.aio.secure_channel(address, credentials, options=options)
    return traced_channel(tracing, channel, address)


class Tls:
    """One service's TLS: its server credentials, the channels it opens, the identity check of its server.

    Args:
        settings: the service's ``--tls-*`` settings (checked already).
        allowed_clients: with mtls, the identities ``Inference`` accepts (empty: any the CA signed).
        siblings: this router runs as several processes, which pass weight tables on to each other.
        tracing: the service's tracing: while on, every call on the channels it opens gets an RPC span.

    """

    mode: str
    denied: Callable[[str], None]
    """Told the RPC group of each refused call (the service counts them in its metrics)."""
    _settings: TlsSettings
    _allowed_clients: frozenset[str]
    _siblings: bool
    _seen: tuple[bytes, bytes, bytes] | None
    """The certificate files as :meth:`files_changed` last saw them."""
    _tracing: Tracing | None

    def __init__(
        self,
        settings: TlsSettings,
        allowed_clients: tuple[str, ...] = (),
        *,
        siblings: bool = False,
        tracing: Tracing | None = None,
    ) -> None:
        self.mode = settings.tls_mode
        self._tracing = tracing
        self._siblings = siblings
        self._settings = settings
        self._allowed_clients = frozenset(allowed_clients)
        self.denied = lambda group: None
        self._seen = None

    @property
    def on(self) -> bool:
        """Whether connections are TLS."""
        return self.mode != "off"

    def files_changed(self) -> bool:
        """Whether the certificate files differ from when this was last asked (first call: False)."""
        if not self.on:
            return False
        try:
            now = self._files()
        except OSError:  # half-written by the renewer: ask again later
            return False
        seen, self._seen = self._seen, now
        return seen is not None and now != seen

    async def renewals(self) -> AsyncIterator[None]:
        """Once per renewal of the certificate files, forever (they are looked at every RENEWAL_POLL_S)."""
        self.files_changed()  # what is on disk now is not a renewal
        while True:
            await asyncio.sleep(RENEWAL_POLL_S)
            if self.files_changed():
                yield

    def _files(self) -> tuple[bytes, bytes, bytes]:
        s = self._settings
        return Path(s.tls_cert).read_bytes(), Path(s.tls_key).read_bytes(), Path(s.tls_ca).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose certificate follows the files on disk (re-read at a handshake after they changed)."""
        cert, key, ca = self._files()
        mutual = self.mode == "mtls"
        current = [(cert, key, ca)]

        def configuration(cert: bytes, key: bytes, ca: bytes) -> Any:
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca if mutual else None)

        def fetch() -> Any:
            try:
                files = self._files()
            except OSError:  # half-written by the renewer: keep the one in force, look again next handshake
                return None
            if files == current[0]:
                return None
            current[0] = files
            log.info("TLS certificate files changed: new connections get the renewed certificate")
            return configuration(*files)

        return grpc.dynamic_ssl_server_credentials(
            configuration(cert, key, ca), fetch, require_client_authentication=mutual
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Client credentials from the files as they are now (None while TLS is off).

        The CA verifies servers; with mtls this service's certificate is presented too.
        """
        if not self.on:
            return None
        cert, key, ca = self._files()
        return grpc.ssl_channel_credentials(ca, key, cert) if self.mode == "mtls" else grpc.ssl_channel_credentials(ca)

    def channel(self, address: str, options: tuple[tuple[str, Any], ...] = ()) -> grpc.aio.Channel:
        """A channel to address: plaintext, or TLS from the files as they are now (renewed ones included)."""
        credentials = self.credentials()
        if credentials is not None and self._settings.tls_server_name:
            options = (*options, ("grpc.ssl_target_name_override", self._settings.tls_server_name))
        return open_channel(address, credentials, options, self._tracing)

    def authorize(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Raise PermissionDenied unless the peer's identity may call method (mtls only; otherwise a no-op)."""
        if self.mode != "mtls":
            return
        uris = [u.decode() for u in context.auth_context().get("peer_uri", [])]
        roles = {u.removeprefix(SPIFFE_PREFIX) for u in uris if u.startswith(SPIFFE_PREFIX)}
        group = next((g for g in ALLOWED if method.startswith(g)), None)
        shown = ", ".join(uris) or "no URI SAN"
        if group is None:
            self.denied("unknown")
            raise PermissionDenied(f"{method} is not served to peers ({shown})")
        allowed = ALLOWED[group]
        if group == "/tokenmesh.v1.Control/" and self._siblings:
            allowed = frozenset({"prober", "router"})
        label = group.strip("/").removeprefix("tokenmesh.v1.")
        if group == "/tokenmesh.v1.Inference/" and self._allowed_clients:
            if not set(uris) & self._allowed_clients:
                self.denied(label)
                raise PermissionDenied(f"identity {shown} may not call {method}: not in --tls-allowed-clients")
            return
        if allowed is not None and not roles & allowed:
            self.denied(label)
            wanted = ", ".join(SPIFFE_PREFIX + r for r in sorted(allowed))
            raise PermissionDenied(f"identity {shown} may not call {method}; it takes {wanted}")
