"""Backends start and stop worker processes; register by name."""

from tidal.backends import local as _local  # noqa: F401 - registers "local"
from tidal.backends.base import Backend, Exit, get_backend, known_backends

__all__ = ["Backend", "Exit", "get_backend", "known_backends"]
