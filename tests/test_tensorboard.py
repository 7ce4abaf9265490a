"""``tidal run --tensorboard DIR``: event files TensorBoard reads, with the reported metrics
and the world size. One unit test of the sink, one real job."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import Home, summarize

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from tidal.tensorboard import TensorBoardSink  # noqa: E402


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_sink_writes_world_size_at_each_step_and_metrics_when_they_change(tmp_path) -> None:
    sink = TensorBoardSink(tmp_path / "tb", "job-a")
    sink.record(time=1.0, step=0, world_size=0, target=2, metrics={})
    sink.record(time=2.0, step=1, world_size=2, target=2, metrics={"loss": 2.0, "world_size": 2})
    sink.record(time=3.0, step=1, world_size=2, target=3, metrics={"loss": 2.0})  # same step
    sink.record(time=4.0, step=5, world_size=3, target=3, metrics={"loss": 2.0, "acc": 0.5})
    sink.record(time=5.0, step=9, world_size=3, target=3, metrics={"loss": float("nan")})
    sink.record(time=6.0, step=12, world_size=3, target=3, metrics={"loss": 1.0, "acc": 0.5})
    sink.close()
    got = scalars(tmp_path / "tb" / "job-a")
    assert got["tidal/world_size"] == [(0, 0), (1, 2), (5, 3), (9, 3), (12, 3)]
    assert got["tidal/target_workers"] == [(0, 2), (1, 2), (5, 3), (9, 3), (12, 3)]
    assert got["metrics/loss"] == [(1, 2.0), (12, 1.0)]
    assert got["metrics/acc"] == [(5, 0.5)]
    assert "metrics/world_size" not in got  # the runtime's copy of tidal/world_size


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_with_tensorboard_writes_metrics_and_world_size(tidal_home: Home, tmp_path) -> None:
    tb = tmp_path / "tb"
    proc, job = tidal_home.run(
        "tb",
        "--workers",
        "2",
        "--tensorboard",
        str(tb),
        script_args=["--max-steps", "200", "--log-every", "10"],
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
    status = job.status()
    assert status["state"] == "succeeded", summarize(status)
    got = scalars(tb / "tb")  # DIR/NAME
    world = dict(got["tidal/world_size"])
    assert 2 in world.values(), got["tidal/world_size"]
    assert max(world) == 200, got["tidal/world_size"]
    for tag in ("metrics/loss", "metrics/accuracy"):
        assert got.get(tag), (tag, sorted(got))
    assert got["metrics/loss"][-1][1] == pytest.approx(status["metrics"]["loss"], rel=1e-6)
    tidal_home.assert_no_processes()


def test_tensorboard_dir_reaches_a_detached_coordinator(monkeypatch) -> None:
    """``--detach`` hands ``--tensorboard`` to the background process on its command line."""
    from tidal.host import detached, runner

    seen = {}
    monkeypatch.setattr(runner, "run_job", lambda spec, home, **kw: seen.update(kw) or 0)
    spec = '{"name": "x", "script": "s.py", "worker_start": "exec"}'  # no zygote to start
    monkeypatch.setattr("sys.argv", ["detached", "/h", spec, "--tensorboard", "/tb"])
    assert detached.main() == 0
    assert seen == {"quiet": True, "resume": None, "tensorboard": "/tb", "zygote": None}


def test_a_detached_coordinator_given_a_bad_spec_says_one_line(monkeypatch, capsys) -> None:
    """The ``--detach`` process refuses a spec it cannot use in one line (what the CLI
    shows from its log), before it starts a zygote or hosts anything."""
    from tidal.host import detached

    started = []
    monkeypatch.setattr(detached, "start_zygote", lambda *a: started.append(a))
    spec = '{"name": "x", "script": "s.py", "workers": -3}'
    monkeypatch.setattr("sys.argv", ["detached", "/h", spec])
    assert detached.main() == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tidal: error: --workers must be at least 1, got -3"], err
    assert started == []
