"""``--track wandb[:[ENTITY/]PROJECT]``: the job's run in Weights & Biases
(``pip install 'tidal[wandb]'``).

One run per job: its id is the key the forwarder wrote down before anything was sent
(``plan.Record``), and every coordinator of the job opens it with ``resume="allow"``, so a
restarted coordinator or a resumed job goes on in the same run. Its name is the job's. W&B's
own settings apply as usual (``WANDB_MODE=offline``, ``WANDB_DIR``, the API key); the
coordinator's output is not captured and no system metrics are sampled (it is not where the
training runs). Each step's values go in one ``run.log(values, step=STEP)``.

W&B takes a run's steps in increasing order only and drops a step below one it holds, so a
batch sent again after a crash is dropped by W&B where it arrived the first time (``held``
is None: Tidal cannot read an offline run back). Offline, each coordinator's process writes
its own ``offline-run-*`` folder of the same run id: ``wandb sync`` them in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby

from tidal.protocol import JobState
from tidal.tracking.plan import Point


class WandbSink:
    kind = "wandb"

    def __init__(self, project: str | None, job: str) -> None:
        entity, _, name = (project or "").rpartition("/")
        self.entity, self.project = entity or None, name or None
        self.job = job
        self.run = None

    def open(self, *, key: str, run_id: str | None) -> str:
        import wandb

        self.run = wandb.init(
            entity=self.entity,
            project=self.project,
            id=key,
            name=self.job,
            resume="allow",
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        return self.run.id

    def send(self, points: list[Point]) -> None:
        for step, group in groupby(sorted(points, key=lambda p: p.step), key=lambda p: p.step):
            self.run.log({p.name: p.value for p in group}, step=step, commit=True)

    def held(self, names: Iterable[str], lo: int, hi: int) -> None:
        return None  # see the module doc: W&B drops the steps it holds

    def finish(self, outcome: JobState | None) -> None:
        self.run.finish(exit_code=0 if outcome == JobState.SUCCEEDED else 1)

    def describe(self) -> str:
        where = "/".join(x for x in (self.entity, self.project) if x) or "W&B's default project"
        return f"W&B run {self.run.id} ({where})"
