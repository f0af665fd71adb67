"""An authenticating TLS reverse proxy on loopback, as real endpoints sit behind (oauth-proxy in front of OpenShift's
thanos-querier, a Mimir gateway wanting X-Scope-OrgID, an ingress with a private CA), and a throwaway PKI for it.

The proxy refuses with a body that quotes the Authorization header it got and a marker, so a test can show that no
client ever copies a response body (or a secret echoed in one) into its messages.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

BODY_MARKER = "proxy-body-must-not-leak"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    usage: ExtendedKeyUsageOID | None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        # Key identifiers: the kubernetes client's in-cluster login verifies the chain strictly and wants them.
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    if usage is ExtendedKeyUsageOID.SERVER_AUTH:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate for 127.0.0.1/localhost, and a client certificate, both signed by it;
    and a second CA that signed nothing here (trusting it must fail)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path

    @classmethod
    def create(cls, directory: Path) -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        ca_key, other_key = _key(), _key()
        ca = _certificate("kvpolicy test CA", ca_key, None, ca_key, None)
        other = _certificate("some other CA", other_key, None, other_key, None)
        server_key, client_key = _key(), _key()
        server = _certificate("127.0.0.1", server_key, ca, ca_key, ExtendedKeyUsageOID.SERVER_AUTH)
        client = _certificate("kvpolicy", client_key, ca, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH)
        return cls(
            ca_cert=_write_cert(ca, directory / "ca.crt"),
            server_cert=_write_cert(server, directory / "server.crt"),
            server_key=_write_key(server_key, directory / "server.key"),
            client_cert=_write_cert(client, directory / "tls.crt"),
            client_key=_write_key(client_key, directory / "tls.key"),
            other_ca_cert=_write_cert(other, directory / "other-ca.crt"),
        )


class AuthProxy:
    """Forwards every request to `upstream` once it carries the expected Authorization and headers, over TLS that
    requires a client certificate from the PKI's CA when `require_client_cert`. `expected_authorization` may be
    changed while it runs (a rotated secret)."""

    def __init__(
        self,
        upstream: str,
        pki: Pki,
        expected_authorization: str | None,
        required_headers: dict[str, str] | None = None,
        require_client_cert: bool = True,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.pki = pki
        self.expected_authorization = expected_authorization
        self.required_headers = required_headers or {}
        self.require_client_cert = require_client_cert
        self.forwarded = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def _server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.pki.server_cert, self.pki.server_key)
        if self.require_client_cert:
            context.load_verify_locations(self.pki.ca_cert)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if self.expected_authorization is not None and given != self.expected_authorization:
            # A hostile body: it quotes what it got, secret included.
            return web.json_response({"error": f"{BODY_MARKER}: refused {given!r}"}, status=401)
        for name, value in self.required_headers.items():
            if request.headers.get(name) != value:
                return web.Response(status=400, text=f"{BODY_MARKER}: {name} must be {value!r}")
        assert self._session is not None
        headers = {name: value for name, value in request.headers.items() if name.lower() not in HOP_BY_HOP}
        headers.pop("Authorization", None)
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=await request.read()
        ) as upstream:
            body = await upstream.read()
            kept = {name: value for name, value in upstream.headers.items() if name.lower() not in HOP_BY_HOP}
            self.forwarded += 1
            return web.Response(status=upstream.status, body=body, headers=kept)

    async def start(self) -> str:
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=2**26)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._server_context())
        await site.start()
        self.url = f"https://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


def basic_authorization(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def prometheus_auth_spec(headers: dict[str, str]) -> dict[str, Any]:
    """A KVPolicy's gates.latency.prometheusAuth for this proxy: the bearer token in Secret `prometheus-reader` (key
    `token`), `headers` as plain values, and the PKI's CA and client pair in Secret `prometheus-client` (keys
    `ca.crt`, `tls.crt`, `tls.key`, as a kubernetes.io/tls Secret names them)."""
    client = "prometheus-client"
    return {
        "bearerTokenSecretRef": {"name": "prometheus-reader", "key": "token"},
        "headers": [{"name": name, "value": value} for name, value in headers.items()],
        "tls": {
            "ca": {"secret": {"name": client, "key": "ca.crt"}},
            "cert": {"secret": {"name": client, "key": "tls.crt"}},
            "keySecret": {"name": client, "key": "tls.key"},
        },
    }
