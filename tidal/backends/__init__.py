"""Backends start and stop worker processes; register by name.

``local`` (subprocesses of the coordinator) is built in; ``ray`` (actors on a Ray cluster)
needs the ``ray`` extra and imports Ray only when a job asks for it.
"""

from tidal.backends import local as _local  # noqa: F401 - registers "local"
from tidal.backends.base import Backend, Exit, get_backend, known_backends, register_backend


def _ray_backend(**kwargs: object) -> Backend:
    from tidal.backends.ray import RayBackend

    return RayBackend(**kwargs)


register_backend("ray", _ray_backend)

__all__ = ["Backend", "Exit", "get_backend", "known_backends"]
