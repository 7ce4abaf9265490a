"""``--track mlflow[:TRACKING_URI]``: the job's run in MLflow, through ``MlflowClient``
(``mlflow-skinny`` is enough: ``pip install 'tidal[mlflow]'``).

One run per job: created once, with the tag ``tidal.key`` set to the key the forwarder wrote
down first (``plan.Record``), so that a coordinator killed between asking for the run and
recording its id finds that run again instead of making a second one. Its name is the job's;
its experiment is the one named by ``MLFLOW_EXPERIMENT_NAME`` (MLflow's own setting, created
if missing), else MLflow's default experiment. Points go with ``log_batch`` and an explicit
step, timestamped when the coordinator first saw them; the run ends FINISHED, FAILED or KILLED
as the job does, and a resumed job's run is RUNNING again.

MLflow keeps every point it is given, a repeated one too: what it already holds of an
interrupted batch is read back with ``get_metric_history`` (``held``). A metric name MLflow
refuses (it takes letters, digits and ``_ - . : /`` and space) is sent with each other
character as ``_``.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable

from tidal.protocol import JobState
from tidal.tracking.plan import MAX_POINTS, Point

_NOT_MLFLOW = re.compile(r"[^A-Za-z0-9_.\- :/]")
END_STATUS = {
    JobState.SUCCEEDED: "FINISHED",
    JobState.FAILED: "FAILED",
    JobState.STOPPED: "KILLED",
}


def metric_name(name: str) -> str:
    """``name`` as MLflow takes it (module doc)."""
    out = _NOT_MLFLOW.sub("_", name)
    if out.startswith("/") or posixpath.normpath(out) != out:
        out = out.replace("/", "_")  # a name must not read as another path
    return out


class MlflowSink:
    """One job's run in the MLflow tracking server or store ``uri`` (None: MLflow's
    default, ``MLFLOW_TRACKING_URI`` or ``./mlruns``)."""

    kind = "mlflow"

    def __init__(self, uri: str | None, job: str) -> None:
        from mlflow.tracking import MlflowClient

        self.job = job
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = None

    def open(self, *, key: str, run_id: str | None) -> str:
        """The job's run, RUNNING: ``run_id``'s, else the one tagged ``key``, else a new one."""
        client = self.client
        if run_id is None:
            found = client.search_runs(
                experiment_ids=[self._experiment()],
                filter_string=f"tags.`tidal.key` = '{key}'",
                max_results=1,
            )
            if found:
                run_id = found[0].info.run_id
            else:
                run = client.create_run(
                    self._experiment(),
                    run_name=self.job,
                    tags={"tidal.key": key, "tidal.job": self.job},
                )
                run_id = run.info.run_id
        if client.get_run(run_id).info.status != "RUNNING":  # a resumed job's
            client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        return run_id

    def _experiment(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's default experiment
        exp = self.client.get_experiment_by_name(name)
        return exp.experiment_id if exp is not None else self.client.create_experiment(name)

    def send(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(
                key=metric_name(p.name), value=p.value, timestamp=int(p.wall * 1000), step=p.step
            )
            for p in points
        ]
        for i in range(0, len(metrics), MAX_POINTS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_POINTS])

    def held(self, names: Iterable[str], lo: int, hi: int) -> set[tuple[str, int]]:
        """The (name, step) points of steps ``lo`` to ``hi`` the run holds."""
        out = set()
        for name in set(names):
            for m in self.client.get_metric_history(self.run_id, metric_name(name)):
                if lo <= m.step <= hi:
                    out.add((name, m.step))
        return out

    def finish(self, outcome: JobState | None) -> None:
        """The job ended (``outcome``) or this coordinator stops without ending it (None:
        the run stays RUNNING for the next one)."""
        status = END_STATUS.get(outcome) if outcome is not None else None
        if status is not None:
            self.client.set_terminated(self.run_id, status=status)

    def describe(self) -> str:
        return f"MLflow run {self.run_id} ({self.client.tracking_uri})"
