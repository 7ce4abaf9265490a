import argparse
import subprocess
import sys
from dataclasses import field, fields, make_dataclass
from pathlib import Path

import pytest

from tidal.backends import get_backend
from tidal.cli import build_parser
from tidal.config import (
    ClusterSpec,
    JobSpec,
    add_flags,
    check_numbers,
    flag,
    flag_fields,
    flag_of,
    from_flags,
    parse_schedule,
)
from tidal.policy import PolicyParams, get_policy
from tidal.protocol import WorkerConfig
from tidal.testing.faults import Fault, parse_faults


def spec(**kw):
    base = dict(name="job-1", script="/x.py", workers=2, min_workers=1, max_workers=3)
    base.update(kw)
    return JobSpec(**base)


def test_schedule_parses_pairs():
    assert parse_schedule("50:3, 120:1,200:2") == ((50, 3), (120, 1), (200, 2))


@pytest.mark.parametrize("text", ["50", "a:3", "50:3,40:2", "50:3,50:2", "5:-1"])
def test_bad_schedule_is_refused(text):
    with pytest.raises(ValueError, match="schedule"):
        parse_schedule(text)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"workers": 0}, "--workers must be at least 1"),
        ({"workers": 4}, "--max-workers"),
        ({"min_workers": 3}, "--min-workers"),
        ({"schedule": ((10, 5),)}, "raise --max-workers"),
        ({"name": "bad name"}, "bad job name"),
        ({"heartbeat_timeout_s": 200.0}, "--collective-timeout"),
        ({"max_restarts": -1}, "--max-restarts"),
    ],
)
def test_bad_spec_says_how_to_fix_it(kw, message):
    with pytest.raises(ValueError, match=message):
        spec(**kw)


def test_spec_round_trips_through_a_dict():
    s = spec(schedule=((10, 3),), script_args=["--lr", "0.1"])
    assert JobSpec.from_dict(s.to_dict()) == s


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known backends: .*local"):
        get_backend("pbs")
    with pytest.raises(ValueError, match="known policies: static"):
        get_policy("magic")


def test_faults_may_name_a_generation_and_leave_the_step_open():
    from tidal.testing.faults import FaultInjector

    fault = parse_faults("sigkill@worker=2,phase=rendezvous,gen=2,step=0")[0]
    assert fault == Fault(kind="sigkill", worker=2, step=0, phase="rendezvous", gen=2)
    injector = FaultInjector(2, [Fault(kind="raise", worker=2, phase="join", gen=3)])
    injector.maybe_fire(7, "join", 2)  # another generation: nothing happens
    injector.maybe_fire(7, "heal", 3)  # another phase: nothing happens
    with pytest.raises(RuntimeError, match="injected fault"):
        injector.maybe_fire(9, "join", 3)  # any step, that generation
    injector.maybe_fire(9, "join", 3)  # each fault fires once


def test_faults_parse_and_reject_unknown_kinds():
    assert parse_faults("sigkill@worker=1,step=60,phase=allreduce; sigstop@worker=2,step=5") == [
        Fault(kind="sigkill", worker=1, step=60, phase="allreduce"),
        Fault(kind="sigstop", worker=2, step=5, phase="step"),
    ]
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_faults("explode@worker=1,step=2")
    with pytest.raises(ValueError, match="unknown fault phase"):
        parse_faults("sigkill@worker=1,step=2,phase=lunch")


# -- numbers: NaN, infinity and out-of-range values are refused, naming the flag -------------
def _float_fields():
    out = []
    for cls in (JobSpec, ClusterSpec):
        out += [(cls, f.name) for f in fields(cls) if "float" in str(f.type)]
    return out


def _make(cls, **kw):
    return spec(**kw) if cls is JobSpec else ClusterSpec(**kw)


@pytest.mark.parametrize("cls, name", _float_fields())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -1.0, 1e300])
def test_every_float_setting_refuses_non_finite_negative_and_huge_values(cls, name, bad):
    flag = flag_of(next(f for f in fields(cls) if f.name == name)).said_as  # every float has one
    with pytest.raises(ValueError) as info:
        _make(cls, **{name: bad})
    assert flag in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"heartbeat_timeout_s": 0.0}, "--heartbeat-timeout must be positive"),
        ({"collective_timeout_s": 0.0}, "--collective-timeout must be positive"),
        ({"start_timeout_s": 0.0}, "--start-timeout must be positive"),
        ({"start_timeout_s": -5.0}, "--start-timeout must be positive"),
        ({"start_timeout_s": float("nan")}, "--start-timeout must be a finite number"),
        ({"start_timeout_s": 1e10}, "--start-timeout must be at most 1e"),
        ({"checkpoint_interval_s": 0.0}, "--checkpoint-interval must be positive"),
        ({"deadline_s": 0.0}, "--deadline must be positive"),
        ({"budget": 0.0}, "--budget must be positive"),
        ({"min_efficiency": 0.0}, "--min-efficiency must be positive"),
        ({"min_efficiency": 1.5}, "--min-efficiency must be at most 1"),
    ],
)
def test_non_positive_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        spec(**kw)


