import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tidal.backends import get_backend
from tidal.config import _NUMBER_RULES, ClusterSpec, JobSpec, parse_schedule
from tidal.policy import get_policy
from tidal.worker.faults import Fault, parse_faults


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
    with pytest.raises(ValueError, match="known backends: local"):
        get_backend("slurm")
    with pytest.raises(ValueError, match="known policies: static"):
        get_policy("magic")


def test_faults_may_name_a_generation_and_leave_the_step_open():
    from tidal.worker.faults import FaultInjector

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
    flag = _NUMBER_RULES[name][0]  # every float field has a rule, or this raises KeyError
    with pytest.raises(ValueError) as info:
        _make(cls, **{name: bad})
    assert flag in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"heartbeat_timeout_s": 0.0}, "--heartbeat-timeout must be positive"),
        ({"collective_timeout_s": 0.0}, "--collective-timeout must be positive"),
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
