"""Forming the process group of one generation, and the control word that rides with it.

Rendezvous contract (see ``GenerationInfo``; keys in ``protocol``): the coordinator writes
``{prefix}/state = open`` before it announces a generation. Each member adds itself to
``{prefix}/arrived`` once; the member whose arrival completes the count swaps ``open`` for
``go``; the coordinator swaps ``open`` for ``abandoned`` when it supersedes the generation.
Both swaps are compare-and-set on the store, so every member sees the same outcome: all
form the group, or all move on to a newer generation. Nobody forms a group with a member
that never arrived.

A member can still die (or hang) between arriving and connecting. Forming has two phases,
bounded apart:

- **Addresses.** Each member publishes its address in the store and reads its peers'. A
  peer lost before publishing leaves the others waiting for an address it will never
  write; they stop waiting as soon as the coordinator opens a newer generation (it does so
  when it sees the death, or kills the hung member after its missed heartbeats):
  ``form_group`` reads the store through ``_Superseded``, which gives up on any wait once
  ``{namespace}/gen{N+1}/state`` exists, and otherwise after the collective timeout (a
  peer may legitimately be slow here: loading a checkpoint to roll back to).
- **Connecting.** Then gloo connects every pair, in C++, where nothing can interrupt it: a
  peer lost after publishing its address leaves the others in ``connectFullMesh`` for about
  five times the group's timeout (measured: 1.0 s at 0.2 s, 2.5 s at 0.5 s, 4-4.5 s at
  1 s; 10 min at the default collective timeout of 120 s). So the group is made with the
  short ``connect_timeout`` and given the collective timeout once it is formed
  (``_set_pg_timeout``). A connect that times out fails the forming like any lost peer:
  the member reports it and the coordinator re-forms. Connecting live processes takes
  milliseconds, so the window only matters on a machine too loaded to schedule a peer in
  time: each failed forming in a row doubles it (``connect_timeout``), so a slow machine
  still forms, a few re-forms later.

Leaving a gloo group (``destroy_group``): gloo cannot abort a collective, and one race
leaves a collective blocked until its timeout after a peer's death (``waits``). So a group
keeps its connections (``conns``): a member leaving it after a failure shuts them down
first (a peer blocked on this member learns at once), and a group whose waits the abort
watch cut is **parked**, not freed: its destructor would join the blocked collective's
thread, so a daemon thread holds it until the process exits.
"""

from __future__ import annotations

import datetime
import enum
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tidal.protocol import GenerationInfo
from tidal.store_keys import (
    GEN_ABANDONED,
    GEN_GO,
    GEN_OPEN,
    arrived_key,
    copies_prefix,
    generation_prefix,
    group_prefix,
    settled_key,
    state_key,
    step_key,
)
from tidal.worker.membership import rank_prefix
from tidal.worker.membership.conns import Conns, open_sockets

POLL_S = 0.002  # store polls while waiting (check() never blocks, so c10d logs nothing)
FIRST_POLL_S = 0.0001  # ... the first of them; each next one 1.25x longer, up to POLL_S
#: The first connect window (gloo waits about 5x this for a peer lost after publishing its
#: address: ~1.5 s, within the ~2 s a lost member may cost the others).
CONNECT_S = 0.3

#: The current gloo group's connections (``form_group``; empty when none were captured).
_conns = Conns([])
#: The stores of the current default group and of the latest side group, kept alive with
#: them: c10d holds only the C++ half of a store written in Python, and once the Python
#: object is collected every call c10d makes on it fails ("Not implemented."). gloo reads
#: its store only while it connects, but NCCL connects at the first collective, after
#: ``form_group`` has returned.
_stores: dict[str, dist.Store] = {}


def connect_timeout(failed_forms: int, collective_timeout_s: float) -> float:
    """The connect window of a member whose last ``failed_forms`` attempts to form a group
    failed in a row: ``CONNECT_S``, doubled for each, never above the collective timeout."""
    return min(collective_timeout_s, CONNECT_S * 2 ** min(failed_forms, 30))


class Superseded(RuntimeError):
    """A newer generation was opened while this one was forming: give up on it."""


class Arrival(enum.Enum):
    """How a rendezvous ended for the member that arrived at it."""

    FORMED = "formed"  # every member arrived: form the group
    ABANDONED = "abandoned"  # the coordinator superseded the generation: join the next
    TIMED_OUT = "timed out"  # neither, within the collective timeout: report it