def test_zero_is_allowed_where_it_means_something():
    s = spec(price_per_worker_hour=0.0, decision_interval_s=0.0)
    assert s.price_per_worker_hour == 0.0 and s.decision_interval_s == 0.0


def test_cli_refuses_a_nan_setting_in_one_line_and_records_nothing(tmp_path):
    home = tmp_path / "home"
    script = Path(__file__).resolve().parents[1] / "examples" / "digits.py"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "run", "--heartbeat-timeout", "nan"]
        + ["--home", str(home), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "tidal: error: --heartbeat-timeout must be a finite number, got nan"
    ]
    assert not (home / "tidal.db").exists() and not (home / "jobs").exists()


# -- one source for each setting: JobSpec's fields make `tidal run`'s flags ---------------------
def _run_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["run"]


def _shown(default):
    return f"{default:g}" if isinstance(default, (int, float)) else str(default)


# Flags of `tidal run` that are not the job's spec: where it is kept and how it is hosted.
NOT_SPEC = {"-h", "--help", "--home", "--detach", "--quiet", "--tensorboard"}


@pytest.mark.parametrize(
    "f, meta", list(flag_fields(JobSpec)), ids=lambda x: getattr(x, "name", "")
)
def test_every_spec_flag_is_in_run_help_with_its_default(f, meta):
    run = _run_parser()
    page = "".join(run.format_help().split())  # no spaces: argparse wraps lines at hyphens
    action = next(a for a in run._actions if meta.name in a.option_strings)
    assert meta.name in page and "".join((action.help or "").split()) in page
    if not meta.derived and f.default not in (None, False):
        assert _shown(f.default) in action.help  # "(default 10)", or its value in words
    # the parser's default is the dataclass's (None where cmd_run converts or derives it)
    assert action.default == (None if meta.derived else f.default)


def test_run_has_no_job_flag_but_the_spec_fields():
    run = _run_parser()
    options = {o for a in run._actions for o in a.option_strings}
    assert options - NOT_SPEC == {meta.name for _, meta in flag_fields(JobSpec)}


def test_an_empty_command_line_gives_the_dataclass_defaults():
    values = vars(_run_parser().parse_args(["x.py"]))
    derived = dict(name="j", script="/x.py", max_workers=1, schedule=(), capacity_trace=None)
    assert from_flags(JobSpec, values, **derived, deadline_s=None) == JobSpec(
        name="j", script="/x.py"
    )


def test_flags_reach_the_spec_and_its_cluster():
    args = ["--workers", "2", "--max-workers", "3", "--worker-gpus", "1", "--price", "2.5"]
    values = vars(_run_parser().parse_args([*args, "--oversubscribe", "x.py", "--lr", "1"]))
    s = from_flags(
        JobSpec, values, name="j", script="/x.py", max_workers=3, schedule=(),
        capacity_trace=None, deadline_s=None,
    )  # fmt: skip
    assert (s.workers, s.max_workers, s.price_per_worker_hour, s.oversubscribe) == (2, 3, 2.5, True)
    assert s.cluster == ClusterSpec(worker_gpus=1.0) and values["script_args"] == ["--lr", "1"]


def test_a_derived_flag_must_be_given_and_unknown_fields_are_refused():
    values = vars(_run_parser().parse_args(["x.py"]))
    with pytest.raises(TypeError, match="--deadline is derived"):
        from_flags(JobSpec, values, name="j", script="/x.py", max_workers=1, schedule=(),
                   capacity_trace=None)  # fmt: skip
    with pytest.raises(TypeError, match="no field"):
        from_flags(ClusterSpec, values, adress="x")


def test_a_field_added_with_metadata_gets_a_flag():
    knob = field(default=5, metadata=flag("--new-knob", "a knob (default {default})"))
    spec_cls = make_dataclass(
        "Spec", [("new_knob", "int", knob)], bases=(JobSpec,), frozen=True, kw_only=True
    )
    parser = argparse.ArgumentParser()
    add_flags(parser, spec_cls)
    assert "a knob (default 5)" in parser.format_help()
    values = vars(parser.parse_args(["--new-knob", "7"]))
    given = dict(name="j", script="/x.py", max_workers=1, schedule=(), capacity_trace=None)
    assert from_flags(spec_cls, values, **given, deadline_s=None).new_knob == 7


