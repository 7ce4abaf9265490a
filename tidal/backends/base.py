"""The interface every backend implements: start, watch and stop worker processes.

A backend restarts nothing on its own: it reports exits and the coordinator decides.
Backends register by name; an unknown name lists the known ones.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Exit:
    worker_id: int
    returncode: int

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name}"
        return f"exited with code {self.returncode}"


class Backend(ABC):
    @abstractmethod
    def start(self, worker_id: int, env: dict[str, str]) -> int | None:
        """Launch a worker; returns its pid when known."""

    @abstractmethod
    def poll(self) -> list[Exit]:
        """Workers whose process ended since the last call."""

    @abstractmethod
    def signal(self, worker_id: int, sig: int) -> None:
        """Send ``sig`` to a worker's process, if it still runs."""

    @abstractmethod
    def alive(self) -> list[int]:
        """Ids of workers whose process still runs."""

    def describe_exit(self, worker_id: int) -> str:
        """A line of context for a failed worker (e.g. its log's last line)."""
        return ""

    def close(self) -> None:
        """Release what the backend holds; called once every worker has exited."""
        return None


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
