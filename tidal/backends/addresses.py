"""Which address a machine's workers are reached at, and which interface holds it.

Gloo and NCCL bind the address of an interface: ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` name it; without them gloo binds what the hostname resolves to, often
127.0.1.1 (Debian's ``/etc/hosts``) or an address of another network, which peers on other
machines cannot reach. A host that joins a job binds the address its route to the
coordinator leaves from: the network the job's other machines share.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from pathlib import Path

_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def route_source(host: str, port: int) -> str:
    """The local address this machine's route to ``host:port`` leaves from (a connected UDP
    socket: the kernel picks the route, no packet is sent). ``OSError`` when there is none
    (the name does not resolve, no route)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _ipv4_interfaces() -> dict[str, str]:
    """Interface name -> its primary IPv4 address."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:  # no IPv4 address
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def _ipv6_interfaces() -> dict[str, str]:
    """IPv6 address (compressed) -> the interface that holds it (``/proc/net/if_inet6``)."""
    found = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split()
        if len(parts) == 6 and len(parts[0]) == 32:
            found[str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))] = parts[5]
    return found


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds ``address``, None if none does."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return None
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    return next((name for name, a in _ipv4_interfaces().items() if a == str(ip)), None)


def socket_env(address: str, env: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` naming the interface of
    ``address``, each only where ``env`` (the worker's environment) does not set it already:
    a user's choice wins. Empty when no interface holds ``address``."""
    iface = interface_of(address)
    if iface is None:
        return {}
    return {var: iface for var in SOCKET_IFNAME_VARS if var not in env}
