"""Hosting a job: the coordinator, its API server and the control loop in one process.

``tidal run`` calls ``run_job`` in the foreground; ``tidal run --detach`` calls it in a
background process (``host.detached``). The loop also feeds the dashboard's history
(``Recorder``), which writes the TensorBoard events of ``--tensorboard``.

The hosting process holds the job's lock (``HOME/jobs/NAME/lock``, see ``home``) for its
whole life: ``tidal run``/``tidal resume`` take it before they check the job's record and hand
it to this process (``--lock-fd``), so no second coordinator can host the job meanwhile.

A hung-up terminal or a closed output pipe leaves the job training (``output``): its lines go
to ``HOME/jobs/NAME/coordinator.log`` from then on, and its events say so.

How a job ends, in one line on stderr (with ``--quiet`` too): nothing when it succeeded;
``tidal: error: job NAME failed: WHY`` (or ``stopped at step N``) otherwise;
``tidal: error: cannot write HOME/tidal.db: ...`` when the job's records cannot be written (the
members are stopped first, so they write their final checkpoint if they can); and a warning
line when some checkpoints of a job that succeeded could not be written.
"""

from __future__ import annotations

import gc
import os
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.backends import serving_address
from tidal.backends.local import start_zygote
from tidal.backends.zygote import Zygote
from tidal.config import JobSpec
from tidal.coordinator.actions import KillEveryWorker
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.process.supervisor import Attach, Hosting, Supervision, supervise
from tidal.coordinator.records.home import HomeError, JobBusy, db_path, job_dir
from tidal.coordinator.records.records import Resume
from tidal.coordinator.rules import phase
from tidal.coordinator.rules.pacing import loop_wait
from tidal.dashboard.history import Recorder
from tidal.host.server import ApiServer
from tidal.hosts_protocol import host_token
from tidal.protocol import JobState
from tidal.terminal import Terminal, gone

if TYPE_CHECKING:
    from tidal.tracking.forwarder import Forwarder


def run_job(
    spec: JobSpec,
    home: Path,
    *,
    quiet: bool = False,
    resume: Resume | None = None,
    tensorboard: str | Path | None = None,
    lock_fd: int | None = None,
    attach: Attach | None = None,
    zygote: Zygote | None = None,
) -> int:
    """Run the job to its end; 0 if it succeeded. Must run on the main thread: workers are
    tied to the thread that launched them (they die with it). ``tensorboard``: a folder for
    TensorBoard event files (``DIR/NAME``). ``lock_fd``: the job's lock, taken by the caller
    (``JobDir.lock``) and handed over (closed here); taken here if None. ``attach``: take
    over the live workers of a job whose coordinator and supervisor died (``tidal attach``).
    ``zygote``: the local workers' warm interpreter, if the caller started it (``tidal run``
    does, before it imports this module: the imports overlap); started here otherwise, and
    ended here either way.

    This process supervises the coordinator (``supervisor``): it runs in a forked child,
    restarted when it dies. On Ray the child is the cluster's driver (this process never
    joins the cluster: a fork of a driver would share its connections), listening on this
    node's cluster address; its workers' actors are detached, so they outlive it."""
    if lock_fd is None:
        try:
            lock_fd = job_dir(home, spec.name).lock()
        except JobBusy as exc:
            raise ValueError(f"job {spec.name!r} is running: {exc}") from None
    terminal = Terminal(job_dir(home, spec.name).path / "coordinator.log", spec.name)
    try:
        host, port = serving_address(spec)  # loopback, or what other machines reach
        if zygote is None and spec.backend != "ray":
            zygote = start_zygote(spec, job_dir(home, spec.name).logs)

        def host_job(hosting: Hosting, recover: bool, stop_requested: bool) -> int:
            return _host(
                spec,
                home,
                quiet=quiet,
                resume=None if recover else resume,
                tensorboard=tensorboard,
                hosting=hosting,
                recover=recover,
                stop_requested=stop_requested,
                terminal=terminal,
            )

        return supervise(
            host_job,
            host=host,
            token=attach.token if attach else None,
            api_port=attach.api_port if attach else port,
            recover=attach is not None,
            name=spec.name,
            zygote=zygote,
            terminal=terminal,
        )
    finally:
        if zygote is not None:
            zygote.close()
        os.close(lock_fd)  # after the coordinator has recorded the end and closed


