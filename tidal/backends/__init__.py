"""Backends start and stop worker processes; register by name.

``local`` (subprocesses of the coordinator) is built in, and so is ``hosts`` (machines that
joined the job: ``tidal run --listen``, ``tidal worker --join``); ``ray`` (actors on a Ray
cluster) needs the ``ray`` extra and imports Ray only when a job asks for it.
"""

from tidal.backends import local as _local  # noqa: F401 - registers "local"
from tidal.backends.base import Backend, Exit, get_backend, known_backends, register_backend
from tidal.backends.hosts import HostsBackend

register_backend("hosts", HostsBackend)


def _ray_backend(**kwargs: object) -> Backend:
    from tidal.backends.ray import RayBackend

    return RayBackend(**kwargs)


register_backend("ray", _ray_backend)


def check_capacity(spec: object) -> None:
    """Refuse (``ValueError``, one line) a job whose backend cannot hold its
    ``--max-workers``: before anything is recorded or started."""
    factory = get_backend(spec.backend)
    check = getattr(factory, "check_capacity", None)
    if check is not None:
        check(spec)


__all__ = ["Backend", "Exit", "check_capacity", "get_backend", "known_backends"]
