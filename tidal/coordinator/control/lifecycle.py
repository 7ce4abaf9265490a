"""The life of worker processes, carried out: start, placement, exits, hung workers, and a
restarted coordinator's adoption of the workers it finds.

A part of ``Coordinator``; every method runs under the coordinator's lock. The backend
reports (exits, placement, read through the executor); these methods turn reports into
worker states and generations, and what the rules decide (``exit_rules``, ``reform_rules``)
into actions (``actions``: start, signal, adopt) that the executor carries out. An exit is
a failure to recover from unless the worker was asked to leave; an exit with a positive
code (the script raised) fails the job, since every worker runs the same code. Under
``--torchrun`` a world's member's end is judged by ``world_rules.judge_member_exit`` and a
loss restarts the whole world (``worlds``) instead of re-forming without it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

from tidal.backends import Exit
from tidal.checkpoint.layout import newest_usable
from tidal.checkpoint.location import Location
from tidal.coordinator.actions import AdoptWorker, SignalWorker, StartWorker
from tidal.coordinator.job import Job, durable_fields
from tidal.coordinator.records.records import WorkerRecord
from tidal.coordinator.recovery import Control, Rebuilt, rebuild, regenerate
from tidal.coordinator.rules.busy import BusyFacts, busy_members
from tidal.coordinator.rules.exit_rules import ExitFacts, HealthFacts, judge_exit, to_kill
from tidal.coordinator.rules.pacing import clocks_restart
from tidal.coordinator.rules.reform_rules import roll_back
from tidal.coordinator.rules.verdicts import Act
from tidal.coordinator.rules.world_rules import judge_member_exit
from tidal.protocol import JobState, JobStatus, WorkerEnv, WorkerState, worker_token
from tidal.restarts import keep_recent

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.control.generations import Generations
    from tidal.coordinator.control.ledger import Ledger
    from tidal.coordinator.executor import Executor

STOP_GRACE_S = 30.0
# A longer gap between two passes of the control loop means the coordinator did not run
# (the loop passes every 20 ms, and at once on API calls that need a decision).
NOT_RUNNING_S = 2.0
NOT_STARTED = (WorkerState.PENDING, WorkerState.STARTING)  # not registered yet


def recovered_job(status: JobStatus, saved: dict | None, *, namespace: str) -> tuple[Job, Rebuilt]:
    """The job a restarted coordinator starts from: its previous coordinator's records
    (``status``) and control record (``saved``), rebuilt (``recovery.rebuild``)."""
    control = Control.from_dict(saved) if saved else Control(requested=status.target_workers)
    r = rebuild(status, control, namespace=namespace, now=time.time())
    job = Job(
        **{name: getattr(control, name) for name in durable_fields()},
        workers=r.workers,
        generations=r.generations,
        state=r.state,
        outcome=r.outcome,
        step=r.step,
        target=status.target_workers,
        checkpointed={c.step for c in status.checkpoints},
        stop_requested_at=time.monotonic() if control.stop_requested else None,
        created=status.created,
        metrics={k: v for k, v in status.metrics.items() if isinstance(v, (int, float))},
    )
    return job, r


class Lifecycle:
    def __init__(
        self,
        *,
        job: Job,
        spec: JobSpec,
        executor: Executor,
        ledger: Ledger,
        generations: Generations,
        token: str,
        url: str,
        first_worker_id: int,
        checkpoint_dir: Location | None,
    ) -> None:
        """``token``: the job's, from which each worker's credential is derived; ``url``:
        the API's, given to workers; ``first_worker_id``: the first worker's id (a resumed
        job's go on from its records')."""
        self.job = job
        self.spec = spec
        self.executor = executor
        self.ledger = ledger
        self.generations = generations
        self.token = token
        self.url = url
        self.first_worker_id = first_worker_id
        self.checkpoint_dir = checkpoint_dir
        self._last_check: float | None = None  # the last heartbeat check (monotonic)

    # -- a restarted coordinator ---------------------------------------------------------
    def adopt(self, rebuilt: Rebuilt, *, incarnation: int) -> None:
        """Take over from the job's previous coordinator (``recovered_job``): adopt its live
        workers, open the generation ``recovery.regenerate`` says (one that had not formed,
        or one that names a member the dead coordinator retired), count the ones that are
        gone as lost."""
        job = self.job
        adopted, lost = [], []
        for w in job.workers.values():
            if w.adopted:  # not live: nothing to adopt
                continue
            if w.state == WorkerState.STOPPING:
                w.stopping_since = time.monotonic()
            if self.executor.do(
                AdoptWorker(worker_id=w.id, pid=w.pid or 0, env=self.worker_env(w.id))
            ):
                adopted.append(w.id)
            else:
                lost.append(w.id)
        self.ledger.event(
            "coordinator",
            f"coordinator restarted (pid {os.getpid()}, restart {incarnation}): "
            f"{len(adopted)} live workers {adopted} adopted, awaiting their re-registration"
            + (f"; {lost} gone" if lost else ""),
        )
        latest = job.latest
        # Not a world's (--torchrun): its members run their script, ``worlds`` decides.
        if latest is not None and job.outcome is None and not self.spec.torchrun:
            again = regenerate(
                members=list(latest.members),
                formed=latest.formed,
                live=set(adopted),
                retired={w.id for w in job.workers.values() if w.retired},
            )
            if again is not None:  # before the lost are counted: they are in neither
                self.generations.open(*again)
        for wid in lost:
            self.on_exit(
                Exit(worker_id=wid, returncode=-9, reason="gone when the coordinator restarted")
            )
        self.ledger.save_control()

    def worker_env(self, wid: int) -> dict[str, str]:
        """What a worker's process is launched with: its id, credential, the API's URL."""
        token = worker_token(self.token, wid)  # its own credential, not the job's token
        return WorkerEnv(url=self.url, token=token, worker_id=wid).to_environ()

    def on_exit(self, ex: Exit) -> None:
        """A worker's process ended: how it counts (``exit_rules.judge_exit``), carried
        out."""
        job = self.job
        w = job.workers.get(ex.worker_id)
        if w is None:
            return
        w.exit_code = ex.returncode
        was_member = w.id in job.members
        now, limit = time.time(), self.spec.restart_limit
        facts = ExitFacts(
            worker_id=w.id,
            returncode=ex.returncode,
            how=ex.describe(),
            reason=ex.reason,
            detail=self.executor.describe_exit(w.id) if ex.returncode > 0 else "",
            retired=w.retired,
            leaving=w.state == WorkerState.STOPPING,
            was_member=was_member,
            kill_reason=w.kill_reason,
            job_decided=job.outcome is not None or job.script_stop is not None,
            status_known=ex.known,
            joined=w.last_heartbeat is not None or w.state not in NOT_STARTED,
            script=os.path.basename(self.spec.script),
            failures=job.failures,
            max_restarts=limit,
            recent=tuple(job.loss_times),
            now=now,
            target=job.target,
            min_workers=self.spec.min_workers,
            alive_others=sum(
                1 for m in job.workers.values() if m.live and not m.retired and m.id != w.id
            ),
        )
        if self.spec.torchrun and was_member:  # a world's member (``world_rules``)
            peers = [job.workers[m] for m in job.members if m != w.id]
            verdict = judge_member_exit(
                facts,
                formed=job.latest.formed,
                peer_failed=any(p.state == WorkerState.FAILED and not p.retired for p in peers),
            )
        else:
            verdict = judge_exit(facts)
        w.state, w.rank = verdict.state, None
        self.ledger.event(verdict.kind, verdict.message)
        if verdict.lost:
            job.failures += 1
            job.loss_times = keep_recent(limit, [*job.loss_times, now], now)
            if was_member:  # it explains its peers' failed collectives (``repeated_failure``)
                job.failed_collectives = None
        failed = f"worker {w.id} failed ({w.kill_reason or ex.describe()})"
        if verdict.reform and self.spec.torchrun:  # the whole world restarts (``worlds``)
            job.restart_why = job.restart_why or failed
        elif verdict.reform:
            self.generations.open([m for m in job.members if m != w.id], failed)
        if verdict.fail_job and job.outcome is None:
            self.ledger.decide(JobState.FAILED, verdict.fail_job)
        if verdict.target is not None:
            self.ledger.set_target(verdict.target, verdict.target_why)
        self.ledger.save_worker(w)

    def track_placement(self) -> None:
        """``pending`` workers the backend has placed since become ``starting``."""
        waiting = None
        for w in self.job.workers.values():
            if w.state == WorkerState.PENDING:
                waiting = self.executor.waiting() if waiting is None else waiting
                if w.id not in waiting:
                    w.state, w.node = WorkerState.STARTING, self.executor.node(w.id)
                    self.ledger.save_worker(w)
                    self.ledger.event("worker", f"worker {w.id} placed on {w.node}")

    def check_heartbeats(self) -> None:
        """Kill hung workers (no heartbeat) and workers that do not leave when asked.

        Silence is judged only over time the coordinator itself ran: after a gap between
        two passes longer than ``NOT_RUNNING_S`` (the process was stopped, the machine
        starved it, its VM was suspended), heartbeats could not be read meanwhile, so every
        clock restarts at once instead of condemning workers that trained on."""
        job = self.job
        now, mono = time.time(), time.monotonic()
        last, self._last_check = self._last_check, mono
        gap = 0.0 if last is None else mono - last  # None: the first check
        if clocks_restart(gap_s=gap, not_running_s=NOT_RUNNING_S):
            self.ledger.event(
                "coordinator",
                f"the coordinator did not run for {gap:.1f} s (stopped or starved); "
                "heartbeat clocks restart",
            )
            for w in job.workers.values():
                if w.last_heartbeat is not None:
                    w.last_heartbeat = max(w.last_heartbeat, now)
                if w.stopping_since is not None:
                    w.stopping_since += gap
        mono = time.monotonic()
        facts = [
            HealthFacts(
                worker_id=w.id,
                state=w.state,
                silent_s=now - w.last_heartbeat if w.last_heartbeat is not None else None,
                stopping_s=mono - w.stopping_since if w.stopping_since is not None else None,
                killed=w.kill_reason is not None,
            )
            for w in job.workers.values()
        ]
        formed = job.formed()
        job.busy = busy_members(
            [
                BusyFacts(
                    worker_id=w.id,
                    generation=w.beat_generation,
                    script_s=w.script_s,
                    silent_s=now - w.last_heartbeat if w.last_heartbeat is not None else None,
                )
                for w in job.workers.values()
                if w.script_s is not None and w.state == WorkerState.RUNNING
            ],
            generation=formed.id if formed is not None else None,
            heartbeat_timeout_s=self.spec.heartbeat_timeout_s,
        )
        for kill in to_kill(
            facts, heartbeat_timeout_s=self.spec.heartbeat_timeout_s, stop_grace_s=STOP_GRACE_S
        ):
            wid = kill.worker_id
            job.workers[wid].kill_reason = kill.reason
            self.ledger.event(kill.kind, f"worker {wid} {kill.reason}; killing it")
            self.executor.do(SignalWorker(worker_id=wid, signum=signal.SIGKILL, why=kill.reason))

    def answer_state_lost(self) -> None:
        """No member of the latest generation holds the job's state (every holder was lost
        before the state reached anyone else; ``heal.StateLost``). Never train on from
        scratch: roll every member back to the newest verified checkpoint, or fail the job
        saying why."""
        job = self.job
        if job.state_lost is None or job.outcome is not None:
            return
        gen_id, why = job.state_lost
        job.state_lost = None
        latest = job.latest
        if latest is None or latest.id != gen_id:  # already superseded
            return
        self.ledger.event("failure", why)
        lost = latest.committed_step
        path, step, warnings = (
            newest_usable(self.checkpoint_dir) if self.checkpoint_dir else (None, None, [])
        )
        for line in warnings:
            self.ledger.event("checkpoint", line)
        verdict = roll_back(lost_step=lost, checkpoint_step=step)
        if verdict.act is Act.FAIL:
            self.ledger.decide(JobState.FAILED, verdict.why)
            return
        self.ledger.event("checkpoint", verdict.why)
        job.step = step
        self.generations.open(
            latest.members,
            f"rolled back to the checkpoint of step {step}: the state's holders were lost",
            resume=(str(path), step),
        )

    def retire(self, w: WorkerRecord) -> None:
        """Ask ``w`` to exit for good (a scale-down, a leaver, the job's end)."""
        w.retired = True
        self.ledger.save_control()
        if w.state in NOT_STARTED:  # no heartbeat to tell it; pending ones are cancelled
            self.executor.do(SignalWorker(worker_id=w.id, signum=signal.SIGTERM, why="retired"))
        w.ask_to_exit(time.monotonic())
        self.ledger.save_worker(w)

    def start_worker(self) -> None:
        job = self.job
        wid = max(job.workers, default=self.first_worker_id - 1) + 1
        w = WorkerRecord(id=wid)
        job.workers[wid] = w
        # Recorded before it is launched: a coordinator that dies in between leaves a record
        # (its successor counts the worker as lost, and refuses it if it registers), never
        # a process with an id it could give a second worker.
        self.ledger.save_worker(w)
        w.pid = self.executor.do(StartWorker(worker_id=wid, env=self.worker_env(wid)))
        if wid in self.executor.waiting():
            w.state = WorkerState.PENDING
            self.ledger.event(
                "worker",
                f"worker {wid} asked of the {self.spec.backend} backend; pending until placed",
            )
        else:
            w.node = self.executor.node(wid)
            # a joined host's agent starts it: its pid comes with its registration
            where = f"pid {w.pid}" if w.pid is not None else f"on {w.node}"
            self.ledger.event("worker", f"worker {wid} started ({where})")
        self.ledger.save_worker(w)
