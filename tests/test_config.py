import pytest

from tidal.backends import get_backend
from tidal.config import JobSpec, parse_schedule
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


def test_faults_parse_and_reject_unknown_kinds():
    assert parse_faults("sigkill@worker=1,step=60,phase=allreduce; sigstop@worker=2,step=5") == [
        Fault(kind="sigkill", worker=1, step=60, phase="allreduce"),
        Fault(kind="sigstop", worker=2, step=5, phase="step"),
    ]
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_faults("explode@worker=1,step=2")
    with pytest.raises(ValueError, match="unknown fault phase"):
        parse_faults("sigkill@worker=1,step=2,phase=lunch")
