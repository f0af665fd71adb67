"""Credentials read from files (a mounted Secret) or environment variables: every failure names where it looked,
never what it found."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from auth_proxy import Pki
from kvpolicy.credentials import CredentialsError, CredentialsSource, SecretValue, TlsSource
from kvpolicy.http_errors import redact_url

SECRET = "s3cret-value-never-shown"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


def test_a_secret_dir_gives_the_keys_it_holds(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(SECRET + "\n")
    (tmp_path / "ca.crt").write_bytes(pki.ca_cert.read_bytes())
    source = CredentialsSource.from_secret_dir(tmp_path, headers={"X-Scope-OrgID": "t1"})
    assert source.bearer_token == SecretValue(file=tmp_path / "token")
    assert source.tls.ca_file == tmp_path / "ca.crt" and source.tls.cert_file is None and source.username is None
    credentials = source.open()
    # The trailing newline of a Secret file is not part of the token.
    assert credentials.headers() == {"X-Scope-OrgID": "t1", "Authorization": f"Bearer {SECRET}"}
    assert SECRET not in repr(credentials) and SECRET not in repr(source) and SECRET not in str(source)


def test_basic_auth_from_files_and_a_token_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "username").write_text("kvpolicy")
    (tmp_path / "password").write_text(SECRET)
    basic = CredentialsSource.from_secret_dir(tmp_path).open().headers()["Authorization"]
    assert basic == "Basic " + base64.b64encode(f"kvpolicy:{SECRET}".encode()).decode()
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    from_env = CredentialsSource(bearer_token=SecretValue(env="VLLM_API_KEY")).open()
    assert from_env.headers() == {"Authorization": f"Bearer {SECRET}"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the bearer token from file {file}: No such file or directory"),
        ("", "the bearer token in file {file} is empty or missing"),
        (f"{SECRET}\nsecond line", "the bearer token in file {file} holds a line break; give a single line"),
        (b"\xff\xfe", "the bearer token in file {file} is not UTF-8 text"),
    ],
)
def test_an_unreadable_token_file_names_the_file_not_the_content(
    content: str | bytes | None, message: str, tmp_path: Path
) -> None:
    file = tmp_path / "token"
    if isinstance(content, bytes):
        file.write_bytes(content)
    elif content is not None:
        file.write_text(content)
    with pytest.raises(CredentialsError) as raised:
        CredentialsSource(bearer_token=SecretValue(file=file)).open()
    assert str(raised.value) == message.format(file=file)
    assert SECRET not in str(raised.value)


def test_an_unset_variable_is_named() -> None:
    with pytest.raises(CredentialsError, match="the bearer token in environment variable KVPOLICY_UNSET_VAR is empty"):
        CredentialsSource(bearer_token=SecretValue(env="KVPOLICY_UNSET_VAR")).open()


def test_a_secret_deleted_after_opening_is_reported_on_the_next_request(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(SECRET)
    credentials = CredentialsSource.from_secret_dir(tmp_path).open()
    (tmp_path / "token").unlink()
    with pytest.raises(CredentialsError, match="cannot read the bearer token"):
        credentials.headers()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bearer_token": {"file": "a", "env": "B"}}, "exactly one of a file, an environment variable or a value"),
        ({"bearer_token": {}}, "exactly one of a file, an environment variable or a value"),
        ({"username": {"env": "U"}}, "basic auth needs both a username and a password"),
        (
            {"bearer_token": {"env": "T"}, "username": {"env": "U"}, "password": {"env": "P"}},
            "a bearer token or basic auth, not both",
        ),
        ({"headers": {"authorization": "Bearer x"}}, "the Authorization header comes from the bearer token"),
        ({"tls": {"cert_file": "tls.crt"}}, "needs both its certificate file and its key file"),
    ],
)
def test_contradictory_sources_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CredentialsSource.model_validate(kwargs)


def test_tls_files_that_are_missing_not_pem_or_mismatched_are_named(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match=f"the CA bundle file {tmp_path / 'none.crt'} does not exist"):
        TlsSource(ca_file=tmp_path / "none.crt").context()
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate")
    with pytest.raises(CredentialsError, match=f"the CA bundle {garbage} holds no PEM certificate"):
        TlsSource(ca_file=garbage).context()
    with pytest.raises(CredentialsError, match="are not a PEM pair that matches"):
        TlsSource(cert_file=pki.client_cert, key_file=pki.server_key).context()
    with pytest.raises(CredentialsError, match=f"the credentials directory {tmp_path / 'absent'} does not exist"):
        CredentialsSource.from_secret_dir(tmp_path / "absent")


def test_urls_lose_their_userinfo_in_messages() -> None:
    assert redact_url("https://admin:hunter2@prom.example:9090/api") == "https://prom.example:9090/api"
    assert redact_url("http://[::1]:9090") == "http://[::1]:9090"
    assert redact_url("http://token@[::1]:9090/x?y=1") == "http://[::1]:9090/x?y=1"
