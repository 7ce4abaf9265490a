"""The TCP connections of one gloo group, so that the group can be cut off.

Shutting down a connection (``shutdown(SHUT_RDWR)``) fails, at once, every gloo operation
waiting on it at both ends ("Connection closed by peer"), and closes gloo's side of the pair:
nothing gloo still holds is read into this worker's memory after the cut. Two uses
(``group``): a member that left a failed generation cuts its group so that a peer blocked
on it learns at once rather than after the group's destructor, which first waits for this
member's own blocked collectives; and the abort watch cuts the group of a window it gave
up on (``waits``).

Which sockets: the TCP sockets (IPv4 or IPv6) that appeared in ``/proc/self/fd`` while the
group was made, connected (gloo's listener is left alone: gloo's accept loop aborts the
process on a shut-down listener, measured), minus any to a port named in ``exclude`` (the
coordinator's API and the store, whose clients another thread may open meanwhile). gloo
makes one connection per peer, so anything but ``expected`` of them means another thread
opened sockets meanwhile that cannot be told apart: then nothing is captured (a cut does
nothing; the group's own destruction still closes its connections). Each is held as a
duplicate descriptor, so a number gloo closes and the kernel reuses is never touched; the
duplicates are closed with the group (``close``), before gloo closes its own: a duplicate
left open would keep a connection open after the group is gone. Where ``/proc/self/fd``
does not exist (not Linux) nothing is captured.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

FD_DIR = "/proc/self/fd"


def open_sockets() -> set[int]:
    """The descriptors of this process that are sockets (empty where not readable)."""
    found = set()
    try:
        names = os.listdir(FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"{FD_DIR}/{name}").startswith("socket:"):
                found.add(int(name))
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
    return found


class Conns:
    """Duplicates of one group's connected TCP sockets (see the module doc)."""

    def __init__(self, socks: list[socket.socket]) -> None:
        self._socks = socks

    @classmethod
    def opened_since(cls, before: set[int], *, expected: int, exclude: Iterable[int] = ()) -> Conns:
        """The group's connections among the sockets opened since ``before`` (module doc)."""
        skip = set(exclude)
        kept = []
        for fd in sorted(open_sockets() - before):
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:  # closed meanwhile
                continue
            try:
                inet = sock.family in (socket.AF_INET, socket.AF_INET6)
                peer = sock.getpeername() if inet else None
            except OSError:  # a listener, or not connected
                peer = None
            if peer is None or sock.type != socket.SOCK_STREAM or peer[1] in skip:
                sock.close()
                continue
            kept.append(sock)
        if len(kept) != expected:
            for sock in kept:
                sock.close()
            kept = []
        return cls(kept)

    def __len__(self) -> int:
        return len(self._socks)

    def cut(self) -> None:
        """Shut every connection down (both directions); idempotent."""
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already shut, or reset by the peer
                pass

    def close(self) -> None:
        """Drop the duplicates (gloo's own descriptors keep the connections open)."""
        for sock in self._socks:
            sock.close()
        self._socks = []
