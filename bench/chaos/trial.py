"""One chaos trial: a real job, a few seeded faults, and the checks after it.

A trial starts ``bench/chaos/train.py`` with ``tidal run --detach`` in a fresh ``--home``,
slowed to ``pace_s`` a step while faults are injected (``kinds.py``): after each one the
trial waits until the job is *settled* again (running, as many members as its target, the
newest generation trained a few steps). Then the job runs to its end at full speed and the
checks run, in this order; the first that fails names the trial's failure:

``outcome``    the job succeeded, or failed with the reason its faults made inevitable;
``processes``  no process of the trial outlives the job's end by more than 15 s;
``checkpoint`` a job that succeeded has its final step checkpointed (durable.py's contract);
``params``     every member that finished (exited 0) wrote parameters equal to the 1-worker
               reference (relative L2 <= 1e-12 over parameters, momentum and the EMA's
               weights; the scheduler's and scaler's state exactly) at the final step;
``samples``    every step consumed the 1-worker run's samples, each once (``checks``);
``pause``      no generation's ``pause_s`` and no stall (the longest time no new step was
               committed, from the members' step logs) while a fault recovered exceeded
               the fault's bound (``kinds.py``);
``recovery``   (during the trial) a fault was not recovered from within the time limit;
``error``      the trial itself could not be carried out (a CLI call failed, ...).

The end-to-end tests' helpers (``tests/e2e_helpers.py``) provide the home, the in-process
status poll, the marker that finds every process of the trial, and the cleanup.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

from e2e_helpers import MARKER_VAR, Home, Job, pid_alive, summarize

from bench.chaos import checks, steps
from bench.chaos.records import Event, JobEnded, Settings, TrialFailure
from tidal.testing.faults import fired_records

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "bench" / "chaos" / "train.py"

TERMINAL = ("succeeded", "failed", "stopped", "interrupted")
POLL_S = 0.1
HEARTBEAT_LAG_S = 0.8  # a heartbeat, a status snapshot (up to 0.5 s old), a poll
SLOW_PACE_S = 0.1
SETTLED_STEPS = 3  # a settled job trained this many steps in its newest generation


class Watch:
    """Polls the job's status (in process: ``Job.poll``); ``last`` is the newest answer."""

    def __init__(self, job: Job, on_poll=None) -> None:
        self.job = job
        self.last: dict | None = None
        self.on_poll = on_poll

    def poll(self) -> dict:
        self.last = self.job.poll()
        if self.on_poll is not None:
            self.on_poll(self.last)
        return self.last

    def until(self, pred, timeout: float, what: str, *, ended_ok: bool = False) -> dict:
        """Poll until ``pred(status)``; ``JobEnded`` if the job ends first (unless that is
        what ``pred`` waits for), ``TrialFailure('recovery')`` after ``timeout`` s."""
        deadline, error = time.monotonic() + timeout, None
        while True:
            try:
                s = self.poll()
                error = None
                if pred(s):
                    return s
                if s["state"] in TERMINAL and not ended_ok:
                    raise JobEnded(s["state"])
            except (JobEnded, TrialFailure):
                raise
            except Exception as exc:  # noqa: BLE001 - reported if it lasts
                error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise TrialFailure(
                    "recovery",
                    f"no {what} within {timeout:.0f} s"
                    + (f" (last error: {error})" if error else ""),
                )
            time.sleep(POLL_S)

    def idle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a coordinator between lives
                pass
            time.sleep(min(POLL_S, max(0.0, left)))


def members(s: dict) -> list[dict]:
    """The running members of the job's newest generation, by rank."""
    gens = s["generations"]
    ids = gens[-1]["members"] if gens else []
    by_id = {w["id"]: w for w in s["workers"]}
    return [by_id[i] for i in ids if i in by_id and by_id[i]["state"] == "running"]


