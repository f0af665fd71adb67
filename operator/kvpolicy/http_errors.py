"""What an HTTP failure may say where users see it (status, events, a gate's result): the status code, fixed phrases
and the client's own view of the connection, never the response body. The endpoint may be anything the caller can
reach, and its body is the endpoint's to disclose, not ours.
"""

from __future__ import annotations

from http import HTTPStatus
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from kvpolicy.credentials import Credentials


def status_text(status: int) -> str:
    """`HTTP 401 Unauthorized`: the status code and its standard phrase, never anything the server sent."""
    try:
        return f"HTTP {status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


def auth_hint(status: int, credentials: Credentials | None) -> str:
    """What to check after a 401/403, from what was sent (nothing about the secret itself)."""
    if status not in (HTTPStatus.UNAUTHORIZED, HTTPStatus.FORBIDDEN):
        return ""
    sent = credentials is not None and (
        credentials.source.bearer_token is not None or credentials.source.username is not None
    )
    return "; the credentials sent were refused" if sent else "; it wants credentials and none were given"


def connection_problem(error: aiohttp.ClientError) -> str:
    """Why a request got no answer, in the client's own words: a connection error says what the socket saw (refused,
    no such host, certificate not trusted); anything else (a cut-off or malformed answer) only its kind, since its text
    may quote what the server sent."""
    if isinstance(error, aiohttp.ClientConnectorCertificateError):
        reason = getattr(error.certificate_error, "verify_message", None) or "verify failed"
        return f"its TLS certificate is not trusted ({reason})"
    if isinstance(error, aiohttp.ClientSSLError):
        return f"TLS failed ({getattr(error.os_error, 'reason', None) or type(error).__name__})"
    if isinstance(error, aiohttp.ClientConnectorError):
        return error.os_error.strerror or type(error.os_error).__name__
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without an answer"
    if isinstance(error, aiohttp.ClientOSError) and error.strerror:
        return error.strerror  # the local socket or TLS library's words (e.g. a TLS alert: certificate required)
    return type(error).__name__


def redact_url(url: str) -> str:
    """The URL without any user:password@ part, for messages and logs."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
