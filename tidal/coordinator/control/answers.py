"""What workers' heartbeats are answered from, without the coordinator's lock.

A worker's heartbeat is the control plane's hot path: every worker, every interval. Its
answer (role, newest generation, stop, settled step, pacing) changes only when the job's
membership or outcome does, so the control loop publishes it as an immutable ``Answers``
(``Publisher.publish``) after every change a worker must learn of, and a heartbeat reads
the newest one (a single attribute read: no lock, no wait behind a control-loop pass). Each
``Answers`` encodes each of its (at most three) answers once, for however many workers ask.

Contract: an answer is never older than the last ``publish``, which runs at the end of
every control-loop pass and whenever a generation opens; a change made between passes (a
``tidal stop``) wakes the loop, so workers learn of it within one pass. A worker whose
record says it is retired is told to exit at once (its record is read directly).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.coordinator.rules.pacing import heartbeat_interval
from tidal.coordinator.rules.scale_rules import reached
from tidal.protocol import GenerationInfo, HeartbeatResponse, Role


@dataclass(frozen=True, kw_only=True)
class Answers:
    """One published state of what workers are told. ``workers``: how many the job has
    (the standbys' pacing counts those outside the generation)."""

    generation: GenerationInfo | None
    members: frozenset[int]
    stop: bool
    stop_step: int | None = None  # a member's script stopped the job at this step
    busy: frozenset[int] = frozenset()  # members alive and busy in their script (``busy``)
    ended: bool  # an outcome is decided: every worker exits
    settled_step: int | None  # ``Job.settled_step``
    workers: int
    base_s: float
    timeout_s: float
    _encoded: dict[Role, bytes] = field(default_factory=dict, compare=False, repr=False)

    def settled(self, step: int) -> bool:
        """Whether scheduled ``step`` is settled: members held there go on."""
        return reached(self.settled_step, step)

    def role(self, wid: int, *, retired: bool) -> Role:
        if retired or self.ended:
            return Role.EXIT
        return Role.MEMBER if wid in self.members else Role.STANDBY

    def response(self, role: Role) -> HeartbeatResponse:
        if role == Role.EXIT:
            return HeartbeatResponse(role=Role.EXIT, stop=self.stop, stop_step=self.stop_step)
        peers = len(self.members) if role == Role.MEMBER else self.workers - len(self.members)
        interval = heartbeat_interval(base_s=self.base_s, peers=peers, timeout_s=self.timeout_s)
        return HeartbeatResponse(
            role=role,
            generation=self.generation,
            stop=self.stop,
            stop_step=self.stop_step,
            busy=sorted(self.busy) if role == Role.MEMBER else [],
            settled_step=self.settled_step,
            interval_s=interval if interval != self.base_s else None,
        )

    def encoded(self, role: Role) -> bytes:
        """The answer's JSON, made once per role (a race makes it twice: same bytes)."""
        body = self._encoded.get(role)
        if body is None:
            body = self._encoded[role] = self.response(role).model_dump_json().encode()
        return body
