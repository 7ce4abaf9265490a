"""Which per-step values a tracker is sent now, and what a tracker's record becomes: pure
rules, table-tested (``tests/test_tracking.py``).

A tracker gets the job's per-step values (the ``step_metrics`` rows, one value per (step,
name): ``coordinator.step_metrics``) in step order, each step once, behind a durable
high-water mark: every step at or below ``sent_through`` has been handled. A step is ready
once the job committed it (``step < committed``) and none of its rows changed for
``SETTLE_S`` (the other members' values of a ``reduce="mean"`` arrive within a few
heartbeats), and the job's count passed it ``COMMIT_LAG_S`` ago (``committed_before``: its
values may come in two records, such as a stopped job's evaluation after its loop and the
resumed job's step). At the job's end its committed steps go without waiting to settle, and the
steps at or after its committed count (values a script logs after its loop) go too if it
succeeded; a job that stopped or failed keeps those for its resume, which commits that step
and logs its own values there (sent then, all at once). Steps go in order, so the first
step that is not ready holds back the ones after it (W&B takes a run's steps in increasing
order only). A row at or below the mark that arrives or changes later is not sent: a
tracker keeps the first value of a step, as TensorBoard does (``tidal.tensorboard``).

Exactly once across a crash: before a batch is sent its last step is written down as
``sending_through`` (the intent), after it as ``sent_through``. A coordinator that finds
``sending_through > sent_through`` does not know how much of that batch arrived: it asks the
tracker which of those (name, step) points it holds and sends only the others (``unsent``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

SETTLE_S = 1.0  # as TensorBoard's: a committed step's value unchanged this long is final
# A step counts as committed once the job's count has passed it this long: rank 0's values of
# a step come with its next heartbeat (1 s) and reach SQLite within 0.7 s, while any
# member's heartbeat may move the count first.
COMMIT_LAG_S = 2.0
MAX_POINTS = 1000  # points in one batch: MLflow's log_batch takes at most 1,000 metrics


@dataclass(frozen=True)
class Row:
    """One ``step_metrics`` row; ``seq`` changes whenever the row is written again."""

    step: int
    name: str
    value: float
    seq: int


@dataclass(frozen=True)
class Point:
    """One value as a tracker records it; ``wall``: when it was first seen (the time the
    tracker shows for it)."""

    step: int
    name: str
    value: float
    wall: float


@dataclass(frozen=True)
class Sighting:
    """When the forwarder first saw version ``seq`` of a row (monotonic and wall time)."""

    seq: int
    at: float
    wall: float


Seen = Mapping[tuple[int, str], Sighting]


def observe(seen: Seen, rows: Iterable[Row], *, now: float, wall: float, after: int) -> dict:
    """``seen`` with ``rows`` looked at now: a row not seen before, or written again since
    (another ``seq``), is seen now; entries at or below step ``after`` are dropped."""
    out = {key: s for key, s in seen.items() if key[0] > after}
    for r in rows:
        key = (r.step, r.name)
        old = out.get(key)
        if old is None or old.seq != r.seq:
            out[key] = Sighting(seq=r.seq, at=now, wall=wall)
    return out


def committed_before(samples: Sequence[tuple[float, int]], *, at: float) -> int:
    """The job's committed count as it was at time ``at``: the newest of ``samples``
    ((time, count), oldest first) taken at or before ``at``; 0 if none was."""
    count = 0
    for t, c in samples:
        if t > at:
            break
        count = c
    return count


def next_batch(
    rows: Sequence[Row],
    seen: Seen,
    *,
    sent_through: int,
    committed: int,
    now: float,
    ending: bool = False,
    final: bool = False,
    settle_s: float = SETTLE_S,
    max_points: int = MAX_POINTS,
) -> tuple[list[Point], int]:
    """The points to send now and the step they reach: the steps after ``sent_through``
    that are ready (module doc), in order, stopping at the first that is not, and before
    ``max_points`` is passed (a step is never split; one larger than that goes alone).
    ``rows``: every row of the steps after ``sent_through`` that were read, in step order;
    ``seen``: ``observe``'s sightings of them. ``ending``: the job ended (its committed
    steps need not settle); ``final``: it succeeded (the steps after its committed count go
    too). Returns ``([], sent_through)`` when none is ready."""
    by_step: dict[int, list[Row]] = {}
    for r in rows:
        if r.step > sent_through:
            by_step.setdefault(r.step, []).append(r)
    points: list[Point] = []
    through = sent_through
    for step in sorted(by_step):
        group = [(r, seen.get((step, r.name))) for r in by_step[step]]
        if step >= committed and not final:
            break
        if not ending and any(
            s is None or s.seq != r.seq or now - s.at < settle_s for r, s in group
        ):
            break
        if points and len(points) + len(group) > max_points:
            break
        for r, s in group:
            points.append(Point(step=step, name=r.name, value=r.value, wall=s.wall if s else 0.0))
        through = step
    return points, through


def unsent(rows: Iterable[Row], held: set[tuple[str, int]] | None) -> list[Row]:
    """The rows of an interrupted batch that the tracker does not hold: ``held`` is the
    (name, step) points it has of that batch's steps, None if it cannot tell (all go again)."""
    if held is None:
        return list(rows)
    return [r for r in rows if (r.name, r.step) not in held]


@dataclass(frozen=True, kw_only=True)
class Record:
    """A job's tracker, as written in the home's ``trackers`` table: which tracker
    (``kind``, ``target``), the key Tidal made for its run before asking for one (MLflow
    finds the run by it, W&B takes it as the run's id), the run's id once there is one, and
    the high-water marks (module doc)."""

    kind: str
    target: str | None
    key: str
    run_id: str | None = None
    sent_through: int = -1
    sending_through: int = -1


def record_for(existing: Record | None, *, kind: str, target: str | None, key: str) -> Record:
    """The record a coordinator goes on with: the job's existing one if it names the same
    tracker (a restarted coordinator, ``tidal resume``: the same run, from its marks), else a
    new one with ``key`` and nothing sent."""
    if existing is not None and (existing.kind, existing.target) == (kind, target):
        return existing
    return Record(kind=kind, target=target, key=key)
