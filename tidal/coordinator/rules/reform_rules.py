"""The loop's rules about a generation's recovery: when a reported failed collective
re-forms the group, when failures in a row fail the job instead, what happens when the
training state's holders or every member were lost, and how a generation recovered. Pure,
table-tested (``tests/test_rules.py``).
"""

from __future__ import annotations

from tidal.coordinator.job import Streak
from tidal.coordinator.rules.verdicts import Act, Verdict, fail
from tidal.protocol import RecoveryPath


# -- the state's holders were lost ---------------------------------------------------------
def roll_back(*, lost_step: int, checkpoint_step: int | None) -> Verdict:
    """``FAIL`` (why) or ``ROLL_BACK`` (the event) when no live worker holds the training
    state of ``lost_step``: never train on from scratch; the newest verified checkpoint, if
    any, is the state to go on from."""
    if checkpoint_step is None:
        return fail(
            f"no live worker holds the training state of step {lost_step} (its holders were "
            "lost) and there is no checkpoint to roll back to; run with --checkpoint-every"
        )
    return Verdict(
        act=Act.ROLL_BACK,
        why=f"no live worker holds step {lost_step}: rolling back to the checkpoint of step "
        f"{checkpoint_step} ({max(0, lost_step - checkpoint_step)} steps redone)",
    )


def every_member_lost(
    *, keeps_checkpoints: bool, checkpoint_step: int | None, step: int
) -> Verdict:
    """``FAIL`` (why) or ``RESUME`` (the event) when the last member of the job is lost
    (all at once, or the last survivor). With a verified checkpoint the job goes on, as
    torchrun restarts a worker group: the next workers admitted find no state, and healing
    sends them to the checkpoint (``roll_back``); otherwise it fails saying so. The workers
    lost count against ``--max-restarts`` like any others (``judge_exit``)."""
    if not keeps_checkpoints:
        return fail("every worker was lost; nothing holds the training state")
    verdict = roll_back(lost_step=step, checkpoint_step=checkpoint_step)
    if verdict.act is Act.FAIL:
        return fail(f"every worker was lost; {verdict.why}")
    return Verdict(
        act=Act.RESUME,
        why=f"every worker was lost at step {step}: the next members resume from the "
        f"checkpoint of step {checkpoint_step}",
    )


# -- how a generation recovered its state ---------------------------------------------------
def merge_recovery(
    recorded: tuple[RecoveryPath | None, int | None], path: RecoveryPath | None, redone: int
) -> tuple[RecoveryPath | None, int | None]:
    """A generation's (recovery path, redone steps) once a member reports ``path`` and
    ``redone``: the most severe path (``RecoveryPath``'s order) and the most steps redone. A
    report with neither (a worker of an older version) changes nothing."""
    old_path, old_redone = recorded
    if path is None and redone <= 0:
        return recorded
    order = list(RecoveryPath)
    worst = max((p for p in (old_path, path) if p is not None), key=order.index, default=None)
    return worst, max(old_redone or 0, redone)


def neighbour_copy_event(
    gen_id: int,
    recorded: tuple[RecoveryPath | None, int | None],
    path: RecoveryPath | None,
    redone: int,
) -> str | None:
    """The event of a generation rebuilt from neighbour copies with steps redone, for its
    first report that says so (``recorded``: what its earlier reports said), else None. A
    rollback to a checkpoint has its own event (``roll_back``)."""
    old_path, old_redone = recorded
    if path is not RecoveryPath.NEIGHBOUR_COPY or redone <= 0:
        return None
    if old_path is RecoveryPath.CHECKPOINT or (
        old_path is RecoveryPath.NEIGHBOUR_COPY and (old_redone or 0) > 0
    ):
        return None
    return f"generation {gen_id}: rebuilt from neighbour copies, {redone} steps redone"


# -- a failed collective ---------------------------------------------------------------------
def reform_due(
    *,
    requested_at: float,
    now: float,
    grace_s: float,
    reported_gen: int,
    latest_gen: int,
    unreported: int,
) -> bool | None:
    """A member reported a failed collective in ``reported_gen`` at ``requested_at``: True
    to re-form the latest generation now, False to wait (a dead peer's exit may be seen
    within the grace period, and then the generation re-forms without it), None to drop the
    request (a newer generation already answers it). ``unreported``: the members of the
    latest generation that have not reported a failure in it; when none is left, no exit is
    pending (a dead member reports nothing) and waiting out the grace would only add it to
    the pause (a raise in a one-member job's collective re-formed after 0.1 s of it)."""
    if reported_gen == latest_gen and unreported == 0:
        return True
    if now - requested_at < grace_s:
        return False
    return True if reported_gen == latest_gen else None


#: Failed collectives in a row, all reported at the same committed step of the job with every
#: member alive, after which the job fails instead of re-forming again. A forming that fails
#: under heavy load (a peer too slow to connect within the window) is reported as a failed
#: collective too, and each one in a row doubles the worker's connect window
#: (``group.connect_timeout``), so a few in a row are legitimate; ten in a row at the same
#: step means windows up to 0.3 s * 2^10 (capped at the collective timeout) came and went:
#: nothing will form. A bug every step's collective hits (gloo refusing a reduce op) fails
#: the same way each time and would otherwise re-form forever (~400 generations in 2 min).
REFORMS_WITHOUT_PROGRESS = 10


def repeated_failure(
    streak: Streak | None,
    *,
    step: int,
    worker_id: int,
    error: str,
    limit: int = REFORMS_WITHOUT_PROGRESS,
) -> tuple[Streak, str | None]:
    """A member's failed collective is due for a re-form (``reform_due`` said True) while
    the job's committed step is ``step``: the streak it makes, and why the job fails
    instead of re-forming (None: re-form). The ``limit``-th failure in a row at the same
    step fails the job, quoting the last report in one line.

    What ends a streak (the coordinator passes ``streak=None``, or the step differs):

    - committed progress: the job's step advanced (or moved at all: a roll-back to a
      checkpoint is a new state to train from). Only progress proves the failures were
      transient; a failure every other step still trains on.
    - a member lost (its process ended, a kill for missed heartbeats): a dying peer makes
      its survivors' collectives fail, sometimes before its exit is seen (a Ray actor's
      death takes ~1 s, past the 100 ms grace), so those failures are explained and a
      cascade of losses at one step must not add up to a false verdict. Losses are
      bounded (``--max-restarts``, then the workers left), so this reset cannot feed a
      loop of its own.

    What does not: a scale (``tidal scale``, a policy, the capacity), a standby or a
    replacement joining. They explain nothing (every member runs the same code, and the
    failure was with every member alive), and they can repeat without bound: a policy
    reacting to a job that makes no progress would keep the loop going. A restart of the
    coordinator does not either: the streak is in its ``control`` record."""
    line = (error.strip().splitlines() or [""])[0][:300]
    last = f"worker {worker_id}: {line}"
    count = streak.count + 1 if streak is not None and streak.step == step else 1
    now = Streak(step=step, count=count, last=last)
    if count < limit:
        return now, None
    return now, (
        f"the collective at step {step} failed {count} times in a row with every member "
        f"alive (last: {last})"
    )
