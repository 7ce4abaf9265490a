"""How each peer is configured: one place, so the commands that run a peer and the
``peer_config`` its rows print cannot drift apart. Pure constants and builders; the
reasons for each setting are in docs/decisions/bench-peers.md.

torchrun: its c10d rendezvous tuned for fast elasticity as the
``torch.distributed.elastic.rendezvous.dynamic_rendezvous.create_handler`` docs describe
(integer seconds: ``join_timeout``, ``last_call_timeout``, ``close_timeout``,
``keep_alive_interval``, ``keep_alive_max_attempt``), the agent's ``--monitor-interval``
at its 0.1 s, and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (pytorch issue 135712).
"""

from __future__ import annotations

#: torchrun's rendezvous at its fastest that still forms one round per change: a joiner is
#: admitted 1 s after the minimum is met (0 would let the first agent back complete the
#: round alone and restart again when the second arrives), a dead agent is declared after
#: three missed 1 s keep-alives (one missed beat, 1 x 1, dropped a loaded agent's own
#: membership: its first rendezvous never completed), a closing round waits 1 s.
TORCHRUN_RDZV_CONF: dict[str, int] = {
    "join_timeout": 30,
    "last_call_timeout": 1,
    "close_timeout": 1,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
}
TORCHRUN_MONITOR_INTERVAL = 0.1
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def rdzv_conf_arg(conf: dict[str, int] = TORCHRUN_RDZV_CONF) -> str:
    """``--rdzv-conf=k=v,...`` in the order given."""
    return "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items())


def torchrun_opts(conf: dict[str, int] = TORCHRUN_RDZV_CONF) -> list[str]:
    """The rendezvous and agent options every elastic torchrun peer gets."""
    return [rdzv_conf_arg(conf), f"--monitor-interval={TORCHRUN_MONITOR_INTERVAL}"]


def torchrun_config(launch: str) -> dict:
    """``peer_config`` of a torchrun row: how it was launched plus the tuned rendezvous."""
    return {
        "launch": launch,
        "rdzv_backend": "c10d",
        "rdzv_conf": dict(TORCHRUN_RDZV_CONF),
        "monitor_interval_s": TORCHRUN_MONITOR_INTERVAL,
        "env": dict(TORCHRUN_ENV),
        "script": "bench/train_mlp.py --mode ddp (DDP over gloo, restarts at step 0)",
    }


TORCHRUN_ELASTIC = torchrun_config("--nnodes=1:2 --nproc-per-node=1, one agent per node")
TORCHRUN_STANDALONE = torchrun_config("--standalone --nproc-per-node=2 --max-restarts=K")

#: plain DDP: the throughput peer (no elasticity, nothing but the training).
DDP = {
    "launch": "torchrun --standalone --nproc-per-node=N",
    "script": "bench/train_mlp.py --mode ddp",
    "ddp": "DistributedDataParallel(model), gloo, default bucket (25 MB)",
    "threads": "torch.set_num_threads(1), OMP_NUM_THREADS=1",
    "data": "the same tensors, permutation and global batch (64)",
}

#: DCP's asynchronous save at its best on a CPU-only host (``torch.distributed.checkpoint``
#: ``async_save``): a ``DefaultStager`` kept for the whole run (its ``StateDictStager``
#: caches the staging storages: the buffers are reused from the second save on), staging
#: in its background thread, the training waiting for the staging only before the next
#: optimizer update (as Tidal's writer does), the write in DCP's thread executor. Pinned
#: memory and non-blocking copies need an accelerator (torch refuses them without one).
DCP_ASYNC = {
    "api": "torch.distributed.checkpoint.async_save",
    "async_checkpointer_type": "THREAD",
    "async_stager": "DefaultStager reused across saves (cached staging storages)",
    "staging_options": {
        "use_pinned_memory": False,
        "use_shared_memory": False,
        "use_async_staging": True,
        "use_non_blocking_copy": False,
    },
    "wait": "staging_completion before the next optimizer update",
    "storage": "FileSystemWriter (DCP's default for a path)",
    "pinned_memory": "not applicable: CPU-only torch (pinning requires an accelerator)",
}

#: TorchFT (0.2.0) tuned for fast recovery, as its README's lighthouse and its ``train_ddp``
#: example set it up, the timeouts shortened where they bound only a failure. The lighthouse
#: (``torchft.coordination.LighthouseServer``) runs in a process of its own; each replica
#: group is one process (``bench/torchft_replica.py``) with one ``Manager``. A dead replica leaves
#: the quorum when its heartbeats stop for ``heartbeat_timeout_ms`` (the survivor's next
#: quorum waits that long: with two replicas, one alone is not more than half of the healthy
#: ones until the dead one's beats expire), and the quorum is re-evaluated every
#: ``quorum_tick_ms``; ``join_timeout_ms`` only bounds the wait for a heartbeating replica
#: that has not asked for a quorum yet (the README's 10 s suits slow pods, not one host).
TORCHFT_LIGHTHOUSE: dict[str, int | str] = {
    "bind": "[::]:0",
    "min_replicas": 1,
    "join_timeout_ms": 100,
    "quorum_tick_ms": 10,
    "heartbeat_timeout_ms": 500,
}
#: One ``Manager`` per replica group (group world size 1, its own ``TCPStore``):
#: ``use_async_quorum=False`` because each replica's share of the global batch depends on
#: the quorum's size (so the quorum is needed before the forward anyway, and a healing
#: replica then participates in its first step); ``init_sync=False`` as the docs say when
#: every replica seeds its model identically; ``PGTransport`` over the gloo group as in
#: ``train_ddp``; seconds below.
TORCHFT_MANAGER: dict[str, float | int | bool] = {
    "min_replica_size": 1,
    "use_async_quorum": False,
    "init_sync": False,
    "timeout_s": 30,
    "quorum_timeout_s": 60,
    "connect_timeout_s": 10,
    "heartbeat_interval_s": 0.1,
    "pg_gloo_timeout_s": 5,
    "pg_transport_timeout_s": 10,
}


def torchft_config(measured: str) -> dict:
    """``peer_config`` of a TorchFT row: what was measured plus the full configuration."""
    return {
        "measured": measured,
        "version": "torchft 0.2.0",
        "lighthouse": "torchft.coordination.LighthouseServer, a process of its own",
        "lighthouse_conf": dict(TORCHFT_LIGHTHOUSE),
        "manager": dict(TORCHFT_MANAGER),
        "replica": "one process per replica group (bench/torchft_replica.py): torchft "
        "ProcessGroupGloo, PGTransport, torchft DistributedDataParallel (its comm hook's "
        "failure path completed: docs/decisions/bench-peers.md), Optimizer wrapper",
        "model": "bench/train_mlp.py's MLP, SGD(lr=0.01, momentum=0.9), one thread a process",
        "data": "global batch 64 split over the quorum's participants (contiguous shares)",
        "threads": "torch.set_num_threads(1), OMP_NUM_THREADS=1",
    }
