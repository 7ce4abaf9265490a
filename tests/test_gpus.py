"""The launch side of GPUs (``tidal.backends.gpus``, ``--comm``, ``--share-gpus``): which GPU
each local worker gets, and the settings refused before anything starts. Runs without a GPU:
the local backend's GPU count is injected."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2e_helpers import DIGITS

from tidal.backends import gpus
from tidal.backends import local as local_backend
from tidal.backends.gpus import assign_gpu, check_launch, device_entry, entry_index
from tidal.backends.local import LocalBackend
from tidal.cli import main as cli_main
from tidal.config import JobSpec
from tidal.protocol import WorkerConfig


# -- assign_gpu ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n_gpus", "in_use", "share", "expected"),
    [
        (0, {}, False, None),  # no GPU: CUDA_VISIBLE_DEVICES untouched
        (0, {}, True, None),
        (0, {3: 0}, False, None),  # a stale index without GPUs changes nothing
        (1, {}, False, 0),
        (2, {}, False, 0),
        (2, {7: 0}, False, 1),
        (4, {1: 0, 2: 2}, False, 1),  # the lowest free index
        (4, {1: 1, 2: 2, 3: 3}, False, 0),
        (2, {1: 1}, True, 0),  # sharing still takes a free one first
        (2, {1: 0, 2: 1}, True, 0),  # all held once: the lowest index
        (2, {1: 0, 2: 1, 3: 0}, True, 1),  # the least used
        (3, {1: 0, 2: 0, 3: 1, 4: 1, 5: 2}, True, 2),
        (2, {1: 5, 2: 0}, False, 1),  # an index beyond the count holds nothing
    ],
)
def test_assign_gpu(n_gpus, in_use, share, expected):
    assert assign_gpu(n_gpus=n_gpus, in_use=in_use, share=share) == expected


@pytest.mark.parametrize(("n_gpus", "in_use"), [(1, {0: 0}), (2, {4: 1, 9: 0})])
def test_assign_gpu_without_a_free_one_says_the_fix(n_gpus, in_use):
    with pytest.raises(ValueError, match=r"held by live workers: .*--share-gpus") as info:
        assign_gpu(n_gpus=n_gpus, in_use=in_use, share=False)
    assert "\n" not in str(info.value)


def test_assign_gpu_refuses_a_negative_count():
    with pytest.raises(ValueError, match="at least 0"):
        assign_gpu(n_gpus=-1, in_use={}, share=False)


# -- check_launch -------------------------------------------------------------------------
OK = None


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        (dict(n_gpus=0, max_workers=4, comm="auto"), OK),  # CPU: any count
        (dict(n_gpus=0, max_workers=4, comm="gloo"), OK),
        (
            dict(n_gpus=0, max_workers=1, comm="nccl"),
            "--comm nccl needs CUDA GPUs, and this machine has none: use --comm gloo or auto",
        ),
        (dict(n_gpus=1, max_workers=1, comm="nccl"), OK),
        (dict(n_gpus=2, max_workers=2, comm="auto"), OK),
        (
            dict(n_gpus=2, max_workers=3, comm="auto"),
            "--max-workers 3 is more than this machine's 2 GPUs: lower it or pass --share-gpus",
        ),
        (dict(n_gpus=2, max_workers=3, comm="gloo", share=True), OK),
        (
            dict(n_gpus=1, max_workers=8, comm="nccl", share=True),
            "--comm nccl cannot share a GPU between workers",
        ),
        (dict(n_gpus=2, max_workers=2, comm="nccl", share=True), OK),  # nothing shared
        (
            dict(n_gpus=2, max_workers=2, spares=1, comm="auto"),
            "--max-workers 2 + --spares 1 is more than this machine's 2 GPUs",
        ),
        (dict(n_gpus=3, max_workers=2, spares=1, comm="auto"), OK),
        (dict(n_gpus=0, max_workers=1, comm="mpi"), "--comm must be nccl, gloo or auto"),
        (dict(n_gpus=0, max_workers=1, comm="NCCL"), "--comm must be nccl, gloo or auto"),
        # ray: the cluster places GPUs (--worker-gpus); this machine's count does not matter
        (dict(backend="ray", n_gpus=0, max_workers=16, comm="auto"), OK),
        (dict(backend="ray", n_gpus=0, max_workers=16, comm="nccl", worker_gpus=1.0), OK),
        (dict(backend="ray", n_gpus=0, max_workers=2, comm="nccl", worker_gpus=0.5), OK),
        (
            dict(backend="ray", n_gpus=0, max_workers=2, comm="nccl"),
            "--comm nccl needs GPUs, and --worker-gpus is 0: pass --worker-gpus 1",
        ),
        (dict(backend="ray", n_gpus=0, max_workers=2, comm="gloo"), OK),
        (dict(backend="ray", n_gpus=0, max_workers=2, comm="x"), "--comm must be"),
    ],
)
def test_check_launch(kw, error):
    args = dict(backend="local", share=False, spares=0, worker_gpus=0.0) | kw
    if error is OK:
        check_launch(**args)
        return
    with pytest.raises(ValueError) as info:
        check_launch(**args)
    assert str(info.value).startswith(error) and "\n" not in str(info.value)


# -- CUDA_VISIBLE_DEVICES entries ---------------------------------------------------------
@pytest.mark.parametrize(
    ("index", "parent", "entry"),
    [
        (0, None, "0"),
        (3, None, "3"),
        (1, "", "1"),  # set but empty: not a restriction to follow
        (0, "2,3", "2"),
        (1, "2, 3", "3"),
        (1, "GPU-aaa,GPU-bbb", "GPU-bbb"),
    ],
)
def test_device_entry_follows_this_process_restriction(index, parent, entry):
    assert device_entry(index, parent) == entry
    assert entry_index(entry, parent) == index


def test_device_entry_beyond_the_parents_list_is_refused():
    with pytest.raises(ValueError, match="not among CUDA_VISIBLE_DEVICES"):
        device_entry(2, "4,5")


@pytest.mark.parametrize(("entry", "parent"), [(None, None), ("", None), ("7", "2,3"), ("x", None)])
def test_entry_index_of_no_gpu_of_ours(entry, parent):
    assert entry_index(entry, parent) is None


def test_without_a_gpu_driver_the_count_imports_no_torch():
    """``tidal run`` counts GPUs before it starts anything: on a machine without a driver
    that costs no torch import (~2 s before the zygote can start)."""
    import subprocess
    import sys

    code = "import sys; from tidal.backends import gpus; print(gpus.visible_gpus(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    has_driver = any(Path(f).exists() for f in gpus.DRIVER_FILES)
    if not has_driver:
        assert out.stdout.split() == ["0", "False"]
    else:
        assert out.stdout.split()[1] == "True"


def test_visible_gpus_counts_without_initialising_cuda():
    import torch

    assert gpus.visible_gpus(3) == 3  # the tests' override
    assert gpus.visible_gpus() == torch.cuda.device_count()
    assert not torch.cuda.is_initialized()
    with pytest.raises(ValueError):
        gpus.visible_gpus(-1)


# -- the spec -----------------------------------------------------------------------------
def _spec(**kw) -> JobSpec:
    return JobSpec(**(dict(name="g", script="/x.py", workers=1, max_workers=1) | kw))


def test_comm_and_share_gpus_are_spec_fields_with_flags_and_reach_the_workers():
    spec = _spec(comm="nccl", share_gpus=True)
    runtime = dict(store_host="h", store_port=1, store_namespace="n", store_key="0" * 64)
    config = WorkerConfig.from_spec(spec, **runtime)
    assert config.comm == "nccl"
    assert WorkerConfig.from_spec(_spec(), **runtime).comm == "auto"
    with pytest.raises(ValueError, match=r"^--comm must be nccl, gloo or auto, got 'mpi'$"):
        _spec(comm="mpi")


def test_an_old_job_record_without_the_gpu_settings_still_loads():
    old = _spec().to_dict()
    del old["comm"], old["share_gpus"]
    spec = JobSpec.from_dict(old)
    assert spec.comm == "auto" and spec.share_gpus is False
    assert JobSpec.from_dict(_spec(comm="gloo", share_gpus=True).to_dict()) == _spec(
        comm="gloo", share_gpus=True
    )


# -- tidal run ----------------------------------------------------------------------------
def test_run_with_comm_nccl_and_no_gpu_is_one_line_and_starts_nothing(tidal_home, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU even where the machine has one
    proc = tidal_home.cli("run", "--comm", "nccl", "--detach", str(DIGITS), timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0] == (
        "tidal: error: --comm nccl needs CUDA GPUs, and this machine has none: "
        "use --comm gloo or auto"
    )
    assert proc.stdout == ""
    assert not tidal_home.path.exists()  # no job folder, no records, no coordinator.json
    assert tidal_home.live_processes() == []  # no coordinator


@pytest.mark.parametrize(
    ("opts", "line"),
    [
        (["--workers", "3"], "--max-workers 3 is more than this machine's 2 GPUs: lower it or"),
        (["--workers", "2", "--spares", "1"], "--max-workers 2 + --spares 1 is more than"),
        (["--comm", "gpu"], "--comm must be nccl, gloo or auto, got 'gpu'"),
    ],
)
def test_run_refusals_on_a_machine_with_two_gpus(tmp_path, capsys, monkeypatch, opts, line):
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(gpus, "visible_gpus", lambda override=None: 2)
    monkeypatch.setattr(local_backend.subprocess, "Popen", no_process)
    monkeypatch.setattr("tidal.launch.subprocess.Popen", no_process)
    home = tmp_path / "home"
    code = cli_main(["run", "--home", str(home), *opts, str(DIGITS)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"tidal: error: {line}"), err
    assert not home.exists()


# -- the local backend's CUDA_VISIBLE_DEVICES ---------------------------------------------
PRINT_ENV = """\
import os, sys, time
print("CVD=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def _backend(tmp_path: Path, n_gpus: int, *args: str, **kw) -> LocalBackend:
    script = tmp_path / "print_env.py"
    script.write_text(PRINT_ENV)
    spec = _spec(script=str(script), script_args=list(args), **kw)
    return LocalBackend(spec=spec, log_dir=tmp_path / "logs", gpus=n_gpus)


def _wait_all(backend: LocalBackend, ids: set[int], timeout: float = 30) -> None:
    deadline, left = time.monotonic() + timeout, set(ids)
    while left and time.monotonic() < deadline:
        left -= {e.worker_id for e in backend.poll()}
        time.sleep(0.02)
    assert not left, f"workers {left} did not exit"


def _seen(backend: LocalBackend, wid: int, timeout: float = 30) -> str:
    """What worker ``wid`` printed as its ``CUDA_VISIBLE_DEVICES`` (waits for the line)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = backend.log_path(wid).read_text().splitlines()
        if found := [x for x in lines if x.startswith("CVD=")]:
            return found[0].removeprefix("CVD=")
        time.sleep(0.02)
    raise AssertionError(f"worker {wid} printed no CVD= line")


@pytest.mark.slow
def test_two_gpus_give_two_workers_one_each_and_a_freed_one_is_reused(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    backend = _backend(tmp_path, 2, "30", workers=2, max_workers=2)
    try:
        backend.start(0, {})
        backend.start(1, {})
        assert [_seen(backend, w) for w in (0, 1)] == ["0", "1"]
        backend.signal(0, 9)
        _wait_all(backend, {0})
        backend.start(2, {})  # worker 0's GPU is free again
        assert _seen(backend, 2) == "0"
    finally:
        for wid in (0, 1, 2):
            backend.signal(wid, 9)
        _wait_all(backend, {1, 2})


@pytest.mark.slow
def test_shared_gpus_go_to_the_least_used_and_a_restriction_is_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # this process may use GPUs 5 and 7
    backend = _backend(tmp_path, 2, workers=3, max_workers=3, share_gpus=True)
    for wid in range(3):
        backend.start(wid, {})
    _wait_all(backend, {0, 1, 2})
    assert [_seen(backend, w) for w in range(3)] == ["5", "7", "5"]


@pytest.mark.slow
def test_without_gpus_tidal_sets_no_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    backend = _backend(tmp_path, 0, workers=2, max_workers=2)
    backend.start(0, {})
    backend.start(1, {})
    _wait_all(backend, {0, 1})
    assert [_seen(backend, w) for w in (0, 1)] == ["<unset>", "<unset>"]


@pytest.mark.slow
def test_an_adopted_worker_keeps_its_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    first = _backend(tmp_path, 2, "30", workers=2, max_workers=2)
    second = _backend(tmp_path, 2, workers=2, max_workers=2)  # a restarted coordinator's
    try:
        first.start(0, {"TIDAL_WORKER_ID": "0"})
        pid = first._procs[0].pid
        # A restarted coordinator adopts workers that have long run their script; until the
        # child has exec'd, its environment is still the parent's (a loaded machine showed it).
        deadline = time.monotonic() + 10
        while b"TIDAL_WORKER_ID=0" not in Path(f"/proc/{pid}/environ").read_bytes():
            assert time.monotonic() < deadline, "the worker never exec'd"
            time.sleep(0.01)
        assert second.adopt(0, pid, {"TIDAL_WORKER_ID": "0"})
        second.start(1, {})
        _wait_all(second, {1})
    finally:
        first.signal(0, 9)
        _wait_all(first, {0})
    assert _seen(second, 1) == "1"


def test_the_backend_refuses_comm_nccl_without_gpus_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match="--comm nccl needs CUDA GPUs"):
        _backend(tmp_path, 0, comm="nccl")
    with pytest.raises(ValueError, match="more than this machine's 1 GPU: lower it"):
        _backend(tmp_path, 1, workers=2, max_workers=2)
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("comm", "share", "worker_comm"),
    [
        ("auto", False, "auto"),
        ("auto", True, "gloo"),
        ("gloo", True, "gloo"),
        ("nccl", False, "nccl"),
    ],
)
def test_workers_sharing_gpus_get_gloo_for_auto(comm, share, worker_comm):
    from tidal.config import JobSpec
    from tidal.protocol import WorkerConfig

    spec = JobSpec(name="j", script="s.py", workers=1, max_workers=2, comm=comm, share_gpus=share)
    cfg = WorkerConfig.from_spec(
        spec,
        store_host="h",
        store_port=1,
        store_namespace="n",
        store_key="0" * 64,
        checkpoint_dir=None,
    )
    assert cfg.comm == worker_comm


@pytest.mark.parametrize(
    ("drivers", "count", "error", "n", "words"),
    [
        (["/dev/nvidiactl"], 2, None, 2, None),
        (["/dev/nvidiactl"], 0, None, 0, "torch.cuda.device_count() is 0"),
        (["/dev/kfd"], 0, "RuntimeError: driver too old", 0, "RuntimeError: driver too old"),
    ],
)
def test_a_driver_torch_cannot_use_is_said_not_silent(drivers, count, error, n, words):
    from tidal.backends.gpus import probed

    got, warning = probed(drivers, count, error)
    assert got == n
    if words is None:
        assert warning is None
    else:
        assert words in warning and drivers[0] in warning and "train on the CPU" in warning
