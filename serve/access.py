"""Who may reach a served session, as pure checks the gateway applies to every request: a token per session (only
its creator holds it), a server key for creating and listing, the Host and Origin checks that keep web pages out,
and the size limits of what a client sends. Tokens are kept as SHA-256 digests, never written to a log."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

TOKEN_BYTES = 32  # 256 bits of randomness per session token
MAX_BODY_BYTES = 16 * 1024  # a knob set or a prompt is a few hundred bytes; a create body a few kB
MAX_MESSAGE_BYTES = 16 * 1024  # a WebSocket control message: the same
KEY_ENV = "FLOWJAM_SERVE_KEY"  # the server key, when not in a --key-file
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class AccessDenied(Exception):
    """A request refused by the access rules: 401 when it lacks a credential, 403 when the one it has is wrong or
    the request comes from where it may not (a foreign Host or Origin)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_key(key_file: Path | None) -> str | None:
    """The server key from `key_file` (its first line) or the FLOWJAM_SERVE_KEY environment variable; None if
    neither is set. ValueError, naming the fix, for an unreadable or empty file or a key too short to guess at."""
    if key_file is not None:
        try:
            lines = key_file.expanduser().read_text().splitlines()
        except OSError as error:
            raise ValueError(f"--key-file {key_file}: {error.strerror or error}; point it at a readable file") from None
        key = lines[0].strip() if lines else ""
        where = f"--key-file {key_file}"
    else:
        key = os.environ.get(KEY_ENV, "").strip()
        where = KEY_ENV
        if not key:
            return None
    if len(key) < 16:
        raise ValueError(
            f"{where} holds a key of {len(key)} characters; use at least 16 random ones, e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))' > serve.key`"
        )
    return key


def own_host_names(bind_host: str) -> frozenset[str]:
    """The names a client may put in the Host header of a server bound to `bind_host`: loopback names, the bound
    address, and for a wildcard bind this machine's hostname and addresses."""
    names = {*LOOPBACK_NAMES, bind_host.strip("[]")}
    if bind_host in ("0.0.0.0", "::", ""):
        hostname = socket.gethostname()
        names |= {hostname, socket.getfqdn()}
        try:
            names |= {info[4][0] for info in socket.getaddrinfo(hostname, None)}
        except socket.gaierror:
            pass
    return frozenset(name.lower() for name in names if name)


@dataclass(frozen=True)
class AccessPolicy:
    """The rules of one server. `key`: needed to create and list sessions (None: anyone who passes the Host and
    Origin checks may create; nobody lists). `hosts`: Host header names accepted (without port). `origins`: browser
    origins let in (none by default: native clients send no Origin)."""

    key: str | None = None
    hosts: frozenset[str] = frozenset(LOOPBACK_NAMES)
    origins: frozenset[str] = frozenset()
    max_body_bytes: int = MAX_BODY_BYTES
    max_message_bytes: int = MAX_MESSAGE_BYTES

    @staticmethod
    def for_server(
        bind_host: str, key: str | None, extra_hosts: tuple[str, ...] = (), origins: tuple[str, ...] = ()
    ) -> AccessPolicy:
        """The policy of a server bound to `bind_host`; ValueError, with the fix, for a non-loopback bind without a
        key (anyone on the network could then create sessions)."""
        if key is None and not is_loopback(bind_host):
            raise ValueError(
                f"--host {bind_host} reaches beyond this machine, so creating sessions needs a server key: pass "
                f"--key-file FILE (or set {KEY_ENV}), or bind --host 127.0.0.1"
            )
        hosts = own_host_names(bind_host) | {host.lower() for host in extra_hosts}
        return AccessPolicy(key, hosts, frozenset(origin.rstrip("/").lower() for origin in origins))

    def check_host(self, host_header: str | None) -> None:
        """403 unless the Host header names this server (a DNS-rebinding page sends its own name)."""
        name = _host_name(host_header or "")
        if name not in self.hosts:
            raise AccessDenied(
                403, f"Host {host_header!r} is not this server's name; add it with --allow-host if it should be"
            )

    def check_origin(self, origin: str | None) -> None:
        """403 for a browser page from an origin not let in (native clients send no Origin)."""
        if origin is not None and origin.rstrip("/").lower() not in self.origins:
            raise AccessDenied(403, f"Origin {origin!r} is not allowed; add it with --allow-origin if it should be")

    def check_key(self, presented: str | None) -> None:
        """401/403 unless `presented` is the server key (or no key is configured)."""
        if self.key is None:
            return
        if presented is None:
            raise AccessDenied(401, "this call needs the server key: send Authorization: Bearer <key>")
        if not secrets.compare_digest(presented.encode(), self.key.encode()):
            raise AccessDenied(403, "the server key does not match")

    @property
    def lists_sessions(self) -> bool:
        """Whether GET /sessions may list anything: only to the key's holder, so never without a key."""
        return self.key is not None


@dataclass
class SessionTokens:
    """The digest of each session's token, by session name. A wrong token and an unknown session get the same
    answer, so no response tells a stranger which names exist."""

    digests: dict[str, str] = field(default_factory=dict)

    def issue(self, session: str) -> str:
        token = new_token()
        self.digests[session] = digest(token)
        return token

    def forget(self, session: str) -> None:
        self.digests.pop(session, None)

    def check(self, session: str, presented: str | None) -> None:
        if presented is None:
            raise AccessDenied(
                401, "this call needs the session's token: send Authorization: Bearer <token> (creating it returned it)"
            )
        expected = self.digests.get(session)
        if expected is None or not secrets.compare_digest(digest(presented), expected):
            raise AccessDenied(403, "no session of that name opens with this token")


def bearer(authorization: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <secret>` header, else None."""
    if authorization is None:
        return None
    scheme, _, credential = authorization.strip().partition(" ")
    return credential.strip() or None if scheme.lower() == "bearer" else None


def _host_name(host_header: str) -> str:
    """The name of a Host header without its port: "example.com:8765" -> "example.com", "[::1]:80" -> "::1"."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
