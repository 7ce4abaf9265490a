"""The trackers by name (``--track``): what ``tidal run`` records of the setting, the check
that the tracker's package is installed, and the sink that sends to it."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from tidal.config import Track, parse_track

if TYPE_CHECKING:
    from tidal.tracking.mlflow_sink import MlflowSink
    from tidal.tracking.wandb_sink import WandbSink

PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}  # kind -> the module its sink imports
# MLflow's tracking URIs that name a service, not a folder (``mlflow:databricks``)
MLFLOW_SERVICES = {"databricks", "databricks-uc", "uc"}


def resolve_track(text: str, environ: Mapping[str, str] = os.environ) -> str:
    """``--track`` as the job records it, so that its coordinators (a restarted one, a
    ``tidal resume`` in another shell) all send to the same place: a local MLflow store's
    path made absolute (``mlflow:./mlruns`` -> ``mlflow:file:///abs/mlruns``), and where the
    flag names no target, the tracker's own setting of the launching shell
    (``MLFLOW_TRACKING_URI``; ``WANDB_ENTITY``/``WANDB_PROJECT``), read once here."""
    t = parse_track(text)
    target = t.target
    if t.kind == "mlflow":
        target = target or environ.get("MLFLOW_TRACKING_URI") or None
        if target is not None and target not in MLFLOW_SERVICES:
            url = urlparse(target)
            if url.scheme in ("", "file") and not url.netloc:
                path = url.path if url.scheme else target
                target = Path(path).expanduser().resolve().as_uri()
    elif target is None and environ.get("WANDB_PROJECT"):
        project = environ["WANDB_PROJECT"]
        entity = environ.get("WANDB_ENTITY")
        target = f"{entity}/{project}" if entity and "/" not in project else project
    resolved = t.kind if target is None else f"{t.kind}:{target}"
    parse_track(resolved)  # still a valid setting
    return resolved


def check_available(text: str) -> None:
    """Raise ``ValueError`` (one line) if ``--track``'s tracker is not installed."""
    kind = parse_track(text).kind
    if importlib.util.find_spec(PACKAGES[kind]) is None:
        package = "mlflow-skinny" if kind == "mlflow" else "wandb"
        raise ValueError(f"--track {kind} needs the {package} package: pip install 'tidal[{kind}]'")


def make_sink(track: Track, job: str) -> MlflowSink | WandbSink:
    """The sink of ``track`` for ``job`` (imports the tracker's package: slow, call it off
    the control loop)."""
    if track.kind == "mlflow":
        from tidal.tracking.mlflow_sink import MlflowSink

        return MlflowSink(track.target, job)
    from tidal.tracking.wandb_sink import WandbSink

    return WandbSink(track.target, job)
