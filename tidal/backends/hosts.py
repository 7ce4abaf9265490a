"""Workers on machines that joined the job: ``tidal run --listen HOST:PORT`` (the ``hosts``
backend) and, on each machine, ``tidal worker --join URL --token-file FILE [--slots N]``.

The coordinator serves its API and rendezvous store on ``HOST``, the address the other
machines reach it at; each joining machine's agent (``tidal.hosts.agent``) registers its
slots and polls for orders (``tidal.hosts_protocol``); its workers are the agent's child
processes. This backend is the coordinator's side: ``start`` places a worker on a host with
a free slot (``placement.place``: spread), or leaves it waiting (``pending``) until a host
joins or a slot frees; ``signal`` goes to the worker through its agent; an agent's report of
an exit, or the loss of its host (``placement.lost_hosts``), is an ``Exit``. What agents
call lands in ``registry`` (``host_registry.HostRegistry``), which the API's ``/hosts``
routes reach through ``Backend.hosts``.

With ``--local-slots N`` the coordinator's own machine is one more host of ``N`` slots, whose
workers the local backend runs (``tidal.backends.local``), bound to ``HOST`` too.

A restarted coordinator (``supervisor``) adopts the workers of the hosts whose agents register
again within the heartbeat timeout, listing them; the others are lost.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

from tidal.backends.addresses import socket_env
from tidal.backends.base import Backend, Exit
from tidal.backends.host_registry import LOCAL, HostRegistry
from tidal.backends.local import LocalBackend, local_capacity
from tidal.backends.zygote import Zygote
from tidal.config import JobSpec, parse_listen


def local_spec(spec: JobSpec) -> JobSpec:
    """The spec the local backend of ``--local-slots`` runs with: at most that many workers
    of the job on this machine."""
    return dataclasses.replace(
        spec,
        backend="local",
        listen=None,
        local_slots=0,
        workers=1,
        min_workers=1,
        max_workers=spec.local_slots,
        spares=0,
        schedule=(),
    )


class HostsBackend(Backend):
    @classmethod
    def check_capacity(cls, spec: JobSpec) -> None:
        """Refuse ``--local-slots`` beyond what this machine holds; the hosts' slots come
        as they join (workers wait for them), so ``--max-workers`` is not refused."""
        if spec.local_slots <= 0:
            return
        limit, why = local_capacity(oversubscribe=spec.oversubscribe)
        if spec.local_slots > limit:
            raise ValueError(
                f"--local-slots {spec.local_slots} is more than this machine holds: at most "
                f"{limit} local workers ({why})"
            )

    def __init__(self, *, spec: JobSpec, log_dir: Path, cwd: Path | None = None) -> None:
        self.check_capacity(spec)
        self.host, _ = parse_listen(spec.listen or "")
        self.local = (
            LocalBackend(spec=local_spec(spec), log_dir=log_dir, cwd=cwd)
            if spec.local_slots > 0
            else None
        )
        self._local_env = socket_env(self.host, os.environ)  # gloo binds HOST here too
        self.registry = HostRegistry(
            job=spec.name,
            command=list(spec.worker_argv),  # the script, or --torchrun's launcher first
            cwd=str(cwd or Path.cwd()),
            lost_after_s=spec.heartbeat_timeout_s,
            orphan_timeout_s=spec.orphan_timeout_s,
            local_node=f"{socket.gethostname()} ({self.host})",
            local_slots=spec.local_slots,
        )
        self.adopt_wait_s = spec.heartbeat_timeout_s

    @property
    def hosts(self) -> HostRegistry:
        return self.registry

    @property
    def reaped_fd(self) -> int | None:  # the supervisor's reaped pipe: local workers' exits
        return self.local.reaped_fd if self.local is not None else None

    @reaped_fd.setter
    def reaped_fd(self, fd: int | None) -> None:
        if self.local is not None:
            self.local.reaped_fd = fd

    def prepare(self, zygote: Zygote | None = None) -> None:
        if self.local is not None:
            self.local.prepare(zygote)

    def wait_ready(self) -> bool:
        return self.local.wait_ready() if self.local is not None else True

    def _start_local(self, wid: int, env: dict[str, str]) -> int | None:
        assert self.local is not None  # the registry has no local host without it
        return self.local.start(wid, {**env, **self._local_env})

    def start(self, worker_id: int, env: dict[str, str]) -> int | None:
        """Place the worker; its pid when it runs here, else None (a host's agent starts it,
        and the worker tells its pid when it registers)."""
        if self.registry.request(worker_id, env) == LOCAL:
            return self._start_local(worker_id, env)
        return None

    def poll(self) -> list[Exit]:
        exits: list[Exit] = []
        if self.local is not None:
            for ex in self.local.poll():
                self.registry.ended(ex.worker_id)
                exits.append(ex)
        self.registry.check()
        exits += self.registry.take_exits()
        for wid, hid, env in self.registry.place_waiting():  # room freed, or a host joined
            if hid == LOCAL:
                self._start_local(wid, env)
        return exits

    def signal(self, worker_id: int, sig: int) -> None:
        if not self.registry.signal(worker_id, sig) and self.local is not None:
            self.local.signal(worker_id, sig)

    def alive(self) -> list[int]:
        return sorted({*self.registry.placed(), *self.registry.waiting()})

    def waiting(self) -> set[int]:
        return self.registry.waiting()

    def adopt(self, worker_id: int, pid: int, env: dict[str, str]) -> bool:
        """A local worker is adopted as the local backend does; any other is expected back
        with its host's agent (``HostRegistry.expect``): True now, an ``Exit`` later if no
        agent claims it within the heartbeat timeout."""
        if not pid:
            return False
        if self.local is not None and self.local.adopt(worker_id, pid, env):
            self.registry.adopt_local(worker_id)
            return True
        self.registry.expect(worker_id, pid, self.adopt_wait_s)
        return True

    def node(self, worker_id: int) -> str | None:
        return self.registry.node(worker_id)

    def describe_exit(self, worker_id: int) -> str:
        line = self.registry.last_line(worker_id)
        if not line and self.local is not None:
            line = self.local.describe_exit(worker_id)
        return line

    def wake_fds(self) -> list[int]:
        fds = [self.registry.wake_fd]
        if self.local is not None:
            fds += self.local.wake_fds()
        return fds

    def news(self) -> list[str]:
        return self.registry.take_news()

    def close(self) -> None:
        self.registry.release()
        if self.local is not None:
            self.local.close()

    def leave(self) -> None:
        self.registry.release()
        if self.local is not None:
            self.local.leave()
