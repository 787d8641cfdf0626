"""Connection attempts from an address that holds its share of connections, dropped by the kernel.

A client that holds its share of connections (``max_connections_per_address``) and keeps
opening more, each reopened as soon as it is refused, would have the event loop accept and
close connections as fast as it can connect. A classic BPF socket filter on the listening
socket drops such an address's connection attempts (SYNs) in the kernel instead: they wait in
the client's SYN_SENT, retried by its own TCP after 1, 3, 7 ... seconds, and cost the server
nothing until one of the address's connections closes and the address is let through again.
Connections already open keep the filter of the moment they were accepted, which blocks
their own peer only in a rare race (a handshake that completed as its address was being
blocked); the header timeout closes such a connection.

Linux and IPv4 listeners only (the filter reads the IPv4 source address); elsewhere, or when
the filter cannot be attached, the refusal at accept applies alone
(:mod:`qswap.server.http.connections`).
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
import sys
from typing import Any

log = logging.getLogger("qswap.server")

SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000          # offsets from the network (IP) header
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_KEEP_ALL, _DROP = 0xFFFFFFFF, 0
#: Addresses dropped at most (two BPF instructions each; the kernel allows 4,096).
MAX_BLOCKED = 1024


def _program(blocked: list[int]) -> bytes:
    """The filter: load the IPv4 source; drop when it is one of ``blocked``; keep all else."""
    ins = [(_LD_W_ABS, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFFFFFF)]
    for k in blocked:
        ins += [(_JEQ_K, 0, 1, k), (_RET_K, 0, 0, _DROP)]
    ins.append((_RET_K, 0, 0, _KEEP_ALL))
    return b"".join(struct.pack("HBBI", *i) for i in ins)


def _attach(sock: Any, program: bytes) -> None:
    """Attach ``program`` to ``sock`` (the kernel copies it: the buffer need not outlive the call)."""
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


class SynFilter:
    """The addresses whose connection attempts the listening sockets drop (event loop only)."""

    def __init__(self) -> None:
        self._sockets: list[Any] = []
        self._blocked: dict[str, int] = {}   # address -> its IPv4 as an integer, in blocking order

    @property
    def active(self) -> bool:
        """Whether some listening socket carries the filter."""
        return bool(self._sockets)

    @property
    def blocked(self) -> list[str]:
        """The addresses dropped now."""
        return list(self._blocked)

    def watch(self, sock: Any) -> bool:
        """Filter a listening socket from now on.

        Args:
            sock: the listening socket (``asyncio.Server.sockets`` items will do).

        Returns:
            False (and nothing changed) when it cannot carry the filter: not Linux, not IPv4,
            or the kernel refused it.
        """
        if not sys.platform.startswith("linux") or sock.family != socket.AF_INET:
            return False
        try:
            _attach(sock, _program(list(self._blocked.values())))
        except OSError as e:
            log.warning("connection attempts over an address's share are refused at accept only",
                        extra={"reason": f"the listening socket's filter could not be attached: {e}"})
            return False
        self._sockets.append(sock)
        return True

    def block(self, address: str) -> None:
        """Drop ``address``'s connection attempts (IPv4 only; at most ``MAX_BLOCKED`` addresses)."""
        if not self._sockets or address in self._blocked or len(self._blocked) >= MAX_BLOCKED:
            return
        try:
            self._blocked[address] = struct.unpack("!I", socket.inet_aton(address))[0]
        except OSError:   # not an IPv4 address
            return
        self._apply()

    def unblock(self, address: str) -> None:
        """Let ``address``'s connection attempts through again."""
        if self._blocked.pop(address, None) is not None:
            self._apply()

    def _apply(self) -> None:
        program = _program(list(self._blocked.values()))
        for sock in list(self._sockets):
            try:
                _attach(sock, program)
            except OSError:   # the listener closed (shutdown): nothing left to filter
                self._sockets.remove(sock)


def watch_listeners(server: Any) -> int:
    """Put the connection protocol's filter on a started uvicorn server's listening sockets.

    Args:
        server: a started ``uvicorn.Server`` whose protocol is
            :func:`qswap.server.http.connections.guarded_protocol`'s.

    Returns:
        How many listening sockets carry it.
    """
    syn = getattr(server.config.http_protocol_class, "syn_filter", None)
    if syn is None:
        return 0
    return sum(syn.watch(sock) for srv in getattr(server, "servers", []) for sock in srv.sockets)


__all__ = ["MAX_BLOCKED", "SynFilter", "watch_listeners"]