class RendezvousTimeout(RuntimeError):
    """A rendezvous that neither formed nor was abandoned within the collective timeout;
    the message says how many members arrived (read from the store when raised)."""

    def __init__(self, info: GenerationInfo, store: dist.Store) -> None:
        try:
            arrived = f"{store.add(arrived_key(info.store_prefix), 0)}"
        except Exception:  # noqa: BLE001 - the count is a courtesy; the store may be gone
            arrived = "?"
        super().__init__(
            f"rendezvous of generation {info.id} timed out: {arrived} of "
            f"{len(info.members)} members arrived"
        )


def pauses(cap_s: float = POLL_S) -> Iterator[float]:
    """The sleeps between a wait's polls: short first (what a member waits for while a
    generation re-forms, its peers' arrival or address, comes within a few milliseconds, and
    a fixed 2 ms poll added half of that to each of a re-form's waits), growing by a quarter
    each to ``cap_s``, where a long wait polls as before."""
    pause = FIRST_POLL_S
    while True:
        yield pause
        pause = min(cap_s, pause * 1.25)


def rendezvous(
    store: dist.Store, info: GenerationInfo, *, timeout_s: float, poll_s: float = 0.001
) -> Arrival:
    """Arrive at generation ``info`` and wait until it formed, was abandoned, or timed out.

    A member that arrives before the last blocks in the store on ``settled_key``, which
    whoever moves the state sets right after (a poll every millisecond made the early
    arrivals, whose group the last one cannot form without, ~0.5 ms late on average, and
    cost the store a request each). Should the state still read ``open`` once woken (its
    mover lost between its two writes), the member polls it, at most every ``poll_s``
    (``pauses``), until the timeout."""
    key = state_key(info.store_prefix)
    deadline = time.monotonic() + timeout_s
    if store.add(arrived_key(info.store_prefix), 1) == len(info.members):
        store.compare_set(key, GEN_OPEN, GEN_GO)
        store.set(settled_key(info.store_prefix), b"")
    elif store.get(key) == GEN_OPEN:
        try:
            store.wait([settled_key(info.store_prefix)], datetime.timedelta(seconds=timeout_s))
        except dist.DistStoreError:  # its own timeout: the polls below say TIMED_OUT
            if time.monotonic() < deadline:  # not the timeout: the caller handles it
                raise
    for pause in pauses(poll_s):
        state = store.get(key)
        if state == GEN_GO:
            return Arrival.FORMED
        if state == GEN_ABANDONED:
            return Arrival.ABANDONED
        if time.monotonic() > deadline:
            return Arrival.TIMED_OUT
        time.sleep(pause)
    raise AssertionError("unreachable: pauses() never ends")


def wait_for_generation(
    store: dist.Store, namespace: str, gen_id: int, *, timeout_s: float
) -> None:
    """Return as soon as generation ``gen_id`` is opened, or after ``timeout_s``.

    Polls with ``check`` rather than ``store.wait``: a timed-out wait makes c10d log two
    warning lines, hundreds per second-long wait."""
    keys = [state_key(generation_prefix(namespace, gen_id))]
    deadline = time.monotonic() + timeout_s
    for pause in pauses():
        if store.check(keys) or time.monotonic() >= deadline:
            return
        time.sleep(pause)


class _Superseded(dist.Store):
    """The generation's process-group store, read so that every wait gives up with
    ``Superseded`` once the coordinator has opened the next generation (``abort_key``), and
    otherwise after ``wait_s`` (whatever timeout gloo asks for: it passes the group's short
    connect timeout). ``on_set`` runs after each key this member publishes (gloo publishes
    one: its address)."""

    def __init__(
        self,
        inner: dist.Store,
        outer: dist.Store,
        abort_key: str,
        *,
        wait_s: float,
        on_set: Callable[[], None],
    ) -> None:
        super().__init__()
        self._inner, self._outer, self._abort = inner, outer, [abort_key]
        self._wait_s, self._on_set = wait_s, on_set

    def set(self, key: str, value: bytes) -> None:
        self._inner.set(key, value)
        self._on_set()

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self._wait_s
        deadline = time.monotonic() + limit
        for pause in pauses():
            if self._inner.check(keys):
                return
            if self._outer.check(self._abort):
                # Read, not only seen: through an ``AuthStore`` a key the coordinator did
                # not write raises ``ForgedValue`` here instead of abandoning the forming.
                self._outer.get(self._abort[0])
                raise Superseded("a newer generation was opened while this one formed")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timed out after {limit:.0f} s for {keys}")
            time.sleep(pause)


