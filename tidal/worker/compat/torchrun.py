"""``tidal run --torchrun``: the worker's side. ``python -m tidal.worker.compat.torchrun SCRIPT
ARG...`` (the local backend forks it from the zygote, as any worker) registers with the
coordinator, waits until it is a member of a world (a generation: ``coordinator.worlds``),
gives the script torchrun's environment and runs it in this process as ``python SCRIPT
ARG...`` would: ``__main__``, ``sys.argv``, ``sys.path[0]`` the script's directory, its
exit code (an uncaught exception's 1, ``sys.exit``'s) the process's.

The environment (``torchrun_env``) is what torchrun's agent gives each worker it starts
(``torch.distributed.elastic.agent.server.local_elastic_agent``), with one node per host:
``RANK`` the member's rank, ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` among the members on its
host, ``GROUP_RANK`` its host's index, ``ROLE_RANK`` = ``RANK``, ``ROLE_NAME`` ``default``,
``TORCHELASTIC_RUN_ID`` the job's name, ``TORCHELASTIC_RESTART_COUNT`` the worlds started
before this one (every restart, a failure's or a change's: ``docs/decisions/torchrun-compat.md``),
``TORCHELASTIC_MAX_RESTARTS`` ``--max-restarts``'s count. As torchrun's agent does by
default (``TORCHELASTIC_USE_AGENT_STORE=True``), rank 0's launcher hosts a fresh ``TCPStore``
for each world on a port the OS picks (no port race, no stale keys of an earlier world), and
every member's ``init_process_group("env://")`` connects to it as a client at
``MASTER_ADDR:MASTER_PORT``; the address reaches the other members through the job's
authenticated store (``store_keys.master_key``).

A thread watches for the script's process group (``torch.distributed.is_initialized``,
polled every ``POLL_S`` until it is) and reports it as the world's first step
(``StepReport``): the coordinator counts the world formed from then on
(``world_rules.judge_member_exit``: an exit 0 before it is a script that never formed one).
The script's SIGTERM is its own (torchrun's: the default ends the process).

A script may call ``tidal.log(step=N, loss=...)`` (``LogSink``): ``step`` is then the job's
step (``tidal status``, ``--schedule``), the other values its metrics, rank 0's unless
``reduce="mean"``, as from a Trainer.
"""

from __future__ import annotations

import datetime
import gc
import ipaddress
import os
import runpy
import socket
import sys
import threading
import time

import torch.distributed as dist

from tidal.protocol import GenerationInfo, Role, StepReport, WorkerConfig, WorkerEnv
from tidal.restarts import parse_max_restarts
from tidal.store_auth import AuthStore
from tidal.store_keys import host_key, master_key
from tidal.worker.agent.client import Agent
from tidal.worker.membership.notice import Notices
from tidal.worker.trainer.elastic import post_step_metrics
from tidal.worker.trainer.runtime import set_log_sink

#: How often the watch looks for the script's process group.
POLL_S = 0.005
#: The longest a standby waits between two answers (a retire moves no change counter).
STANDBY_FETCH_S = 0.25
#: ``TORCHELASTIC_MAX_RESTARTS`` for ``--max-restarts unlimited`` (torchrun's is a count).
UNLIMITED = 2**31 - 1


def torchrun_env(
    *,
    rank: int,
    hosts: list[str],
    master_addr: str,
    master_port: int,
    restart_count: int,
    max_restarts: int,
    run_id: str,
) -> dict[str, str]:
    """The variables torchrun sets for the worker of ``rank`` in a world whose members run
    on ``hosts`` (in rank order; one torchrun node per host, numbered in order of first
    appearance)."""
    world = len(hosts)
    mine = hosts[rank]
    nodes = list(dict.fromkeys(hosts))
    local = [r for r, h in enumerate(hosts) if h == mine]
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local.index(rank)),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(len(local)),
        "GROUP_RANK": str(nodes.index(mine)),
        "GROUP_WORLD_SIZE": str(len(nodes)),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
    }


def max_restarts_count(value: int | str | None) -> int:
    """``--max-restarts`` as torchrun's count: N, or N of ``N/h``; ``UNLIMITED``."""
    if value is None:
        return 0
    count = parse_max_restarts(value).count
    return UNLIMITED if count is None else count


