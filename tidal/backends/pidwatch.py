"""Processes that are not this process's children, watched through pidfds.

A worker the zygote forked, or one a previous coordinator started, cannot be waited for
with ``waitpid``. A pidfd (Linux 5.3 and later) names one process for good, even after
its pid is recycled, and becomes readable when the process ends (as a zombie already):
one ``poll`` over every watched worker's pidfd tells which have ended, where reading
``/proc/PID/stat`` for each took most of an idle control-loop pass. The same descriptors
let the control loop sleep until a worker ends (``Backend.wake_fds``) instead of polling.

Where ``pidfd_open`` is missing or refused (an old kernel, a seccomp filter), a pid is
watched the old way: ``kill(pid, 0)`` and its ``/proc`` state, at every check.
"""

from __future__ import annotations

import errno
import os
import select
import signal

from tidal.pids import alive


def proc_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (a zombie counts as gone)."""
    return not alive(pid)


def readable(fds: object, timeout_s: float = 0.0) -> list[int]:
    """Those of ``fds`` readable within ``timeout_s`` (``poll``: no limit on fd numbers,
    which ``select`` has at 1,024)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(max(0.0, timeout_s) * 1000)]


class PidWatch:
    """Watched pids. Contract: ``gone`` is monotonic (a pid once gone stays gone until
    ``remove``), and a pid that was already gone when ``add`` ran is gone at once."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> its pidfd
        self._plain: set[int] = set()  # pids without a pidfd: checked through /proc
        self._ended: set[int] = set()

    def add(self, pid: int) -> None:
        if pid in self._fds or pid in self._plain or pid in self._ended:
            return
        try:
            self._fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            self._ended.add(pid)
        except (AttributeError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ESRCH:
                self._ended.add(pid)
            else:
                self._plain.add(pid)

    def remove(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)
        self._plain.discard(pid)
        self._ended.discard(pid)

    def gone(self) -> set[int]:
        """The watched pids whose process has ended (one ``poll`` for all pidfds)."""
        live = {fd: pid for pid, fd in self._fds.items() if pid not in self._ended}
        self._ended.update(live[fd] for fd in readable(live))
        self._ended.update(pid for pid in self._plain if proc_gone(pid))
        return set(self._ended)

    def is_gone(self, pid: int) -> bool:
        if pid in self._ended:
            return True
        fd = self._fds.get(pid)
        if fd is None:
            return pid not in self._plain or proc_gone(pid)
        if readable([fd]):
            self._ended.add(pid)
            return True
        return False

    def send(self, pid: int, sig: int) -> None:
        """Signal watched ``pid`` if its process has not ended. Through its pidfd, the
        signal reaches that process or nobody, never another that took the pid after it
        ended (pids are reused: pid_max is 32768 on many machines, and a busy one wraps it
        in minutes); without one, ``kill`` after the ``/proc`` check."""
        if self.is_gone(pid):
            return
        fd = self._fds.get(pid)
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:  # ended meanwhile
            self._ended.add(pid)

    def fds(self) -> list[int]:
        """Pidfds of the watched processes not yet seen gone: readable when one ends."""
        return [fd for pid, fd in self._fds.items() if pid not in self._ended]

    def close(self) -> None:
        for pid in list(self._fds):
            self.remove(pid)
