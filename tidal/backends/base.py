"""The interface every backend implements: start, watch and stop worker processes.

A backend restarts nothing on its own: it reports exits and the coordinator decides.
Whatever runs the worker (a local subprocess, a Ray actor), the worker itself is the same
command with the same environment, so the worker runtime cannot tell backends apart.
Backends register by name; an unknown name lists the known ones.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.backends.host_registry import HostRegistry
    from tidal.backends.zygote import Zygote


@dataclass(frozen=True, kw_only=True)
class Exit:
    """A worker's process ended. ``returncode`` > 0 means the script failed (a bug every
    worker shares); < 0 a signal or a lost machine (recoverable); 0 a clean exit.
    ``reason`` says why when the code alone does not (e.g. its node was lost). ``known``
    False: the process is gone but its exit status could not be read (an adopted worker
    whose parent was not ours: ``returncode`` is then -9 by convention)."""

    worker_id: int
    returncode: int
    reason: str = ""
    known: bool = True

    def describe(self) -> str:
        if self.reason:
            return self.reason
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name}"
        return f"exited with code {self.returncode}"


class Backend(ABC):
    """Factories are called as ``factory(spec=JobSpec, log_dir=Path, cwd=Path)``."""

    #: The address workers use to reach the coordinator's API and rendezvous store: the
    #: coordinator binds it. Loopback when every worker runs on this machine.
    host: str = "127.0.0.1"
    #: The most workers the coordinator has starting (launched, not registered) at once;
    #: it starts the next ones as these register.
    max_starting: int = 8

    @classmethod
    def check_capacity(cls, spec: object) -> None:
        """Refuse (``ValueError``, one line) a job this backend can never hold."""
        return None

    @abstractmethod
    def start(self, worker_id: int, env: dict[str, str]) -> int | None:
        """Launch a worker (or ask for one: see ``waiting``); returns its pid when known."""

    @abstractmethod
    def poll(self) -> list[Exit]:
        """Workers whose process ended since the last call."""

    @abstractmethod
    def signal(self, worker_id: int, sig: int) -> None:
        """Send ``sig`` to a worker's process, if it still runs."""

    @abstractmethod
    def alive(self) -> list[int]:
        """Ids of workers whose process runs, or ended without ``poll`` reporting it yet
        (the job ends only once every exit is recorded)."""

    def adopt(self, worker_id: int, pid: int, env: dict[str, str]) -> bool:
        """Watch a worker that a previous coordinator of the job started (it was restarted):
        True if ``pid`` is that worker's live process (launched with ``env``); ``pid`` 0:
        it never registered, False, and whatever the backend began for it is ended. A
        backend that cannot adopt returns False; the worker is then counted as lost."""
        return False

    def waiting(self) -> set[int]:
        """Workers asked for but not placed yet: the cluster has no room for them now.
        They start by themselves when room appears; ``signal`` with SIGTERM or SIGKILL
        cancels one, which then exits with code 0."""
        return set()

    def node(self, worker_id: int) -> str | None:
        """Where the worker runs (a host or cluster node id), once placed."""
        return None

    def prepare(self, zygote: Zygote | None = None) -> None:
        """Get ready to start workers fast; called once when a coordinator starts hosting the
        job, before its first worker starts. ``zygote``: the warm interpreter the job's
        supervisor started, which the local backend forks
        its workers from (it starts its own without one); other backends ignore it."""
        return None

    def wait_ready(self) -> bool:
        """Wait, at most a bound of the backend's own, until what ``prepare`` began is done;
        True if it is. A new job's coordinator waits here before its first pass (no worker
        runs yet); a restarted one does not (its workers need the control loop)."""
        return True

    def wake_fds(self) -> list[int]:
        """File descriptors that become readable when ``poll`` has an exit to report: the
        control loop sleeps on them (and on its ``Wake``) between passes, so an exit is
        handled at once however long the loop sleeps. None by default: the loop then
        sees exits at its passes."""
        return []

    @property
    def hosts(self) -> HostRegistry | None:
        """What the agents of joined hosts call (the API's ``/hosts`` routes): the hosts
        backend's registry; None for a backend that takes no hosts."""
        return None

    def news(self) -> list[str]:
        """Lines for the job's events since the last call (a host joined, left, was lost)."""
        return []

    def describe_exit(self, worker_id: int) -> str:
        """A line of context for a failed worker (e.g. its log's last line)."""
        return ""

    def close(self) -> None:
        """Release what the backend holds; called once every worker has exited."""
        return None

    def leave(self) -> None:
        """Release what this process holds while the workers live on: the coordinator is
        going away (it crashed) and a successor will adopt them (``adopt``). Ends no
        worker."""
        self.close()


BackendFactory = Callable[..., Backend]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    _BACKENDS[name] = factory


def known_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> BackendFactory:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; known backends: {', '.join(known_backends())}"
        ) from None