def await_world(agent: Agent, notices: Notices) -> GenerationInfo | None:
    """Wait, warm, until this worker is a member of a world: its generation; None when it
    is told to exit (retired, or the job ends) first."""
    while True:
        notices.mark()  # before the answer: a change after it is news
        resp = agent.fetch()
        if resp.stop or resp.role == Role.EXIT:
            return None
        info = resp.generation
        if resp.role == Role.MEMBER and info is not None and agent.worker_id in info.members:
            return info
        if not notices.wait(STANDBY_FETCH_S):
            time.sleep(STANDBY_FETCH_S)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def host_store(job_host: str) -> tuple[dist.TCPStore, str]:
    """A fresh store for the world's script, served by this process on a port the OS picks,
    and the address its members reach it at: the job's loopback address when the job's
    workers all run here, else this host's name (torchrun's ``socket.getfqdn()``)."""
    local = _loopback(job_host)
    sock = socket.create_server((job_host if local else "", 0))
    port = sock.getsockname()[1]
    addr = job_host if local else socket.getfqdn()
    store = dist.TCPStore(
        addr, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
    )
    sock.detach()  # the store owns it (``coordinator.controller._bound_store``)
    return store, addr


def meet(cfg: WorkerConfig, info: GenerationInfo, rank: int) -> tuple[dict[str, str], object]:
    """Meet the world's other members through the job's store: each says its host, rank 0
    hosts the script's store and says where. Returns this member's environment and what
    must live as long as the script (rank 0's store; None elsewhere)."""
    timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
    client = dist.TCPStore(cfg.store_host, cfg.store_port, is_master=False, timeout=timeout)
    store = AuthStore(client, cfg.store_key)
    prefix = info.store_prefix
    store.set(host_key(prefix, rank), socket.gethostname())
    served = None
    if rank == 0:
        served, addr = host_store(cfg.store_host)
        store.set(master_key(prefix), f"{addr}:{served.port}")
    addr, _, port = store.get(master_key(prefix)).decode().rpartition(":")
    hosts = [store.get(host_key(prefix, r)).decode() for r in range(len(info.members))]
    env = torchrun_env(
        rank=rank,
        hosts=hosts,
        master_addr=addr,
        master_port=int(port),
        restart_count=info.id - 1,  # worlds are generations 1, 2, ... of the job
        max_restarts=max_restarts_count(cfg.max_restarts),
        run_id=cfg.name or "none",
    )
    return env, served


class FormWatch:
    """Reports the script's process group once it exists (the module doc)."""

    def __init__(self, agent: Agent, info: GenerationInfo) -> None:
        self.agent, self.info = agent, info
        self.reported = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-form-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            if dist.is_initialized():
                self.report()
                return
            self._done.wait(POLL_S)

    def report(self) -> None:
        if self.reported:
            return
        self.reported = True
        info = self.info
        self.agent.post_report(
            StepReport(
                generation=info.id, start_step=info.committed_step, first_step_time=time.time()
            )
        )
        self.agent.send_soon()

    def close(self) -> None:
        """After the script: one last look (a group it still holds), then stop."""
        self._done.set()
        self._thread.join(timeout=1)
        if dist.is_initialized():
            self.report()


class LogSink:
    """``tidal.log`` from a script that is no Trainer's (``runtime.set_log_sink``): its
    ``step`` value is the step the values are for, and this worker's step from then on."""

    def __init__(self, agent: Agent, info: GenerationInfo, rank: int) -> None:
        self.agent, self.generation, self.rank = agent, info.id, rank

    def __call__(self, values: dict[str, float], reduce: str | None) -> None:
        step = values.pop("step", None)
        if step is not None:
            self.agent.step = max(self.agent.step, int(step))
        if values:
            post_step_metrics(
                self.agent,
                last_rank=self.rank,
                step=self.agent.step,
                generation=self.generation,
                metrics=values,
                reduce=reduce,
            )


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m tidal.worker.compat.torchrun SCRIPT [ARG...] (under tidal run)")
    env = WorkerEnv.from_environ()
    if env is None:
        sys.exit("tidal.worker.compat.torchrun runs under `tidal run --torchrun`: use that")
    script = argv[0]
    agent = Agent(env)
    watch = None
    try:
        agent.register()
        notices = Notices()
        notices.follow(agent.config)
        info = await_world(agent, notices)
        notices.close()
        if info is None:
            return  # told to exit before it trained: exit 0
        rank = info.members.index(agent.worker_id)
        variables, served = meet(agent.config, info, rank)
        set_log_sink(LogSink(agent, info, rank))
        os.environ.update(variables)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as torchrun does
        watch = FormWatch(agent, info)
        watch.start()
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(script))  # as ``python SCRIPT``
        runpy.run_path(script, run_name="__main__")  # ``served`` lives until it ends
    finally:
        if watch is not None:
            watch.close()
        agent.close()  # its outbox first: the group's report reaches the job before the exit
        # What the script made (a library's imports: Lightning's, transformers') lives until
        # the process ends: out of the collector's sight, as the zygote's imports are, so the
        # exit does not walk it: 2-3 s of a Lightning member's exit here, which the next
        # world waits for (docs/decisions/hf-lightning.md).
        gc.freeze()


if __name__ == "__main__":
    main(sys.argv[1:])
