"""Credentials for the HTTP endpoints the gates and metrics providers call: read from files or environment variables.

A `CredentialsSource` says where credentials are: file paths and environment-variable names, never values, so it is
safe to log and to pass in a Job's arguments. The operator mounts a Secret as a volume (`from_secret_dir` reads the
usual keys: `token`, `username`/`password`, `ca.crt`, `tls.crt`/`tls.key`) or sets env vars from it. `open()` checks
everything once and gives `Credentials`, which re-reads token and password files on each request, as Prometheus does
for its `credentials_file`, so a rotated Secret is picked up without a restart. Secret values exist only in the
request headers; errors name the file or variable, never what is in it.
"""

from __future__ import annotations

import base64
import contextlib
import os
import ssl
import tempfile
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, SecretStr, model_validator

TOKEN_KEY = "token"
USERNAME_KEY = "username"
PASSWORD_KEY = "password"
CA_KEY = "ca.crt"
CERT_KEY = "tls.crt"
KEY_KEY = "tls.key"


class CredentialsError(ValueError):
    """A credential cannot be read or used; the message names where it was looked for, never its value."""


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SecretValue(_Source):
    """Where one secret value is: a file (a key of a mounted Secret), an environment variable, or held in memory
    (`value`, as the operator reads it from a Kubernetes Secret; `origin` names that Secret key in messages)."""

    file: Path | None = None
    env: str | None = None
    value: SecretStr | None = None  # shown as '**********' by repr and str
    origin: str = "a value given in memory"

    @model_validator(mode="after")
    def _one_place(self) -> Self:
        if sum(place is not None for place in (self.file, self.env, self.value)) != 1:
            raise ValueError("a secret value comes from exactly one of a file, an environment variable or a value")
        return self

    def describe(self) -> str:
        if self.file is not None:
            return f"file {self.file}"
        return f"environment variable {self.env}" if self.env is not None else self.origin

    def read(self, what: str) -> str:
        """The value, without the trailing newline secret files often end with."""
        if self.file is not None:
            try:
                value = self.file.read_text().rstrip("\r\n")
            except OSError as error:
                raise CredentialsError(f"cannot read the {what} from {self.describe()}: {error.strerror}") from None
            except UnicodeDecodeError:
                raise CredentialsError(f"the {what} in {self.describe()} is not UTF-8 text") from None
        elif self.env is not None:
            value = os.environ.get(self.env, "")
        else:
            value = self.value.get_secret_value().rstrip("\r\n") if self.value is not None else ""
        if not value:
            raise CredentialsError(f"the {what} in {self.describe()} is empty or missing")
        if any(char in value for char in "\r\n\0"):
            raise CredentialsError(f"the {what} in {self.describe()} holds a line break; give a single line")
        return value


