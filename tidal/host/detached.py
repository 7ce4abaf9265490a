"""The background process of ``tidal run --detach`` (and ``tidal resume``/``tidal attach``
with ``--detach``): ``python -m tidal.host.detached HOME SPEC_JSON [RESUME_JSON]
[--tensorboard DIR] [--attach JSON] [--lock-fd FD]``, which hosts the job with
``runner.run_job``.

Contract: the workers' zygote is started before this process imports the coordinator's
modules (torch among them, ~3 s), as the foreground ``tidal run`` does, so the two imports
overlap on two cores instead of running one after the other (they were a detached start's
critical path: job created ~3.5 s, first worker ~7.5 s). Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tidal.backends.local import start_zygote
from tidal.config import JobSpec
from tidal.coordinator.process.supervisor import Attach
from tidal.coordinator.records.home import job_dir
from tidal.coordinator.records.records import Resume


def _option(argv: list[str], name: str) -> str | None:
    """Take ``name VALUE`` out of ``argv``; the value, or None if absent."""
    if name not in argv:
        return None
    i = argv.index(name)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def main() -> int:
    argv = sys.argv[1:]
    tensorboard = _option(argv, "--tensorboard")
    lock = _option(argv, "--lock-fd")
    attach = _option(argv, "--attach")
    extra: dict = {"attach": Attach(**json.loads(attach))} if attach else {}
    if lock is not None:  # the job's lock, taken by `tidal run`; not for our own children
        extra["lock_fd"] = int(lock)
        os.set_inheritable(extra["lock_fd"], False)
    try:
        home, spec = Path(argv[0]), JobSpec.from_dict(json.loads(argv[1]))
        resume = Resume(**json.loads(argv[2])) if len(argv) > 2 else None
    except ValueError as exc:  # bad input: the last line of the log is what --detach shows
        return _refused(exc)
    zygote = start_zygote(spec, job_dir(home, spec.name).logs)  # first: see the module doc
    try:
        from tidal.host.runner import run_job

        return run_job(
            spec,
            home,
            quiet=True,
            resume=resume,
            tensorboard=tensorboard,
            zygote=zygote,
            **extra,
        )
    except ValueError as exc:
        return _refused(exc)
    finally:
        if zygote is not None:  # run_job ends it too; a second close is a no-op
            zygote.close()


def _refused(exc: ValueError) -> int:
    print(f"tidal: error: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
