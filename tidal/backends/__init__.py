"""Backends start and stop worker processes; register by name.

``local`` (subprocesses of the coordinator) is built in, and so is ``hosts`` (machines that
joined the job: ``tidal run --listen``, ``tidal worker --join``); ``ray`` (actors on a Ray
cluster) needs the ``ray`` extra and imports Ray only when a job asks for it.
"""

from tidal.backends import local as _local  # noqa: F401 - registers "local"
from tidal.backends.base import Backend, Exit, get_backend, known_backends, register_backend


def _hosts_backend(**kwargs: object) -> Backend:
    from tidal.backends.hosts import HostsBackend  # pydantic: not for the CLI's parser

    return HostsBackend(**kwargs)


def _check_hosts(spec: object) -> None:
    from tidal.backends.hosts import HostsBackend

    HostsBackend.check_capacity(spec)


_hosts_backend.check_capacity = _check_hosts  # type: ignore[attr-defined]
register_backend("hosts", _hosts_backend)


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
