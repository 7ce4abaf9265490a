"""The rendezvous store's keys: every key a job's coordinator and workers share in the
TCPStore, by name (the rendezvous, the change counter, the members' steps, the process
groups' own keys).

Every key lives under the coordinator's random namespace (``WorkerConfig.store_namespace``).
The namespace keeps jobs, and a job's successive coordinators, apart; it is **not** a
secret: any client that reaches the store's port can list every key
(``TCPStore.list_keys``), the namespace included. What protects the members is that every
value they read is authenticated with the job's store key (``store_auth``): a key an
outsider writes is refused, naming it, never acted on. Counters (``add``) carry no tag:
what each one can do when forged is said where it is defined.
"""

from __future__ import annotations

GEN_OPEN, GEN_GO, GEN_ABANDONED = b"open", b"go", b"abandoned"


def generation_prefix(namespace: str, gen_id: int) -> str:
    """The store prefix of generation ``gen_id``: its state, arrivals and process group."""
    return f"{namespace}/gen{gen_id}"


def notice_key(namespace: str) -> str:
    """A counter the coordinator adds 1 to whenever it publishes a change members must act
    on at a step boundary (a new generation, a stop, the job's end; a closing rank 0
    moves it too, to wake its own waiting thread): rank 0 follows it (``worker.notice``),
    so a change reaches the group at the next step, not at the next heartbeat. Forged, it
    only makes rank 0 fetch an answer from the authenticated API for nothing."""
    return f"{namespace}/notice"


def notice_wake_key(namespace: str, count: int) -> str:
    """Set by whoever moves ``notice_key`` to ``count``, right after: rank 0's notice
    thread waits on the next count's key in the store (``worker.notice``), so it learns of
    a change without reading the counter every step."""
    return f"{namespace}/notice/{count}"


def state_key(prefix: str) -> str:
    """``open`` (the coordinator opened it), ``go`` (every member arrived) or ``abandoned``."""
    return f"{prefix}/state"


def arrived_key(prefix: str) -> str:
    """A counter: each member adds 1 on arriving. Forged, it can only make the rendezvous
    time out or complete early; the group still forms only with the generation's members,
    whose addresses are authenticated."""
    return f"{prefix}/arrived"


def settled_key(prefix: str) -> str:
    """Set by whoever moves ``state_key`` from ``open`` (the last member to arrive, or the
    coordinator abandoning it), right after: members waiting at the rendezvous block on it
    in the store instead of polling the state (``group.rendezvous``). Set again by a
    coordinator whose abandon found the state moved already: harmless, it only wakes."""
    return f"{prefix}/settled"


def step_key(prefix: str, rank: int) -> str:
    """The committed step of the generation's member of ``rank`` (``none`` without state),
    set before it forms the group: its peers read every member's once the group formed,
    instead of an all-gather over it (``group.member_steps``)."""
    return f"{prefix}/step/{rank}"


def group_prefix(prefix: str) -> str:
    """Where the generation's process group (gloo) keeps its keys: each member's address."""
    return f"{prefix}/pg"


def copies_prefix(prefix: str) -> str:
    """Where the generation's neighbour-copy group (``sharding="fsdp"``) keeps its keys."""
    return f"{prefix}/copies"


def master_key(prefix: str) -> str:
    """``--torchrun``: ``HOST:PORT`` of the store rank 0's launcher hosts for its world's
    script (its ``MASTER_ADDR`` and ``MASTER_PORT``: ``worker.torchrun``)."""
    return f"{prefix}/torchrun/master"


def host_key(prefix: str, rank: int) -> str:
    """``--torchrun``: the host of the world's member of ``rank`` (its ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` are counted from them)."""
    return f"{prefix}/torchrun/host/{rank}"
