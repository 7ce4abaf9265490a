"""What wakes the control loop: a flag API calls set, and file descriptors.

``threading.Event`` cannot be waited on together with a file descriptor, and the loop has
two kinds of reasons to run a pass before its interval is up: an API call that needs a
decision (``set``), and a backend's notice that a worker exited (a pidfd or a pipe becoming
readable: ``Backend.wake_fds``). ``Wake`` is an event with a self-pipe, so one ``poll``
waits for either.

Contract (as ``threading.Event``): ``set`` from any thread; ``clear`` and ``wait`` from the
loop's thread. A ``set`` that happens after ``clear`` makes the next ``wait`` return at once;
one before ``clear`` is cleared (the pass that follows sees what it announced).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from tidal.backends.pidwatch import readable


class Wake:
    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        with self._lock:
            if self._flag:
                return
            self._flag = True
            try:
                os.write(self._w, b"!")
            except (BlockingIOError, OSError):
                pass  # a byte is waiting already (or the pipe is closed: nothing waits)

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        with self._lock:
            self._flag = False
            try:
                while os.read(self._r, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    def wait(self, timeout_s: float, fds: Iterable[int] = ()) -> bool:
        """Sleep until ``set``, one of ``fds`` is readable, or ``timeout_s``; True if woken
        before the timeout (by either)."""
        return self._flag or bool(readable([self._r, *fds], timeout_s)) or self._flag

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