def _host(
    spec: JobSpec,
    home: Path,
    *,
    quiet: bool,
    resume: Resume | None,
    tensorboard: str | Path | None,
    hosting: Hosting | None = None,
    recover: bool = False,
    stop_requested: bool = False,
    terminal: Terminal | None = None,
) -> int:
    from tidal.display import Progress, final_note, print_outcome

    if terminal is None:
        terminal = Terminal(job_dir(home, spec.name).path / "coordinator.log", spec.name)
    say = terminal.say
    notes: list[str] = []  # lines for the job's events, recorded by the loop (not a handler)

    def output_lost(cause: str) -> None:
        line = terminal.lose(cause)
        if line:
            notes.append(line)

    # A hang-up keeps the job (``output``); recorded by the loop's next pass (a handler takes
    # no lock). Installed first: the supervisor passes on the terminal's SIGHUP at any time.
    signal.signal(signal.SIGHUP, lambda _s, _f: output_lost("SIGHUP"))
    try:
        coord = Coordinator(spec, home, resume=resume, hosting=hosting, recover=recover)
    except ValueError as exc:  # a refusal (no cluster to join), not a crash to restart
        say(f"tidal: error: {exc}")
        return 1
    if coord.executor.db.broken:  # the job's record could not be written: nothing was started
        coord.close()
        say(f"tidal: error: {coord.executor.db.broken}")
        return 1
    coord.executor.prepare(hosting.zygote if hosting else None)
    try:
        sink = None
        if tensorboard is not None:
            from tidal.tensorboard import TensorBoardSink

            sink = TensorBoardSink(tensorboard, spec.name)
        try:
            recorder = Recorder(coord, home, tensorboard=sink, on_write_error=_breaks(coord))
        except sqlite3.Error as exc:
            raise HomeError(f"cannot write {db_path(home)}: {exc}") from None
        forwarder = _forwarder(spec, home, coord, notes)
    except BaseException:
        coord.close(kill_workers=not recover)  # adopted workers wait for the next one
        raise
    if stop_requested:  # the supervisor was asked to stop while no coordinator ran
        coord.on_stop()
    server = ApiServer(coord, host=coord.host, sock=hosting.api_sock if hosting else None)
    coord.url = server.url
    server.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    if spec.backend == "hosts":  # its token file first: `tidal run --detach` prints it
        join = join_line(coord, server.url)
        if not recover:
            say(f"tidal: to add a host, run there: {join}")
            with coord.lock:
                coord.event("host", f"hosts join with: {join}")
    coord.jobdir.write_coordinator(
        url=server.url,
        token=coord.token,
        pid=os.getpid(),
        supervisor_pid=hosting.supervisor_pid if hosting else None,
    )
    if not recover:  # no worker runs yet: the first ones start from the zygote
        coord.executor.wait_ready()

    # Everything built so far (torch, FastAPI, pydantic's schemas: ~10^6 objects) lives as
    # long as the process: out of the collector's sight. Otherwise each full collection
    # walked it all, 80 to 100 ms with the GIL held (every ~5 to 10 s at 1,024 workers),
    # and every heartbeat answer waited behind it (``bench.control_plane``'s p99).
    gc.collect()
    gc.freeze()
    signals = {"count": 0}

    def on_signal(signum: int, _frame: object) -> None:
        signals["count"] += 1
        if signals["count"] == 1:
            coord.on_stop()
        else:  # a second Ctrl-C: do not wait for the members
            coord.executor.do(KillEveryWorker(why="a second stop signal"))

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = Progress(coord, enabled=not quiet and terminal.lost is None, on_lost=output_lost)
    watch = Supervision(spec.name, hosting.supervisor_pid if hosting else None)
    stopping_for_db = ended = False
    try:
        while True:
            coord.wake.clear()  # before the tick: a call during it wakes the next one
            if terminal.lost:
                progress.enabled = False
            for line in watch.check():  # also on the terminal, if it is still there
                say(f"tidal: warning: {line}")
                notes.append(line)
            while notes:
                line = notes.pop(0)
                with coord.lock:
                    coord.event("coordinator", line)
            if coord.executor.db.broken and not stopping_for_db:
                # The job's records cannot be written: say so at once (the one line), then
                # end the job cleanly. The stop rides the control word as `tidal stop` does,
                # so rank 0 writes a final checkpoint if it can.
                stopping_for_db = True
                coord.on_stop()
                say(f"tidal: error: {coord.executor.db.broken}")
            if not coord.tick():
                break
            progress.update()
            if not coord.executor.db.broken:
                recorder.tick()
            wait_s, _ = loop_wait(settled=coord.settled())
            coord.wake.wait(wait_s, coord.executor.wake_fds())
        if coord.executor.db.broken:  # what its records will say, if they can take it
            phase.records_broken(coord.job)
        try:
            progress.update(final=True)
        except HomeError:
            pass  # the records cannot be read either; the line below says why
        ended = True
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        recorder.close()  # first: the last rows, which the tracker's last batch reads
        if forwarder is not None:  # a crashed coordinator's run stays open for the next one
            left = forwarder.close(coord.job.state if ended else None)
            if left:
                say(f"tidal: warning: {left}")
            if ended and not coord.executor.db.broken:  # its lines since the loop's last pass
                with coord.lock:
                    for line in notes:
                        coord.event("coordinator", line)
                notes.clear()
        server.stop()
        broken = coord.executor.db.broken
        if broken:  # recorded if the storage came back (space freed), else `interrupted`
            coord.executor.db.record_end(spec.name, JobState.FAILED, f"job failed: {broken}")
        elif ended:
            try:
                code = print_outcome(coord)  # it reads the job's events: before the close
            except OSError as exc:  # stderr is gone (nobody wrote to it before): the log
                if not gone(exc):
                    raise
                output_lost(str(exc.strerror or exc))
                code = print_outcome(coord)
        # A coordinator that raised (it crashed: ``supervisor.CRASHED``) leaves its workers
        # training; the supervisor restarts it and the next one adopts them.
        coord.close(kill_workers=ended or bool(broken))
    if broken:
        if not stopping_for_db:  # it broke during the job's last tick
            say(f"tidal: error: {broken}")
        if ended and (note := final_note(coord)) is not None:  # the job's end, said last
            say(f"tidal: error: job {spec.name} failed at step {coord.job.step}: {note}")
        return 1
    return code


