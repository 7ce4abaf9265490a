"""The elastic loop: a ``Trainer`` under ``tidal run``, from registration to its done report.

A mixin of ``Trainer`` (``runtime``), which holds the state and the step boundary
(``_before_sync``, ``_commit``); joining, forming and leaving generations are
``membership``'s. Contracts:

- A step is committed only when this member's all-reduce completed (``Step._failed`` is
  None); a failed step's tracked state is rewound, the member leaves the generation,
  reports the failure and joins the next one, where the step is redone after healing.
- A change takes effect only at a step boundary every member reached: after a step whose
  control word said ``switch`` or ``stop``, or at a --schedule step the member holds at
  (``hold_steps``). A member that knows, before its update, that the generation after the
  step leaves it out leaves with the step uncommitted, as after a failed step
  (``leaving``).
- However the loop ends (completed, stopped, told to leave, an exception in the script),
  the member sends its pending report, leaves its group, writes the final checkpoint when
  it is the last generation's rank 0 and the job finished or stopped, waits for any
  checkpoint in flight, and reports done. When the script ended the loop (``trainer.stop()``,
  ``break``) the member first reports the stop, and the coordinator names the checkpoint's
  writer (``stopping``).
- Every collective is bounded by the abort watch (``watch``): on gloo it fails the waits it
  gives up on and cuts the group's connections; on NCCL it aborts the communicators.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
import urllib.parse
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tidal import devices
from tidal.store_auth import AuthStore
from tidal.worker import busy, cloud_watch, ddp, identity, landing, probes
from tidal.worker import group as grp
from tidal.worker.agent import Agent
from tidal.worker.durable import Durable
from tidal.worker.leaving import LEFT_BEFORE_UPDATE
from tidal.worker.step import Step
from tidal.worker.stopping import LoopStep, ScriptStop, writes_final
from tidal.worker.watch import AbortWatch, Facts


class ElasticLoop(ScriptStop):
    _timeout_gen: int | None = None  # the generation whose group got ``busy.long_timeout``

    def _run_elastic(self, max_steps: int) -> Iterator[Step]:
        assert self._env is not None
        ddp.warm_up(self.module)
        if self._sharding == "ddp":  # memory a heal's optimizer state lands in, touched now
            self._landing = landing.prepare(self.optimizer)
        self._agent = Agent(self._env)
        self._agent.install_preemption_handler()
        cfg = self._agent.register(max_steps=max_steps).config
        self._cfg = cfg
        self._cloud_watch = cloud_watch.start(
            cfg.preemption_notice,
            self.worker_id,
            self._agent.announce_leaving,
            period_s=cfg.preemption_poll_s,
        )
        self._start_comm(cfg.comm)
        self._durable = Durable(cfg, self._agent)
        self._agent.post_metrics(  # the coordinator's cost projection and policy need these
            {"max_steps": max_steps, "global_batch_size": self.sampler.global_batch_size}
        )
        resumed = self._durable.resume(
            self.module, self.optimizer, self._tracked, data_order=identity.data_order(self.sampler)
        )
        if resumed is not None:
            self.step, self._has_state = resumed, True
            self._landing = []  # its own state, loaded, is the landing now: not twice
            self._agent.step = resumed
        if self._sharding == "fsdp":  # the module becomes the template: after any resume
            self._start_sharded(cfg)
        self._connect_store()
        finished = False
        try:
            member = self._join()
            while member and self.step < max_steps and not self._stopping:
                if self._buckets_pending and not self._settle_buckets():
                    member = self._join()
                    continue
                if self._timeout_gen != self.generation and self._fsdp is None:
                    busy.long_timeout(self._backend)  # the watch bounds the steps (``busy``)
                    self._timeout_gen = self.generation
                index = self.step
                probes.point("step", index, self.generation)
                step = LoopStep(self, index, self.sampler.shard(index, self.rank, self.world_size))
                mark = self._tracked.mark() if self._tracked else None
                self._update.begin()
                try:
                    yield step
                except GeneratorExit:  # the script left the loop in the body (``stopping``)
                    self._left_in(step, mark)
                    raise
                if step._failed is not None:
                    if mark is not None:  # the step is redone: what it moved moves back
                        self._tracked.rewind(mark)
                    self._leave_group(failed=True)
                    member = self._fail_step(step._failed)
                    continue
                self._time_split(step)
                if (why := self._leaves_uncommitted(index + 1, max_steps)) is not None:
                    print(  # one line a leaver: what bench.chaos counts
                        f"tidal: worker {self.worker_id} {LEFT_BEFORE_UPDATE} {index} of "
                        f"generation {self.generation}: {why}",
                        flush=True,
                    )
                    if mark is not None:  # as after a failed step: the step is not applied
                        self._tracked.rewind(mark)
                    self.optimizer.zero_grad(set_to_none=True)
                    self._leave_group()
                    member = self._join()
                    continue
                held = self._hold_soon(index + 1, max_steps)
                self._commit()
                if self._next_word is None:  # the step carried a word: when the next rides
                    self._next_word = index + self._control.every
                if self._fsdp is None and self._durable.due(self.step) and self.rank == 0:
                    self._checkpoint()
                if not (self._sharded_checkpoint_taken() and self._copies_taken()):
                    member = self._join()
                    continue
                if self._stop_asked:  # ``trainer.stop()`` in this step's body
                    break
                if self._control.stop:
                    self._stopping = True
                elif self.step >= max_steps:
                    break
                elif self._control.switch or (
                    self.step in self._cfg.hold_steps and self._hold(self.step, held)
                ):
                    # Held at this step (no switch): form from the answer that released it.
                    answer = None if self._control.switch else self._hold_answer[1]
                    self._gather_for_leavers()
                    self._leave_group()
                    member = self._join(answer)
            if member and self._fsdp is not None and not self._stop_asked:  # the group lives
                self._sharded_checkpoint_taken(final=True)
                self._gather_final()
            self.completed = self.step >= max_steps
            finished = member or self._stopping
        finally:
            self._send_report()  # before the done report, as a later step would have sent it
            stopped = self._report_script_stop()  # before leaving: peers find it as they fail
            self._leave_group()
            if writes_final(
                finished=finished,
                last_rank=self._last_rank,
                sharded=self._fsdp is not None,
                answer=stopped,
                stop_step=self._stop_step(),
            ):
                self._checkpoint()
            self._durable.wait()
            if self._watch is not None:
                self._watch.stop()
            self._notices.close()
            if self._cloud_watch is not None:
                self._cloud_watch.close()
            try:
                self._agent.report_done(step=self.step, completed=self.completed)
            finally:
                atexit.register(self._agent.close)

    def _start_comm(self, comm: str) -> None:
        """Choose the process groups' backend (``devices.resolve_comm``) and start the abort
        watch (``watch``). On gloo the watch fails the waits it gives up on and cuts the
        group's connections (``waits``); on NCCL it aborts the communicators, and the worker
        takes its device, torch's watchdog told to do nothing."""
        self._backend = devices.resolve_comm(comm, self.device)
        if self._backend != "nccl":
            self._control.waits = self._waits
            self._watch = AbortWatch(self._watch_facts, self._cut_group)
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # the watch handles errors
            torch.cuda.set_device(self.device)
            self._watch = AbortWatch(self._watch_facts, grp.abort_group)
        watch = self._watch
        self._agent.script_s = lambda: busy.script_s(
            watch.script_s(), in_group=self._ddp is not None
        )

    def _cut_group(self) -> None:
        """The gloo watch's abort: the training thread's wait fails, the peers' see the
        connections close."""
        self._waits.abort("the abort watch cut a collective a peer left")
        grp.cut_group()

    def _other_ports(self) -> tuple[int, ...]:
        """The ports of this worker's connections besides its group's: the coordinator's
        API (the store's is known to ``form_group``)."""
        port = urllib.parse.urlsplit(self._env.url).port
        return (port,) if port is not None else ()

    def _watch_facts(self, open_s: float | None) -> Facts:
        latest = self._agent.latest() if self._agent else None
        dropped = False
        if latest is not None and latest.generation is not None:
            gen = latest.generation
            dropped = gen.id > self.generation and not set(self._members) <= set(gen.members)
        peers_busy = latest is not None and busy.peers_busy(
            busy=latest.busy,
            members=self._members,
            me=self.worker_id,
            answer_age_s=time.monotonic() - self._agent.latest_at,
            interval_s=latest.interval_s or self._cfg.heartbeat_interval_s,
        )
        return Facts(
            open_s=open_s,
            step_s=self._step_s,
            dropped=dropped,
            timeout_s=self._cfg.collective_timeout_s,
            busy=peers_busy,
            stopped=latest is not None and latest.stop,
        )

    def _connect_store(self) -> None:
        """A client of the store named by the newest registration (a restarted coordinator
        serves a new one: ``Agent.epoch`` tells), authenticating values with its key."""
        cfg = self._agent.config
        self._store_epoch = self._agent.epoch
        self._cfg = cfg
        self._agreed = False  # a new store holds no settings yet: agree again (``identity``)
        client = dist.TCPStore(
            cfg.store_host,
            cfg.store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=cfg.collective_timeout_s),
        )
        # Every value read through it is authenticated; c10d's keys too (``store_auth``).
        self._store = AuthStore(client, cfg.store_key)
