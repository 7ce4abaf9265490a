"""Authenticated values in a job's rendezvous store.

A ``TCPStore`` accepts any client that reaches its port, and any client can list, read and
overwrite every key (``TCPStore.list_keys``). So a value a member reads there (the
rendezvous state, the members' steps, the job's settings, and the addresses c10d's gloo and
NCCL publish to connect the process group) proves nothing about its writer: a client that
overwrote a generation's gloo address keys between their writing and their reading would
make the members connect to it and train on what it sends.

``AuthStore`` wraps a store so that every value written through it carries a tag,
HMAC-SHA256 keyed by the job's *store key* over the key's full name and the value
(``seal``), and every value read through it is checked and stripped (``unseal``): a value
whose tag is missing or wrong, one copied from another key included, raises
``ForgedValue`` naming the key, and is never returned. The store key is derived from the
job's token (``derive_key``, a one-way function: reading the store reveals neither); the
coordinator computes it and hands it to workers in their registration answer
(``WorkerConfig.store_key``), which only a holder of a worker credential receives. Every
member reads and writes the store through an ``AuthStore``, and passes it (under a
``PrefixStore``) to ``init_process_group``, so c10d's own connection keys are sealed too.

What it does not cover, by design (docs/reliability.md, "Threat model"):

- **Counters** (``add``): the store keeps them as integers, no tag fits. Tidal's counters
  (arrivals at a rendezvous, the change notice) only pace members: a forged count can make
  a member wait, wake early or fetch an answer from the authenticated API for nothing, and
  a rendezvous completed early still forms only with the generation's members, whose
  addresses are authenticated.
- **Existence** (``check``, ``wait``): they see that a key exists, not who wrote it; a
  value read after them is checked.
- **Denial of service and replay**: any client can delete or overwrite a key, or put back
  an older value of the same key. The members then refuse (``ForgedValue``) or time out,
  report it, and the coordinator re-forms (an event names the key); they never act on it.

Contract: writer and reader must share the store key and both use ``AuthStore``; a raw
client's value is refused. Values are bytes (a ``str`` is UTF-8 encoded, as c10d does).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import struct

import torch.distributed as dist

TAG_BYTES = 32  # HMAC-SHA256
_DOMAIN = b"tidal rendezvous store key v1"


def derive_key(job_token: str) -> str:
    """The job's store key (hex) from its token: HMAC-SHA256 keyed by the token over a
    fixed label, so neither the token nor a worker's credential can be read back from it."""
    return hmac.new(job_token.encode(), _DOMAIN, hashlib.sha256).hexdigest()


class ForgedValue(RuntimeError):
    """A value read from the store is not authenticated by the job's store key: written by
    a client that does not hold it (or altered, or copied from another key). ``key`` is
    the store key's full name. Not a ``DistError``: the store itself answered."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(
            f"refused store key {key!r}: its value is not authenticated by the job's key "
            "(written by a client of the store that does not hold the job's token)"
        )


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def tag(mac_key: bytes, key: str, value: bytes) -> bytes:
    """The tag of ``value`` under ``key`` (the name length-prefixed: no two (key, value)
    pairs share a message)."""
    name = key.encode()
    msg = struct.pack(">I", len(name)) + name + value
    return hmac.new(mac_key, msg, hashlib.sha256).digest()


def seal(mac_key: bytes, key: str, value: str | bytes) -> bytes:
    """What is stored for ``value`` under ``key``: the value, then its tag."""
    value = _bytes(value)
    return value + tag(mac_key, key, value)


def unseal(mac_key: bytes, key: str, stored: bytes) -> bytes:
    """The value ``stored`` under ``key`` holds; ``ForgedValue`` unless its tag is right."""
    stored = bytes(stored)
    value, mac = stored[:-TAG_BYTES], stored[-TAG_BYTES:]
    if len(stored) < TAG_BYTES or not hmac.compare_digest(mac, tag(mac_key, key, value)):
        raise ForgedValue(key)
    return value


class AuthStore(dist.Store):
    """``inner`` with every value sealed on the way in and checked on the way out (module
    doc). ``store_key``: the job's, hex (``derive_key``). Keep a reference to it as long as
    c10d may use it: c10d holds only the C++ half of a store written in Python."""

    def __init__(self, inner: dist.Store, store_key: str) -> None:
        super().__init__()
        if not store_key:
            raise ValueError("an authenticated store needs the job's store key")
        self._inner, self._key = inner, bytes.fromhex(store_key)

    @property
    def inner(self) -> dist.Store:
        return self._inner

    @property
    def port(self) -> int | None:
        """The inner store's port (a ``TCPStore``'s), None for others."""
        return getattr(self._inner, "port", None)

    @property
    def host(self) -> str | None:
        return getattr(self._inner, "host", None)

    # -- values: sealed and checked -------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, seal(self._key, key, value))

    def get(self, key: str) -> bytes:
        return unseal(self._key, key, self._inner.get(key))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        sealed = [seal(self._key, k, v) for k, v in zip(keys, values, strict=True)]
        self._inner.multi_set(keys, sealed)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._inner.multi_get(keys)
        return [unseal(self._key, k, v) for k, v in zip(keys, found, strict=True)]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As the store's: ``desired`` when the key held ``expected`` (or was missing and
        ``expected`` is empty), else what it holds, checked. A missing key with a non-empty
        ``expected`` answers ``expected`` (TCPStore's own answer, sealed by this call)."""
        expected = _bytes(expected)
        sealed_expected = seal(self._key, key, expected) if expected else b""
        found = self._inner.compare_set(key, sealed_expected, seal(self._key, key, desired))
        return unseal(self._key, key, found)

    # -- counters and existence: passed through (module doc) ------------------------------
    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)
