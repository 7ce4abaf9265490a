"""The coordinator's parts, composed: each built with exactly what it needs.

``compose`` is the one place the parts are wired; ``Coordinator`` calls it with the real
executor, and ``tests/test_decisions.py`` with one that records actions instead of carrying
them out (no store, no SQLite, no process). The parts depend on each other in one direction
(each on those listed before it) and call public methods only.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.checkpoint.location import Location
from tidal.coordinator.control.effects import Effects
from tidal.coordinator.control.generations import Generations
from tidal.coordinator.control.handlers import Handlers
from tidal.coordinator.control.ledger import Ledger
from tidal.coordinator.control.lifecycle import Lifecycle
from tidal.coordinator.control.loop import ControlLoop
from tidal.coordinator.control.publish import Publisher
from tidal.coordinator.control.scaling import Scaling
from tidal.coordinator.control.views import Views
from tidal.coordinator.control.worlds import Worlds

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.control.wake import Wake
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job
    from tidal.coordinator.records.accounting import Accounting
    from tidal.policy.registry import Policy
    from tidal.protocol import WorkerConfig


@dataclass(frozen=True, kw_only=True)
class Parts:
    """The coordinator's parts, in the order each depends on those before it."""

    ledger: Ledger
    publisher: Publisher
    generations: Generations
    lifecycle: Lifecycle
    worlds: Worlds
    scaling: Scaling
    effects: Effects
    handlers: Handlers
    views: Views
    loop: ControlLoop


def compose(
    *,
    job: Job,
    spec: JobSpec,
    executor: Executor,
    accounting: Accounting,
    policy: Policy,
    lock: threading.RLock,
    wake: Wake,
    inbox: deque,
    namespace: str,
    first_generation: int,
    first_worker: int,
    checkpoint_dir: Location | None,
    token: str,
    url: str,
    config: WorkerConfig | None,
    resumed_step: int | None,
) -> Parts:
    """The parts of a coordinator of ``job``. ``namespace``: its store namespace;
    ``first_generation``/``first_worker``: the ids a job with none starts from (a resumed
    job's go on from its records'); ``token``: the job's, from which workers' credentials
    are derived; ``url``: the API's; ``config``: what a registered worker is told;
    ``resumed_step``: the checkpoint's step a resumed job started from."""
    ledger = Ledger(job=job, executor=executor, accounting=accounting)
    publisher = Publisher(job=job, spec=spec, executor=executor)
    generations = Generations(
        job=job,
        spec=spec,
        executor=executor,
        ledger=ledger,
        publisher=publisher,
        namespace=namespace,
        first_id=first_generation,
        checkpoint_dir=checkpoint_dir,
    )
    lifecycle = Lifecycle(
        job=job,
        spec=spec,
        executor=executor,
        ledger=ledger,
        generations=generations,
        token=token,
        url=url,
        first_worker_id=first_worker,
        checkpoint_dir=checkpoint_dir,
    )
    worlds = Worlds(
        job=job,
        spec=spec,
        executor=executor,
        ledger=ledger,
        lifecycle=lifecycle,
        generations=generations,
    )
    scaling = Scaling(
        job=job,
        spec=spec,
        accounting=accounting,
        executor=executor,
        ledger=ledger,
        lifecycle=lifecycle,
        generations=generations,
        policy=policy,
    )
    effects = Effects(
        job=job,
        spec=spec,
        executor=executor,
        ledger=ledger,
        publisher=publisher,
        lifecycle=lifecycle,
        wake=wake,
        config=config,
        resumed_step=resumed_step,
    )
    handlers = Handlers(
        spec=spec,
        lock=lock,
        inbox=inbox,
        wake=wake,
        effects=effects,
        publisher=publisher,
        ledger=ledger,
    )
    views = Views(
        job=job,
        executor=executor,
        lock=lock,
        accounting=accounting,
        ledger=ledger,
        drain=handlers.drain,
        url=url,
    )
    loop = ControlLoop(
        job=job,
        spec=spec,
        executor=executor,
        lock=lock,
        ledger=ledger,
        publisher=publisher,
        handlers=handlers,
        views=views,
        lifecycle=lifecycle,
        generations=generations,
        worlds=worlds,
        scaling=scaling,
        checkpoint_dir=checkpoint_dir,
    )
    return Parts(
        ledger=ledger,
        publisher=publisher,
        generations=generations,
        lifecycle=lifecycle,
        worlds=worlds,
        scaling=scaling,
        effects=effects,
        handlers=handlers,
        views=views,
        loop=loop,
    )
