"""UDP sockets and addresses for the OSC bridge: a large receive buffer, host lookups, loopback checks."""

from __future__ import annotations

import logging
import socket
import sys

log = logging.getLogger("flowjam.osc")

_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33 if sys.platform.startswith("linux") else None)

Address = tuple[str, int]


def set_receive_buffer(sock: socket.socket, size_bytes: int) -> int:
    """Ask for the buffer; root may exceed net.core.rmem_max. Returns what the kernel granted."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size_bytes)
    granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)  # Linux reports double the asked size
    if granted < size_bytes and _SO_RCVBUFFORCE is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, size_bytes)
            granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        except OSError:
            pass
    if granted < size_bytes:
        log.warning(
            "OSC receive buffer is %d bytes, not the %d asked for: bursts may lose messages (raise net.core.rmem_max)",
            granted,
            size_bytes,
        )
    return granted


def resolve(address: tuple[str, int], family: int, setting: str) -> Address:
    return lookup(*address, setting, family=family)[0][4][:2]


def resolve_hosts(hosts: tuple[str, ...] | None, setting: str) -> frozenset[str] | None:
    if hosts is None:
        return None
    return frozenset(info[4][0] for host in hosts for info in lookup(host, None, setting))


def lookup(host: str, port: int | None, setting: str, family: int = 0) -> list:
    """getaddrinfo for a UDP socket; a host that is no address and no name this machine can look up is a
    ValueError naming `setting` (what the user set it with: a flag, a node input) and the fix."""
    try:
        return socket.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM)
    except socket.gaierror as error:
        if host.replace(".", "").isdigit():
            why = "is not an IPv4 address (four numbers 0..255)"
        else:
            why = f"does not resolve ({error.strerror or error})"
        raise ValueError(
            f"{setting} {host!r} {why}; give an address such as 127.0.0.1, or a name this machine can look up"
        ) from None


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host == "::1"


def show(address: Address) -> str:
    return f"{address[0]}:{address[1]}"