def test_a_float_setting_without_a_rule_is_a_programming_error():
    bare = make_dataclass("Bare", [("x", "float", field(default=1.0))], frozen=True)
    with pytest.raises(TypeError, match="needs a flag or a label"):
        check_numbers(bare())


RUNTIME = dict(store_host="h", store_port=1, store_namespace="ns", store_key="0" * 64,
               checkpoint_dir="/c", resume_from=None, checkpoint_fence="f1")  # fmt: skip


def test_worker_config_takes_every_shared_setting_from_the_spec():
    s = spec(checkpoint_every=5, keep_checkpoints=2, orphan_timeout_s=60.0, schedule=((4, 2),))
    cfg = WorkerConfig.from_spec(s, **RUNTIME)
    shared = set(WorkerConfig.model_fields) & {f.name for f in fields(JobSpec)}
    assert shared and all(getattr(cfg, n) == getattr(s, n) for n in shared)
    # every field is the spec's, the schedule's steps, or the coordinator's own
    assert set(WorkerConfig.model_fields) == shared | {"hold_steps"} | set(RUNTIME)
    assert cfg.hold_steps == [4] and cfg.store_namespace == "ns"


def test_policy_params_take_the_job_flags():
    s = spec(min_efficiency=0.5, deadline_s=60.0, budget=9.0, decision_interval_s=7.0)
    p = PolicyParams.from_spec(s, assumed_pause_s=1.0)
    assert (p.min_efficiency, p.deadline_s, p.budget) == (0.5, 60.0, 9.0)
    assert (p.cooldown_s, p.assumed_pause_s) == (7.0, 1.0)
    # the defaults are the job's: one source
    assert PolicyParams.from_spec(spec()) == PolicyParams()


@pytest.mark.parametrize(
    ("interval", "timeout", "beat"),
    [(1.0, 10.0, 1.0), (1.0, 5.0, 1.0), (1.0, 1.0, 0.2), (0.1, 1.0, 0.1), (1.0, 0.5, 0.1)],
)
def test_workers_beat_at_the_interval_or_a_fifth_of_the_timeout(interval, timeout, beat) -> None:
    job = spec(heartbeat_interval_s=interval, heartbeat_timeout_s=timeout)
    assert job.beat_interval_s == pytest.approx(beat)
    cfg = WorkerConfig.from_spec(
        job, store_host="h", store_port=1, store_namespace="n", store_key="0" * 64
    )
    assert cfg.heartbeat_interval_s == pytest.approx(beat)  # what the workers are told


def test_the_cli_parses_its_flags_without_the_heavy_libraries():
    """``tidal run`` starts the workers' zygote, whose imports are a cold start's critical
    path, as soon as it has parsed and claimed the job: the parser (every subcommand's
    flags) must not pull in torch, numpy, pydantic or httpx first (~0.4 s)."""
    code = (
        "import sys; from tidal.cli import build_parser; build_parser().parse_args(['run', 'x.py']); "
        "print(sorted(m for m in ('torch', 'numpy', 'pydantic', 'httpx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_start_timeout_is_a_flag_that_reaches_the_spec():
    """``--start-timeout`` (issue 50): the 120 s the job waits for its first generation was a
    spec field without a flag; now it is one, validated by the spec, said in ``run --help``."""
    values = vars(_run_parser().parse_args(["--start-timeout", "7.5", "x.py"]))
    given = dict(name="j", script="/x.py", max_workers=1, schedule=(), capacity_trace=None)
    assert from_flags(JobSpec, values, **given, deadline_s=None).start_timeout_s == 7.5
    default = vars(_run_parser().parse_args(["x.py"]))["start_timeout"]
    assert default == JobSpec(name="j", script="/x.py").start_timeout_s == 120.0
    assert "--start-timeout" in _run_parser().format_help()


def test_cli_refuses_a_bad_start_timeout_in_one_line_and_records_nothing(tmp_path):
    home = tmp_path / "home"
    script = Path(__file__).resolve().parents[1] / "examples" / "digits.py"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "run", "--start-timeout", "0"]
        + ["--home", str(home), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "tidal: error: --start-timeout must be positive, got 0.0"
    ]
    assert not (home / "tidal.db").exists() and not (home / "jobs").exists()
