"""The worker's link to its job, as one part of a ``Trainer``: the coordinator (``Agent``),
the rendezvous store, durable checkpoints, rank 0's change notices, the preemption watcher,
and the abort watch that bounds every collective.

Contracts:

- Every value read through the store is authenticated with the job's key
  (``store_auth.AuthStore``); a restarted coordinator serves a new store, and the member
  connects to it (``connect_store``) before it joins again.
- The process groups' backend is chosen once (``devices.resolve_comm``). On gloo the watch
  fails the waits it gives up on and cuts the group's connections (``waits``); on NCCL it
  aborts the communicators, and torch's watchdog is told to do nothing.
- Training alone, nothing here is started: ``agent`` and ``store`` stay None.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import urllib.parse
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tidal import devices
from tidal.protocol import HeartbeatResponse, WorkerConfig
from tidal.store_auth import AuthStore
from tidal.worker.agent import cloud_watch
from tidal.worker.agent.client import Agent, WorkerEnv
from tidal.worker.membership import busy
from tidal.worker.membership import group as grp
from tidal.worker.membership.notice import Notices
from tidal.worker.membership.watch import AbortWatch, Facts
from tidal.worker.state.durable import Durable
from tidal.worker.waits import Waits

if TYPE_CHECKING:
    from tidal.worker.trainer.parts import Parts


log = logging.getLogger(__name__)


class JobLink:
    """The job's services for one worker (module doc)."""

    def __init__(self, parts: Parts, env: WorkerEnv | None, *, debug: bool = False) -> None:
        self.parts = parts
        self.env = env  # None: training alone
        self.agent: Agent | None = None
        self.cfg: WorkerConfig | None = None  # the job's settings, from the registration
        self.store: dist.Store | None = None  # an ``AuthStore`` (``connect_store``)
        self.store_epoch: int | None = None  # the registration the store came from
        self.durable: Durable | None = None
        self.notices = Notices()  # rank 0's view of the coordinator's change counter
        self.cloud_watch: cloud_watch.Watcher | None = None
        self.backend = "gloo"  # the process groups' backend, chosen when the job is joined
        self.watch: AbortWatch | None = None  # bounds a collective a peer left
        self.waits = Waits()  # gloo: the waits the watch can cut (``waits``)
        self.debug_on = debug
        if debug:  # the membership's trace (``debug``), in the worker's log
            logging.getLogger("tidal").setLevel(logging.DEBUG)

    @property
    def worker_id(self) -> int | None:
        return self.env.worker_id if self.env is not None else None

    def register(self, max_steps: int) -> WorkerConfig:
        """Register with the coordinator and start what the job's settings ask for: the
        preemption watcher, the backend and its abort watch, durable checkpoints."""
        self.agent = Agent(self.env)
        self.agent.install_preemption_handler()
        cfg = self.agent.register(max_steps=max_steps).config
        self.cfg = cfg
        self.cloud_watch = cloud_watch.start(
            cfg.preemption_notice,
            self.worker_id,
            self.agent.announce_leaving,
            period_s=cfg.preemption_poll_s,
        )
        self.start_comm(cfg.comm)
        self.durable = Durable(cfg, self.agent)
        return cfg

    def start_comm(self, comm: str) -> None:
        """Choose the process groups' backend and start the abort watch (module doc)."""
        objects, membership = self.parts.objects, self.parts.membership
        self.backend = devices.resolve_comm(comm, objects.device)
        if self.backend != "nccl":
            membership.control.waits = self.waits
            self.watch = AbortWatch(self.watch_facts, self.cut_group)
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # the watch handles errors
            torch.cuda.set_device(objects.device)
            self.watch = AbortWatch(self.watch_facts, grp.abort_group)
        watch = self.watch
        self.agent.script_s = lambda: busy.script_s(
            watch.script_s(), in_group=membership.ddp is not None
        )

    def cut_group(self) -> None:
        """The gloo watch's abort: the training thread's wait fails, the peers' see the
        connections close."""
        self.waits.abort("the abort watch cut a collective a peer left")
        grp.cut_group()

    def other_ports(self) -> tuple[int, ...]:
        """The ports of this worker's connections besides its group's: the coordinator's
        API (the store's is known to ``form_group``)."""
        port = urllib.parse.urlsplit(self.env.url).port
        return (port,) if port is not None else ()

    def watch_facts(self, open_s: float | None) -> Facts:
        """What the abort watch decides from (``watch.Facts``)."""
        membership = self.parts.membership
        latest = self.agent.latest() if self.agent else None
        dropped = False
        if latest is not None and latest.generation is not None:
            gen = latest.generation
            dropped = gen.id > membership.generation and not set(membership.members) <= set(
                gen.members
            )
        peers_busy = latest is not None and busy.peers_busy(
            busy=latest.busy,
            members=membership.members,
            me=self.worker_id,
            answer_age_s=time.monotonic() - self.agent.latest_at,
            interval_s=latest.interval_s or self.cfg.heartbeat_interval_s,
        )
        return Facts(
            open_s=open_s,
            step_s=self.parts.clock.step_s,
            dropped=dropped,
            timeout_s=self.cfg.collective_timeout_s,
            busy=peers_busy,
            stopped=latest is not None and latest.stop,
        )

    def connect_store(self) -> None:
        """A client of the store named by the newest registration (a restarted coordinator
        serves a new one: ``Agent.epoch`` tells), authenticating values with its key. A new
        store holds no settings yet: the members agree again (``identity``)."""
        cfg = self.agent.config
        self.store_epoch = self.agent.epoch
        self.cfg = cfg
        self.parts.membership.store_changed()
        client = dist.TCPStore(
            cfg.store_host,
            cfg.store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=cfg.collective_timeout_s),
        )
        # Every value read through it is authenticated; c10d's keys too (``store_auth``).
        self.store = AuthStore(client, cfg.store_key)

    def latest(self) -> HeartbeatResponse | None:
        """The newest heartbeat's answer held, without asking; None alone."""
        return self.agent.latest() if self.agent is not None else None

    def newest_answer(self, rank: int) -> HeartbeatResponse | None:
        """The newest heartbeat's answer; on rank 0, fetched at once when the coordinator
        published a change since (``worker.notice``)."""
        if self.agent is None:
            return None
        if rank == 0 and self.notices.changed():
            return self.agent.fetch()
        return self.agent.latest()

    def post_metrics(self, metrics: dict[str, float]) -> None:
        if self.agent is not None:
            self.agent.post_metrics(metrics)

    def stop_watchers(self) -> None:
        """The abort watch, the notices and the preemption watcher end (the loop ended)."""
        if self.watch is not None:
            self.watch.stop()
        self.notices.close()
        if self.cloud_watch is not None:
            self.cloud_watch.close()

    def debug(self, msg: str) -> None:
        if self.debug_on:
            log.debug("%.4f w%s: %s", time.time(), self.worker_id, msg)