def join_line(coord: Coordinator, url: str) -> str:
    """The command that adds a host to the job (``tidal run --listen``), its credential
    written first to the file it names (``hosts_protocol.host_token``)."""
    coord.jobdir.write_join_token(host_token(coord.token))
    return f"tidal worker --join {url} --token-file {coord.jobdir.join_token_file}"


def _forwarder(spec: JobSpec, home: Path, coord: Coordinator, notes: list[str]) -> Forwarder | None:
    """``--track``: the thread that sends the job's per-step values to its tracker; its
    lines become the job's events (``notes``: recorded by the loop)."""
    if spec.track is None:
        return None
    from tidal.config import parse_track
    from tidal.tracking.forwarder import Forwarder

    forwarder = Forwarder(
        track=parse_track(spec.track),
        job=spec.name,
        db=db_path(home),
        committed=lambda: coord.job.step,
        note=notes.append,
    )
    forwarder.start()
    return forwarder


def _breaks(coord: Coordinator) -> Callable[[sqlite3.Error], None]:
    """A failed write of the dashboard's history (same file) is a failure of the job's records
    (it ends the job, in one line), not a second warning line."""

    def broken(exc: sqlite3.Error) -> None:
        db = coord.executor.db
        db.broken = db.broken or f"cannot write {db.path}: {exc}"

    return broken
