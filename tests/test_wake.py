"""The control loop's wake (``coordinator.wake``) and the pidfd watch of workers that are
not the coordinator's children (``backends.pidwatch``): real pipes, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tidal.backends.pidwatch import PidWatch, proc_gone
from tidal.coordinator.control.wake import Wake


def test_wake_set_before_wait_returns_at_once_and_clear_resets() -> None:
    w = Wake()
    try:
        w.set()
        w.set()  # twice: one byte in the pipe, one flag
        t = time.monotonic()
        assert w.wait(5.0) is True
        assert time.monotonic() - t < 1.0
        w.clear()
        assert not w.is_set()
        assert w.wait(0.05) is False  # cleared: the old set no longer wakes
    finally:
        w.close()


def test_wake_from_another_thread_and_from_a_readable_fd() -> None:
    w = Wake()
    r, wr = os.pipe()
    try:
        threading.Timer(0.1, w.set).start()
        t = time.monotonic()
        assert w.wait(10.0) is True
        assert 0.05 < time.monotonic() - t < 5.0
        w.clear()
        threading.Timer(0.1, os.write, (wr, b"x")).start()
        assert w.wait(10.0, [r]) is True  # woken by the descriptor, flag unset
        assert not w.is_set()
    finally:
        w.close()
        os.close(r)
        os.close(wr)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_pidwatch_sees_an_exit_as_zombie_and_wakes_on_it() -> None:
    proc = _sleeper()
    watch = PidWatch()
    try:
        watch.add(proc.pid)
        assert watch.gone() == set()
        assert not watch.is_gone(proc.pid)
        fds = watch.fds()
        assert len(fds) == 1
        w = Wake()
        threading.Timer(0.2, proc.send_signal, (signal.SIGKILL,)).start()
        assert w.wait(10.0, fds) is True  # the pidfd became readable at the exit
        w.close()
        # Not reaped yet: a zombie, which counts as gone (as for /proc).
        assert watch.gone() == {proc.pid}
        assert watch.is_gone(proc.pid)
        assert proc_gone(proc.pid)
        assert watch.fds() == []  # gone: no longer a reason to wake
    finally:
        proc.kill()
        proc.wait()
        watch.close()
    assert watch.gone() == set()


def test_pidwatch_signals_through_the_pidfd_and_never_after_the_end() -> None:
    """``send`` reaches the watched process; once it ended (reaped: its pid free for any
    new process to take), a ``send`` reaches nobody and raises nothing."""
    proc = _sleeper()
    watch = PidWatch()
    try:
        watch.add(proc.pid)
        watch.send(proc.pid, signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM
        watch.send(proc.pid, signal.SIGKILL)  # ended and reaped: nothing, no error
        assert watch.is_gone(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        watch.close()


def test_pidwatch_a_pid_already_gone_is_gone_at_once() -> None:
    proc = _sleeper()
    proc.kill()
    proc.wait()  # reaped: the pid names no process
    watch = PidWatch()
    watch.add(proc.pid)
    assert watch.gone() == {proc.pid}
    watch.remove(proc.pid)
    assert watch.gone() == set()


def test_one_answer_to_whether_a_pid_runs() -> None:
    """``pids.alive``, which the CLI, attach, the checkpoint store, the dashboard and the
    local backend use: running, a zombie, reaped, and values that name no process."""
    from tidal import pids

    proc = _sleeper()
    try:
        assert pids.alive(proc.pid) and pids.alive(os.getpid())
        assert pids.alive(1)  # init: another user's process in general; running
        proc.kill()
        deadline = time.monotonic() + 10
        while pids.alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pids.alive(proc.pid)  # a zombie, not yet reaped
        assert Path(f"/proc/{proc.pid}").exists()
    finally:
        proc.kill()
        proc.wait()
    assert not pids.alive(proc.pid)  # reaped
    for nothing in (0, -1, None, True, "12", 2**22 + 7):
        assert not pids.alive(nothing), nothing
