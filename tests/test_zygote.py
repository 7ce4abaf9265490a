"""Workers forked from the zygote (``tidal.host.zygote``, ``tidal.backends.zygote``): which
environments may be forked (a table), and, with real processes, that a forked worker sees
what the same command started with exec sees, ends the way it would, and is watched,
signalled and adopted by the local backend like any worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.backends.local import LocalBackend
from tidal.backends.zygote import Zygote, fork_refusal
from tidal.config import JobSpec

BASE = {"PATH": "/bin", "PYTHONPATH": "/a", "OMP_NUM_THREADS": "1", "TIDAL_HOME": "/h"}


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        (BASE, None),
        ({**BASE, "TIDAL_WORKER_ID": "3", "TIDAL_TOKEN": "t"}, None),  # Tidal's own: read late
        ({**BASE, "TIDAL_HOME": "/other"}, None),
        ({**BASE, "CUDA_VISIBLE_DEVICES": "1"}, None),  # read when CUDA initialises
        ({k: v for k, v in BASE.items() if k != "TIDAL_HOME"}, None),
        ({**BASE, "PYTHONPATH": "/b"}, "PYTHONPATH"),  # read at interpreter start
        ({**BASE, "OMP_NUM_THREADS": "2"}, "OMP_NUM_THREADS"),  # read when libgomp loads
        ({k: v for k, v in BASE.items() if k != "PATH"}, "PATH"),  # removed counts too
        ({**BASE, "LD_PRELOAD": "x.so", "CUDA_VISIBLE_DEVICES": "0"}, "LD_PRELOAD"),
        ({**BASE, "A": "1", "B": "1", "C": "1", "D": "1"}, "A, B, C and 1 more"),
    ],
)
def test_fork_refusal(env, refused):
    reason = fork_refusal(BASE, env)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason and "\n" not in reason


# What a worker sees of its process; the same script is run forked and with exec.
PROBE = """\
import ctypes, json, os, random, signal, sys
import numpy
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
print(json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k.startswith(("TIDAL_", "PROBE_"))},
    "c_getenv": (libc.getenv(b"TIDAL_WORKER_ID") or b"").decode(),
    "own_session": os.getsid(0) == os.getpid(),
    "stdin_empty": sys.stdin.read() == "",
    "sigterm": str(signal.getsignal(signal.SIGTERM)),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigchld": str(signal.getsignal(signal.SIGCHLD)),
    "name": __name__,
    "file": __file__,
    "hook": __import__("sitecustomize").SEEN,
    "draws": [random.random(), float(numpy.random.random())],
}), flush=True)
how = sys.argv[1]
if how == "raise":
    raise RuntimeError("the script failed")
if how == "sleep":
    import time
    time.sleep(60)