def settled(s: dict, after_step: int = 0) -> bool:
    """Running with as many members as the target, the newest generation trained >= 3 steps."""
    gens = s["generations"]
    if s["state"] != "running" or not gens or gens[-1]["start_step"] is None:
        return False
    g = gens[-1]
    running = [w for w in s["workers"] if w["state"] == "running"]
    return (
        len(g["members"]) == s["target_workers"] == len(running)
        and s["step"] >= max(after_step, g["start_step"]) + SETTLED_STEPS
    )


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ChaosHome(Home):
    """A ``Home`` whose jobs also get ``extra`` in their environment (``--debug``:
    ``TIDAL_DEBUG=1``, the workers' membership trace in their logs)."""

    def __init__(self, path: Path, extra: dict[str, str]) -> None:
        super().__init__(path)
        self.extra = extra

    def env(self, faults: str | None = None) -> dict[str, str]:
        return super().env(faults) | self.extra


class Trial:
    """The job of one trial and what the fault kinds need to act on it."""

    def __init__(self, seed: int, settings: Settings, root: Path, reference: Path) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.settings = settings
        self.root = root
        self.reference = reference
        root.mkdir(parents=True, exist_ok=True)
        self.home = ChaosHome(root / "home", {"TIDAL_DEBUG": "1"} if settings.debug else {})
        self.out = root / "out"
        self.pace = root / "pace"
        self.faults_file = root / "faults"
        self.name = f"chaos-{seed}"
        self.job: Job | None = None
        self.watch: Watch | None = None
        self._paced: float | None = None  # the pace written, None once the job runs free
        rng = self.rng
        self.workers = rng.choice([2, 3])
        self.min_workers = rng.choice([1, 2])
        self.max_workers = 4

    @property
    def setup(self) -> dict:
        return {
            "workers": self.workers,
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "max_steps": self.settings.max_steps,
        }

    # -- the job ---------------------------------------------------------------------------
    def start(self) -> dict:
        st = self.settings
        write_atomic(self.pace, str(st.pace_s))
        self._paced = st.pace_s
        write_atomic(self.faults_file, "")
        self.job = self.home.start(
            self.name,
            "--workers", str(self.workers),
            "--min-workers", str(self.min_workers),
            "--max-workers", str(self.max_workers),
            "--heartbeat-timeout", str(st.heartbeat_timeout_s),
            "--collective-timeout", str(st.collective_timeout_s),
            "--max-restarts", "1000",
            "--checkpoint-every", str(st.checkpoint_every),
            "--keep-checkpoints", "2",
            script=TRAIN,
            script_args=[
                "--max-steps", str(st.max_steps),
                "--seed", str(st.train_seed),
                "--out", str(self.out),
                "--pace", str(self.pace),
            ],
            faults=f"@{self.faults_file}",
        )  # fmt: skip
        self.watch = Watch(self.job, on_poll=self._pace)
        return self.watch.until(settled, 180, "first generation training")

    def _pace(self, s: dict) -> None:
        """Past half of its steps the job slows down (``SLOW_PACE_S``) so that it does not
        run out of steps while faults are still to come; ``finish`` lets it run free."""
        if self._paced is not None and s["step"] > self.settings.max_steps // 2:
            if self._paced != SLOW_PACE_S:
                self._paced = SLOW_PACE_S
                write_atomic(self.pace, str(SLOW_PACE_S))

    def set_pace(self, seconds: float) -> None:
        """A fixed pace from now on (the automatic slow-down off)."""
        self._paced = None
        write_atomic(self.pace, str(seconds))

    def settle(self, after_step: int = 0, what: str = "recovery") -> dict:
        return self.watch.until(
            lambda s: settled(s, after_step), self.settings.recovery_timeout_s, what
        )

    def stall(self, t0: float, t1: float) -> float:
        return steps.stall(self.out, t0, t1)

    def commits_between(self, t0: float, t1: float) -> int:
        return steps.commits_between(self.out, t0, t1)

    def until_committed(self, step: int, timeout: float = 120) -> None:
        """Until a member's step log shows ``step`` committed (no status lag)."""
        end = time.monotonic() + timeout
        while not any(s >= step for _, s in steps.commits(self.out)[-50:]):
            if time.monotonic() > end:
                raise TrialFailure("recovery", f"step {step} not reached in {timeout:.0f} s")
            if self.watch.poll()["state"] in TERMINAL:
                raise JobEnded(self.watch.last["state"])
            time.sleep(0.05)

    def settle_after(self, t: float, what: str) -> dict:
        """Settled, with the step counted from what the job did after time ``t`` (status
        steps come from heartbeats and status answers are shared snapshots: they lag), and
        the members' own step logs showing ``SETTLED_STEPS`` steps committed since ``t``. The
        logs are the proof: a restarted coordinator's status starts from its records' step,
        behind the workers', so its step can pass the base while the job is stuck (seed
        320000008: a member SIGSTOPped with the coordinator's SIGKILL looked settled at
        once; the next fault then found no step committed)."""
        self.watch.idle(max(0.0, t + HEARTBEAT_LAG_S - time.time()))
        base = self.watch.until(lambda s: True, self.settings.recovery_timeout_s, "a status")
        s = self.settle(base["step"], what)
        end = time.monotonic() + self.settings.recovery_timeout_s
        if self.commits_between(t, time.time()) >= SETTLED_STEPS:
            return s
        while self.commits_between(t, time.time()) < SETTLED_STEPS:
            if time.monotonic() > end:
                raise TrialFailure(
                    "recovery", f"{what}: the members committed no {SETTLED_STEPS} steps"
                )
            if self.watch.poll()["state"] in TERMINAL:
                raise JobEnded(self.watch.last["state"])
            time.sleep(POLL_S)
        return self.settle(self.watch.last["step"], what)  # trained again: settled again

    def scale(self, n: int) -> None:
        """``tidal scale`` through the CLI's own entry point (in process: no interpreter
        start, so that several calls land in quick succession)."""
        import contextlib
        import io

        from tidal.cli import main as cli_main

        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = cli_main(["scale", "--home", str(self.home.path), self.name, str(n)])
        if rc != 0:
            raise TrialFailure("error", f"tidal scale {n} exited {rc}: {err.getvalue().strip()}")

    def signal(self, pid: int | None, sig: int) -> bool:
        """Send ``sig`` to ``pid`` if it is a live process of this trial (its environment
        carries the home's marker: a pid read from a lagging status may have been reused)."""
        if not pid or not pid_alive(pid):
            return False
        needle = f"{MARKER_VAR}={self.home.marker}".encode() + b"\0"
        try:
            if needle not in Path(f"/proc/{pid}/environ").read_bytes():
                return False
            os.kill(pid, sig)
        except OSError:
            return False
        return True

    def training_again(self, t: float, generations: int, what: str) -> dict:
        """A generation newer than the first ``generations`` has trained, and the job
        committed a step after ``t``: the fault was answered (its replacement may still be
        starting)."""
        end = time.monotonic() + self.settings.recovery_timeout_s

        def answered(s: dict) -> bool:
            gens = s["generations"]
            newer = len(gens) > generations and gens[-1]["start_step"] is not None
            return newer and self.commits_between(t, time.time()) > 0

        s = self.watch.until(answered, self.settings.recovery_timeout_s, what)
        self.watch.idle(min(0.5, max(0.0, end - time.monotonic())))
        return s

    def ensure_world(self, n: int) -> dict | None:
        """At least ``n`` members (scaled up and settled if needed); None if above max."""
        s = self.watch.last
        if n > self.max_workers:
            return None
        if len(members(s)) >= n:
            return s
        if s["target_workers"] < n:
            self.scale(n)
        return self.settle(s["step"], f"scale up to {n} workers")

    def leaver_skips(self) -> int:
        """How many times a member left before its last update (``tidal/worker/membership/leaving.py``):
        the job's events of kind ``leave`` (``protocol.Departure``), as status reads them."""
        if self.job is None:
            return 0
        try:
            return len(_messages(self.job.poll(), "leave"))
        except Exception:  # noqa: BLE001 - a job that never started has no events
            return 0

    def arm(self, spec: str) -> None:
        write_atomic(self.faults_file, spec + "\n")

    def fired(self, spec: str) -> float | None:
        """When the armed fault ``spec`` fired (the workers' record of it), or None."""
        found = [r["time"] for r in fired_records(self.faults_file) if r["spec"] == spec]
        return found[0] if found else None

    def wait_fired(self, spec: str, timeout: float) -> float | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (t := self.fired(spec)) is not None:
                return t
            self.watch.idle(0.2)
            if self.watch.last["state"] in TERMINAL:
                break
        return self.fired(spec)

    # -- the end ---------------------------------------------------------------------------
    def finish(self, events: list[Event], notes: list[str]) -> tuple[dict, list[dict]]:
        """Run to the end at full speed, then every check; returns (status, pauses)."""
        self._paced = None
        write_atomic(self.pace, "0")
        write_atomic(self.faults_file, "")
        s = self.watch.until(lambda s: s["state"] in TERMINAL, 300, "end of the job", ended_ok=True)
        ended_at = time.monotonic()
        s = self.job.status()  # the real CLI, as a user reads it
        if s["state"] != "succeeded":
            said = " ".join(_messages(s, "job"))
            allowed = [e.may_fail for e in events if e.may_fail and e.may_fail in said]
            if not (allowed and s["state"] == "failed"):
                why = next((m for m in reversed(_messages(s, "job")) if "job " in m), "")
                raise TrialFailure("outcome", f"job {s['state']} ({why})")
        try:
            self.home.assert_no_processes(timeout=max(0.0, 15 - (time.monotonic() - ended_at)))
        except AssertionError as exc:
            raise TrialFailure("processes", str(exc)) from None
        if s["state"] == "succeeded":
            last = s["checkpoints"][-1]["step"] if s["checkpoints"] else None
            if last != s["step"] or last != self.settings.max_steps:
                raise TrialFailure(
                    "checkpoint",
                    f"the job succeeded at step {s['step']}, its newest checkpoint is of step "
                    f"{last} (the final step is always checkpointed)",
                )
            checks.params(s, self.out, self.reference, self.settings.max_steps)
            checks.samples(self.out, self.reference, self.settings.max_steps)
        pauses = checks.pauses(s, events)
        leftovers = sorted(p.name for p in (self.job.dir / "checkpoints").glob(".tmp-*"))
        if leftovers:  # a write killed half way: harmless, never taken for a checkpoint
            notes.append(f"temporary checkpoint folders left: {leftovers}")
        return s, pauses

    def close(self, keep: Path | None) -> None:
        try:
            self.home.cleanup()
        finally:
            if keep is not None:
                shutil.copytree(self.root, keep, dirs_exist_ok=True, symlinks=True)
            shutil.rmtree(self.root, ignore_errors=True)

    def describe(self) -> tuple[str, str, str]:
        """For a failed trial: the status, the logs' tails, and (with py-spy) the Python
        stacks of every process of the trial still alive (what a hang was waiting for)."""
        try:
            status = self.job.poll() if self.job else None
        except Exception:  # noqa: BLE001
            status = self.watch.last if self.watch else None
        stacks = []
        spy = shutil.which("py-spy")
        for pid in self.home.live_processes()[:8] if spy else []:
            try:
                dump = subprocess.run(
                    [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
                ).stdout
            except subprocess.TimeoutExpired:
                dump = "(py-spy timed out)"
            stacks.append(f"--- pid {pid} ---\n{dump.strip()[-4000:]}")
        logs = self.job.logs_tail(20) if self.job else ""
        return summarize(status), logs, "\n".join(stacks)


def _messages(s: dict, kind: str) -> list[str]:
    return [e["message"] for e in s["events"] if e["kind"] == kind]