class TlsSource(_Source):
    """TLS for https endpoints: a CA bundle to trust (default: the system's), an optional client certificate."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    insecure_skip_verify: bool = False

    @model_validator(mode="after")
    def _cert_with_key(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both its certificate file and its key file")
        return self

    def context(self) -> ssl.SSLContext:
        for what, path in (("CA bundle", self.ca_file), ("client certificate", self.cert_file)):
            if path is not None and not path.is_file():
                raise CredentialsError(f"the {what} file {path} does not exist")
        try:
            context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        except (ssl.SSLError, OSError, ValueError):
            raise CredentialsError(f"the CA bundle {self.ca_file} holds no PEM certificate") from None
        if self.insecure_skip_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_file is not None and self.key_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError):
                raise CredentialsError(
                    f"the client certificate {self.cert_file} and key {self.key_file} are not a PEM pair that matches"
                ) from None
        return context


def tls_context_from_pem(
    ca_pem: str | None,
    cert_pem: str | None,
    key_pem: SecretStr | None,
    insecure_skip_verify: bool,
    where: dict[str, str],
) -> ssl.SSLContext:
    """A TLS context from PEM text held in memory (as the operator reads it from Secrets and ConfigMaps): `ca_pem`
    to trust (None: the system's CAs), an optional client certificate and key. `where` names each part's origin
    ("ca", "cert", "key") for messages. The client pair goes through files in a private temporary directory, since
    Python's ssl loads a certificate chain only from files; they are removed at once."""
    try:
        context = ssl.create_default_context(cadata=ca_pem) if ca_pem else ssl.create_default_context()
    except (ssl.SSLError, ValueError):
        raise CredentialsError(f"the CA bundle in {where.get('ca')} holds no PEM certificate") from None
    if insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert_pem is not None and key_pem is not None:
        with tempfile.TemporaryDirectory(prefix="kvpolicy-tls-") as directory:  # mode 0700
            cert_file, key_file = Path(directory) / "tls.crt", Path(directory) / "tls.key"
            cert_file.write_text(cert_pem)
            key_file.touch(mode=0o600)
            key_file.write_text(key_pem.get_secret_value())
            try:
                context.load_cert_chain(cert_file, key_file)
            except (ssl.SSLError, OSError):
                raise CredentialsError(
                    f"the client certificate in {where.get('cert')} and the key in {where.get('key')} are not a PEM "
                    "pair that matches"
                ) from None
    return context


class CredentialsSource(_Source):
    """Where an endpoint's credentials are: a bearer token (or vLLM API key), or basic auth; extra headers (not
    secret: a tenant such as X-Scope-OrgID); TLS settings."""

    bearer_token: SecretValue | None = None
    username: SecretValue | None = None
    password: SecretValue | None = None
    headers: dict[str, str] = {}
    secret_headers: dict[str, SecretValue] = {}  # headers whose values are secret (an API key header, say)
    tls: TlsSource = TlsSource()

    @model_validator(mode="after")
    def _one_scheme(self) -> Self:
        if (self.username is None) != (self.password is None):
            raise ValueError("basic auth needs both a username and a password")
        if self.bearer_token is not None and self.username is not None:
            raise ValueError("give a bearer token or basic auth, not both")
        if any(name.lower() == "authorization" for name in (*self.headers, *self.secret_headers)):
            raise ValueError("the Authorization header comes from the bearer token or basic auth, not from headers")
        return self

    @classmethod
    def from_secret_dir(
        cls, directory: Path, headers: dict[str, str] | None = None, insecure_skip_verify: bool = False
    ) -> Self:
        """The credentials a mounted Secret holds, by its keys: `token` (bearer), `username` and `password` (basic),
        `ca.crt`, `tls.crt` and `tls.key`; keys that are absent are not used."""
        if not directory.is_dir():
            raise CredentialsError(f"the credentials directory {directory} does not exist")

        def present(key: str) -> Path | None:
            path = directory / key
            return path if path.is_file() else None

        def secret(key: str) -> SecretValue | None:
            path = present(key)
            return SecretValue(file=path) if path else None

        return cls(
            bearer_token=secret(TOKEN_KEY),
            username=secret(USERNAME_KEY),
            password=secret(PASSWORD_KEY),
            headers=headers or {},
            tls=TlsSource(
                ca_file=present(CA_KEY),
                cert_file=present(CERT_KEY),
                key_file=present(KEY_KEY),
                insecure_skip_verify=insecure_skip_verify,
            ),
        )

    def open(self) -> Credentials:
        """Check that every credential can be read and build the TLS context; CredentialsError says what is wrong."""
        credentials = Credentials(self, self.tls.context())
        credentials.headers()
        return credentials


class Credentials:
    """Opened credentials: request headers (secrets re-read on each call) and the TLS context."""

    def __init__(self, source: CredentialsSource, ssl_context: ssl.SSLContext) -> None:
        self.source = source
        self.ssl_context = ssl_context

    def headers(self) -> dict[str, str]:
        """Headers for one request, the Authorization header included; CredentialsError when a secret is gone."""
        headers = dict(self.source.headers)
        for name, secret in self.source.secret_headers.items():
            headers[name] = secret.read(f"value of header {name}")
        if self.source.bearer_token is not None:
            headers["Authorization"] = f"Bearer {self.source.bearer_token.read('bearer token')}"
        elif self.source.username is not None and self.source.password is not None:
            pair = f"{self.source.username.read('username')}:{self.source.password.read('password')}"
            headers["Authorization"] = f"Basic {base64.b64encode(pair.encode()).decode()}"
        return headers

    def redact(self, text: str) -> str:
        """`text` with every secret value (and its basic-auth encoding) replaced by `***`: for logging what a server
        answered, which may quote the credentials it was sent."""
        for value in self._secret_values():
            text = text.replace(value, "***")
        return text

    def _secret_values(self) -> list[str]:
        values = []
        for secret in (self.source.bearer_token, self.source.password, *self.source.secret_headers.values()):
            if secret is not None:
                with contextlib.suppress(CredentialsError):
                    values.append(secret.read("secret"))
        with contextlib.suppress(CredentialsError):
            values.append(self.headers().get("Authorization", "").partition(" ")[2])  # basic auth's base64
        return [value for value in values if value]

    def __repr__(self) -> str:
        return f"Credentials({self.source!r})"