sys.exit(int(how))
"""
# An interpreter start-up hook: it records the worker id it saw when it ran.
HOOK = 'import os\nSEEN = os.environ.get("TIDAL_WORKER_ID", "<unset>")\n'


@pytest.fixture
def setup(tmp_path: Path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "probe.py").write_text(PROBE)
    path = os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])
    base = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return tmp_path, base, scripts / "probe.py"


def _record(log: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith("{"):
                return json.loads(line)
        time.sleep(0.02)
    raise AssertionError(f"no record in {log}: {log.read_text() if log.exists() else ''}")


def _exits(z: Zygote, pids: set[int], timeout: float = 30) -> dict[int, int]:
    found: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while set(found) != pids and time.monotonic() < deadline:
        found.update(z.exits())
        time.sleep(0.02)
    return found


@pytest.mark.slow
def test_a_forked_worker_sees_what_an_execd_one_sees_and_ends_as_it_would(setup):
    tmp, base, probe = setup
    z = Zygote(python=sys.executable, env=base, log=tmp / "zygote.log")
    try:
        assert z.ready(wait=60), (tmp / "zygote.log").read_text()
        cwd = tmp / "cwd"
        cwd.mkdir()
        env = {**base, "TIDAL_WORKER_ID": "7", "PROBE_X": "y"}
        pids, logs = {}, {}
        for how in ("3", "0", "raise"):
            logs[how] = tmp / f"forked-{how}.log"
            pids[how] = z.spawn(argv=[str(probe), how], env=env, cwd=cwd, log=logs[how])
            assert pids[how] is not None
        codes = _exits(z, set(pids.values()))
        assert [codes.get(pids[h]) for h in ("3", "0", "raise")] == [3, 0, 1]
        assert "RuntimeError: the script failed" in logs["raise"].read_text()
        forked = _record(logs["3"])
        again = _record(logs["0"])

        with open(tmp / "exec.log", "wb") as out:
            code = subprocess.run(
                [sys.executable, str(probe), "3"],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                timeout=60,
            ).returncode
        assert code == 3
        execd = _record(tmp / "exec.log")
    finally:
        z.close()
    same = {k: v for k, v in execd.items() if k != "draws"}
    assert {k: v for k, v in forked.items() if k != "draws"} == same
    assert forked["hook"] == "7" and forked["c_getenv"] == "7"  # the hook ran with its env
    assert forked["path0"] == str(probe.parent.resolve()) and forked["cwd"] == str(cwd)
    # Two forks of one zygote draw different random numbers, as two processes would.
    assert forked["draws"][0] != again["draws"][0]
    assert forked["draws"][1] != again["draws"][1]


@pytest.mark.slow
def test_a_forked_module_sees_what_python_m_sees(setup):
    """``["-m", MODULE, ...]`` (the ``--torchrun`` launcher's form): as ``python -m``."""
    tmp, base, probe = setup
    (tmp / "hooks" / "probemod.py").write_text(probe.read_text())  # on PYTHONPATH
    z = Zygote(python=sys.executable, env=base, log=tmp / "zygote.log")
    cwd = tmp / "cwd"
    cwd.mkdir()
    env = {**base, "TIDAL_WORKER_ID": "7"}
    try:
        assert z.ready(wait=60), (tmp / "zygote.log").read_text()
        pid = z.spawn(argv=["-m", "probemod", "3"], env=env, cwd=cwd, log=tmp / "forked.log")
        assert _exits(z, {pid}) == {pid: 3}
        forked = _record(tmp / "forked.log")
    finally:
        z.close()
    with open(tmp / "exec.log", "wb") as out:
        code = subprocess.run(
            [sys.executable, "-m", "probemod", "3"], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, timeout=60,
        ).returncode  # fmt: skip
    assert code == 3
    execd = _record(tmp / "exec.log")
    assert {k: v for k, v in forked.items() if k != "draws"} == {
        k: v for k, v in execd.items() if k != "draws"
    }
    assert forked["name"] == "__main__" and forked["argv"][1:] == ["3"]
    assert forked["file"].endswith("probemod.py") and forked["path0"] == str(cwd)


def _spec(script: Path, **kw) -> JobSpec:
    return JobSpec(name="z", script=str(script), workers=1, max_workers=4, **kw)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _poll_until(backend: LocalBackend, ids: set[int], timeout: float = 30) -> dict:
    found, deadline = {}, time.monotonic() + timeout
    while set(found) != ids and time.monotonic() < deadline:
        found.update({e.worker_id: e for e in backend.poll()})
        time.sleep(0.02)
    assert set(found) == ids, f"no exit of {ids - set(found)}"
    return found


@pytest.mark.slow
def test_the_local_backend_forks_watches_signals_and_adopts_forked_workers(setup, monkeypatch):
    tmp, base, probe = setup
    monkeypatch.setenv("PYTHONPATH", base["PYTHONPATH"])
    backend = LocalBackend(spec=_spec(probe, script_args=["sleep"]), log_dir=tmp / "logs")
    successor = LocalBackend(spec=_spec(probe, script_args=["sleep"]), log_dir=tmp / "logs")
    backend.prepare()
    try:
        assert backend.wait_ready()
        pid0 = backend.start(0, {"TIDAL_WORKER_ID": "0"})
        pid1 = backend.start(1, {"TIDAL_WORKER_ID": "1"})
        # A variable read at start-up that differs: started with exec, and the log says why.
        pid2 = backend.start(2, {"TIDAL_WORKER_ID": "2", "OMP_NUM_THREADS": "2"})
        assert _record(backend.log_path(0))["hook"] == "0"
        assert _record(backend.log_path(2))["hook"] == "2"
        assert _parent(pid0) == _parent(pid1) != os.getpid()  # the zygote's children
        assert _parent(pid2) == os.getpid()
        assert "started with exec, not forked: " in backend.log_path(2).read_text()
        assert "OMP_NUM_THREADS" in backend.log_path(2).read_text()
        assert sorted(backend.alive()) == [0, 1, 2]
        # A restarted coordinator's backend adopts the forked worker by its record, and
        # refuses a pid that is not the one forked as that worker.
        assert successor.adopt(1, pid1, {"TIDAL_WORKER_ID": "1", "TIDAL_TOKEN": "x"})
        assert not successor.adopt(0, pid1, {"TIDAL_WORKER_ID": "0", "TIDAL_TOKEN": "x"})
        backend.signal(0, signal.SIGKILL)
        backend.signal(2, signal.SIGTERM)
        exits = _poll_until(backend, {0, 2})
        assert (exits[0].returncode, exits[2].returncode) == (-9, -15)
        assert sorted(backend.alive()) == [1]
    finally:
        backend.close()  # the zygote ends; its worker trains on
    assert successor.wait_ready()  # it prepared nothing: nothing to wait for
    assert successor.alive() == [1]
    successor.signal(1, signal.SIGKILL)
    # Nobody is left to reap it here (a job's supervisor would): its status is unknown.
    exits = _poll_until(successor, {1})
    assert exits[1].returncode == -9 and "unknown" in exits[1].reason


@pytest.mark.slow
def test_exec_start_is_a_setting_and_a_broken_zygote_costs_no_worker(setup, monkeypatch):
    tmp, base, probe = setup
    monkeypatch.setenv("PYTHONPATH", base["PYTHONPATH"])
    execd = LocalBackend(
        spec=_spec(probe, script_args=["5"], worker_start="exec"), log_dir=tmp / "a"
    )
    execd.prepare()  # nothing to start
    assert execd.wait_ready()
    pid = execd.start(0, {"TIDAL_WORKER_ID": "0"})
    assert _parent(pid) == os.getpid()
    assert _poll_until(execd, {0})[0].returncode == 5
    # A zygote that dies at once fails; the worker starts with exec.
    broken = LocalBackend(
        spec=_spec(probe, script_args=["4"], python="/bin/false"), log_dir=tmp / "b"
    )
    broken.prepare()
    assert not broken.wait_ready()
    broken.command[0] = sys.executable  # the worker's own command is a working one
    pid = broken.start(0, {"TIDAL_WORKER_ID": "0"})
    assert _parent(pid) == os.getpid()
    assert _poll_until(broken, {0})[0].returncode == 4
    assert "the zygote failed" in broken.log_path(0).read_text()
    broken.close()
    with pytest.raises(ValueError, match="--worker-start must be fork or exec"):
        _spec(probe, worker_start="spawn")


def _in_child(fn) -> object:
    """Run ``fn()`` in a forked copy of this process (as the supervisor forks a coordinator)
    and return what it returned (it must be JSON)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(r)
        try:
            out = json.dumps({"ok": fn()})
        except BaseException as exc:  # noqa: BLE001
            out = json.dumps({"error": repr(exc)})
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = json.loads(f.read())
    os.waitpid(pid, 0)
    assert "ok" in data, data
    return data["ok"]


@pytest.mark.slow
def test_one_zygote_serves_a_coordinator_and_its_successor(setup):
    """The supervisor owns the zygote; each coordinator it forks uses its own copy. One that
    dies with a request unanswered leaves nothing the next one mistakes for its own answers,
    and the exit of a worker the first one forked reaches the next one."""
    tmp, base, probe = setup
    z = Zygote(python=sys.executable, env=base, log=tmp / "zygote.log")
    env = {**base, "TIDAL_WORKER_ID": "1"}
    try:

        def first() -> list[int]:
            assert z.ready(wait=60)
            pid = z.spawn(argv=[str(probe), "sleep"], env=env, cwd=None, log=tmp / "a.log")
            z._send({"argv": [str(probe), "6"], "env": env, "cwd": None, "log": str(tmp / "b.log")})
            return [pid]  # it "dies" without reading the second answer

        (sleeper,) = _in_child(first)
        os.kill(sleeper, signal.SIGKILL)

        def second() -> list:
            assert z.ready(wait=30)
            pid = z.spawn(argv=[str(probe), "7"], env=env, cwd=None, log=tmp / "c.log")
            deadline, seen = time.monotonic() + 30, {}
            while (sleeper not in seen or pid not in seen) and time.monotonic() < deadline:
                seen.update(z.exits())
                time.sleep(0.02)
            return [pid, seen.get(sleeper), seen.get(pid)]

        pid, sleeper_code, code = _in_child(second)
        assert pid != sleeper and (sleeper_code, code) == (-9, 7)
        assert _record(tmp / "c.log")["argv"][1] == "7"
    finally:
        z.close()
    assert z._proc.returncode is not None  # the owner's close ended it