def side_group(
    store: dist.Store,
    info: GenerationInfo,
    rank: int,
    *,
    namespace: str,
    timeout_s: float,
    connect_s: float,
) -> dist.ProcessGroup:
    """A second gloo group of the generation's members, outside c10d's registry (its owner
    keeps it, and drops it once nothing uses it): for traffic that must not interleave with
    the training's collectives (the neighbour copies). Its store waits give up like the
    default group's (``Superseded``), and it connects within ``connect_s``."""
    watched = _Superseded(
        dist.PrefixStore(copies_prefix(info.store_prefix), store),
        store,
        state_key(generation_prefix(namespace, info.id + 1)),
        wait_s=timeout_s,
        on_set=lambda: None,
    )
    pg = dist.ProcessGroupGloo(
        watched, rank, len(info.members), datetime.timedelta(seconds=min(connect_s, timeout_s))
    )
    pg._set_default_timeout(datetime.timedelta(seconds=timeout_s))
    _stores["side"] = watched
    return pg


def publish_step(store: dist.Store, info: GenerationInfo, rank: int, step: int | None) -> None:
    """Say which step this member holds (None: no state), before it forms ``info``'s group:
    every peer's ``form_group`` returns only after reading this member's address, which it
    publishes after this, on the same connection, so ``member_steps`` finds every key."""
    store.set(step_key(info.store_prefix, rank), b"none" if step is None else str(step).encode())


def member_steps(store: dist.Store, info: GenerationInfo, *, none: int) -> list[int]:
    """Every member's published step, by rank, ``none`` for a member without state; after
    the group formed (``publish_step``). One store round trip: ~0.1-0.9 ms here, where the
    heal's all-gather over the new group took ~0.6-6 ms on busy cores."""
    keys = [step_key(info.store_prefix, r) for r in range(len(info.members))]
    return [none if v == b"none" else int(v) for v in store.multi_get(keys)]


def form_group(
    store: dist.Store,
    info: GenerationInfo,
    rank: int,
    *,
    namespace: str,
    timeout_s: float,
    connect_s: float,
    on_published: Callable[[], None] = lambda: None,
    backend: str = "gloo",
    other_ports: tuple[int, ...] = (),
) -> None:
    """Make the default process group this generation's (the old one must be gone), on
    ``backend``: ``gloo``, or ``nccl`` (the caller has set its CUDA device; NCCL connects at
    the first collective, the heal, which the abort watch bounds: ``watch``).

    Waits up to ``timeout_s`` for the peers' addresses (giving up with ``Superseded`` if the
    coordinator opens a newer generation meanwhile), connects within about five times
    ``connect_s`` or raises, and leaves the group with ``timeout_s`` for its collectives.
    ``on_published`` runs once this member's address is in the store (a test's fault
    point). A failed attempt leaves nothing behind: c10d names the default group after a
    counter that only a successful group's destruction resets, and a counter left advanced
    would make this worker look for keys its peers never write in the next generation.
    A gloo group's connections are captured (``conns``; ``other_ports``: the ports of the
    connections other threads may open meanwhile, the store's and the coordinator's)."""
    global _conns
    watched = _Superseded(
        dist.PrefixStore(group_prefix(info.store_prefix), store),
        store,
        state_key(generation_prefix(namespace, info.id + 1)),
        wait_s=timeout_s,
        on_set=on_published,
    )
    before = open_sockets() if backend == "gloo" else set()
    rank_prefix.reset()  # torch adds this generation's: one prefix, not one per generation
    try:
        dist.init_process_group(
            backend,
            store=watched,
            rank=rank,
            world_size=len(info.members),
            # gloo connects here, bounded by the short window; NCCL connects later
            timeout=datetime.timedelta(
                seconds=min(connect_s, timeout_s) if backend == "gloo" else timeout_s
            ),
        )
        c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))
        _stores["default"] = watched  # NCCL reads it at the first collective (``_stores``)
        if backend == "gloo":
            _conns = Conns.opened_since(
                before,
                expected=len(info.members) - 1,
                exclude=(getattr(store, "port", None), *other_ports),
            )
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        c10d._world.group_count = 0
        raise


