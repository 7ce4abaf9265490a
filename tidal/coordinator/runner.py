"""Hosting a job: the coordinator, its API server and the control loop in one process.

``tidal run`` calls ``run_job`` in the foreground; ``tidal run --detach`` starts this module
as a background process (``python -m tidal.coordinator.runner HOME SPEC_JSON [RESUME_JSON]
[--tensorboard DIR]``). The loop also feeds the dashboard's history (``Recorder``), which
writes the TensorBoard events of ``--tensorboard``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tidal.config import JobSpec
from tidal.coordinator.controller import Coordinator
from tidal.coordinator.records import Resume
from tidal.coordinator.server import ApiServer
from tidal.dashboard.history import Recorder
from tidal.protocol import JobState

# The longest the control loop sleeps. API calls that need a decision wake it at once
# (``Coordinator.wake``); what only the loop notices (a process exit, a missed heartbeat, the
# clock of a capacity trace) waits at most this long. A shorter interval costs CPU that the
# workers need: at 5 ms the loop took ~8% of a core, 2 to 4% of a 2-worker job's throughput.
TICK_S = 0.02


def run_job(
    spec: JobSpec,
    home: Path,
    *,
    quiet: bool = False,
    resume: Resume | None = None,
    tensorboard: str | Path | None = None,
) -> int:
    """Run the job to its end; 0 if it succeeded. Must run on the main thread: workers are
    tied to the thread that launched them (they die with it). ``tensorboard``: a folder for
    TensorBoard event files (``DIR/NAME``)."""
    from tidal.display import Progress

    coord = Coordinator(spec, home, resume=resume)
    try:
        sink = None
        if tensorboard is not None:
            from tidal.tensorboard import TensorBoardSink

            sink = TensorBoardSink(tensorboard, spec.name)
        recorder = Recorder(coord, home, tensorboard=sink)
    except BaseException:
        coord.close()
        raise
    server = ApiServer(coord, host=coord.host)
    coord.url = server.url
    server.start()
    deadline = time.monotonic() + 30
    while not server._server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    coord.jobdir.write_coordinator(url=server.url, token=coord.token, pid=os.getpid())

    signals = {"count": 0}

    def on_signal(signum: int, _frame: object) -> None:
        signals["count"] += 1
        if signals["count"] == 1:
            coord.on_stop()
        else:  # a second Ctrl-C: do not wait for the members
            for wid in coord.backend.alive():
                coord.backend.signal(wid, signal.SIGKILL)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = Progress(coord, enabled=not quiet)
    try:
        while True:
            coord.wake.clear()  # before the tick: a call during it wakes the next one
            if not coord.tick():
                break
            progress.update()
            recorder.tick()
            coord.wake.wait(TICK_S)
        progress.update(final=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        recorder.close()
        server.stop()
        coord.close()
    return 0 if coord.state == JobState.SUCCEEDED else 1


def main() -> int:
    argv, tensorboard = sys.argv[1:], None
    if "--tensorboard" in argv:
        i = argv.index("--tensorboard")
        tensorboard = argv[i + 1]
        del argv[i : i + 2]
    home, spec_json = argv[0], argv[1]
    resume = Resume(**json.loads(argv[2])) if len(argv) > 2 else None
    try:
        return run_job(
            JobSpec.from_dict(json.loads(spec_json)),
            Path(home),
            quiet=True,
            resume=resume,
            tensorboard=tensorboard,
        )
    except ValueError as exc:  # bad input: the last line of the log is what --detach shows
        print(f"tidal: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
