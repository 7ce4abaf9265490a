"""Who may read a coordinator's answers: the decision and the credential check.

Mutating calls always need a token (``tidal.host.server``). Reads (``GET /status``,
``/metrics``, the dashboard's pages and JSON) are open while the server binds a loopback
address, where only this machine's users reach it (the CLI's ``tidal status`` included). Once
it binds anything else (the Ray backend binds the node's cluster address; ``0.0.0.0`` binds
them all) anyone on the network could read the job, so every read needs the job's token too.
Pure functions: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import secrets


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine: ``localhost`` or an address
    of 127.0.0.0/8 or ::1 (IPv4-mapped included). A name other than ``localhost``, ``""``
    and the wildcards ``0.0.0.0``/``::`` may be reached from elsewhere, so they are not."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False  # a host name: it may resolve to any interface
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def reads_need_token(host: str) -> bool:
    """Whether a server bound to ``host`` must ask the job's token of every read."""
    return not is_loopback(host)


def bearer_ok(authorization: str | None, token: str) -> bool:
    """``Authorization: Bearer TOKEN`` (what the CLI, workers and Prometheus send)."""
    return authorization is not None and secrets.compare_digest(
        authorization.encode(), f"Bearer {token}".encode()
    )


def read_ok(authorization: str | None, token: str) -> bool:
    """A read's credential: ``Bearer TOKEN``, or HTTP Basic with the token as the password
    (any user name), which is what a browser asks for and then sends with every request of
    the dashboard's pages. Only reads take Basic: a browser sends cached Basic credentials
    on its own, so a mutating call taking them could be forged by another web page."""
    if bearer_ok(authorization, token):
        return True
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return False
    _, sep, password = decoded.partition(":")
    return bool(sep) and secrets.compare_digest(password.encode(), token.encode())
