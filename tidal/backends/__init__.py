"""Backends start and stop worker processes; register by name.

``local`` (subprocesses of the coordinator) is built in, and so is ``hosts`` (machines that
joined the job: ``tidal run --listen``, ``tidal worker --join``); ``ray`` (actors on a Ray
cluster) needs the ``ray`` extra and imports Ray only when a job asks for it; ``slurm`` (job
steps or jobs of a Slurm cluster) needs Slurm's commands on ``PATH``.
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


def _slurm_backend(**kwargs: object) -> Backend:
    from tidal.backends.slurm import SlurmBackend

    return SlurmBackend(**kwargs)


def _check_slurm(spec: object) -> None:
    from tidal.backends.slurm import SlurmBackend

    SlurmBackend.check_capacity(spec)


_slurm_backend.check_capacity = _check_slurm  # type: ignore[attr-defined]
register_backend("slurm", _slurm_backend)


def serving_address(spec: object) -> tuple[str, int]:
    """Where a coordinator of ``spec`` serves its API and store on this machine: the address
    its workers reach it at (loopback for local workers; on Ray, the node's cluster address;
    ``--listen``'s; on Slurm, the one its route to the cluster leaves from), and the API's
    port (0: one the OS picks)."""
    from tidal.config import parse_listen

    if spec.backend == "ray":
        from tidal.backends.ray import node_address

        return node_address(), 0
    if spec.backend == "slurm":
        from tidal.backends.slurm_commands import coordinator_address

        return coordinator_address(spec), parse_listen(spec.listen)[1] if spec.listen else 0
    if spec.backend == "hosts":
        return parse_listen(spec.listen or "")
    return "127.0.0.1", 0


def check_capacity(spec: object) -> None:
    """Refuse (``ValueError``, one line) a job whose backend cannot hold its
    ``--max-workers``: before anything is recorded or started."""
    factory = get_backend(spec.backend)
    check = getattr(factory, "check_capacity", None)
    if check is not None:
        check(spec)


__all__ = [
    "Backend",
    "Exit",
    "check_capacity",
    "get_backend",
    "known_backends",
    "serving_address",
]