def destroy_group(backend: str = "gloo", *, failed: bool = False, park: bool = False) -> None:
    """Unregister the current group at once; free it on a thread, or park it.

    Freeing a gloo group that has run collectives takes ~20 ms (its destructor joins its
    threads, without the GIL): the next generation need not wait for that. ``failed``: the
    member leaves after a failure: its connections are shut down first. ``park``: a
    collective of the group may still be blocked inside gloo (the abort watch cut a wait on
    it): the group is cut and held until the process exits instead (module doc). An NCCL
    group is aborted, not shut down: a shutdown waits for collectives that a lost peer never
    joins, an abort frees the communicators at once (and is a no-op after the watch aborted
    them)."""
    global _conns
    if backend == "nccl":
        abort_group()
        return
    _stores.pop("default", None)
    conns, _conns = _conns, Conns([])
    if failed or park:
        conns.cut()
    conns.close()
    if dist.is_initialized():
        box = [dist.group.WORLD]
        dist.destroy_process_group()
        if park:
            threading.Thread(target=_hold, args=box, name="tidal-parked-group", daemon=True).start()
            return
        # Not a daemon: the interpreter joins it before exiting; a process that exits while
        # a gloo destructor runs aborts ("terminate called without an active exception").
        threading.Thread(target=box.clear, name="tidal-free-group").start()


def cut_group() -> None:
    """Shut the current gloo group's connections down (the abort watch's cut: ``waits``)."""
    _conns.cut()


def connections() -> int:
    """How many connections of the current gloo group were captured (``conns``)."""
    return len(_conns)


def _hold(group: dist.ProcessGroup) -> None:
    """Keep ``group`` alive, never destroyed: a daemon thread's frame is not torn down at
    exit (a module-level reference would be, and its destructor would wait)."""
    threading.Event().wait()


def abort_group() -> None:
    """Unregister the current group at once and abort its communicators on a thread (NCCL:
    a collective blocked in them returns); a no-op when there is none.

    The abort need not hold anyone up: ``ProcessGroup.abort`` on NCCL returned after 0.5 to
    1 s, most of it waiting on the group's own threads (``python -m bench.gpu.leave``: torch
    2.11, NCCL 2.28, an H200; docs/gpu.md), and the next generation's group, formed and
    connected beside it, ran its first all-reduce in the same ~18 ms. The old group is out
    of c10d's registry before this returns, so nothing reaches it but the thread, which also
    keeps the group's store alive until the abort is over (``_stores``). Not a daemon: the
    interpreter joins it before exiting, as it does ``destroy_group``'s."""
    store = _stores.pop("default", None)
    if not dist.is_initialized():
        c10d._world.group_count = 0
        return
    groups = unregister()
    threading.Thread(target=_abort_all, args=(groups, [store]), name="tidal-abort-group").start()


def unregister() -> list[dist.ProcessGroup]:
    """Take every group out of c10d's registry, as ``c10d._abort_process_group`` does after
    its abort, without aborting any; returns them in the order c10d aborts them (newest
    first), and the caller owns them from here."""
    w = c10d._world
    groups = sorted(w.pg_names, key=lambda pg: w.pg_names[pg], reverse=True)
    c10d._update_default_pg(None)
    for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag):
        table.clear()
    w.tags_to_pg.clear()
    w.pg_coalesce_state.clear()
    c10d._unregister_all_process_groups()
    w.group_count = 0
    return groups


def _abort_all(groups: list[dist.ProcessGroup], keep: list[object]) -> None:
    """Abort ``groups`` (``unregister``'s order) inside one NCCL group call, as c10d does
    (aborts of several communicators could otherwise wait on each other), then drop them
    and ``keep`` (their store): their destructors join their threads here, not on the
    training thread."""
    nccl = next((b for b in map(_nccl_backend, groups) if b is not None), None)
    try:
        if nccl is not None:
            nccl._group_start()
        try:
            for pg in groups:
                pg.abort()
        finally:
            if nccl is not None:
                nccl._group_end()
    finally:  # an abort that raised leaves its error on this thread, not the training's
        groups.clear()
        keep.clear()


def _nccl_backend(pg: dist.ProcessGroup) -> object | None:
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError:
        return None
    return backend if type(backend).__name__ == "ProcessGroupNCCL" else None
