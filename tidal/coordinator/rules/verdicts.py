"""What the coordinator's rules say, as values: a verdict is an ``Act`` and its reason.

Every rule that decides between a few courses (``final_checkpoint``, ``roll_back``,
``every_member_lost``, ``stop_outcome``) returns a ``Verdict``; the coordinator matches on
``verdict.act``, never on a word. Pure, no imports of the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Act(Enum):
    """What a rule says to do.

    - ``WAIT``: nothing yet; ask again on a later pass (a report may still come).
    - ``SUCCEED`` / ``FAIL``: decide the job's outcome, for ``Verdict.why``.
    - ``ROLL_BACK``: every member loads the newest verified checkpoint (the state's holders
      were lost); ``why`` is the event that says so.
    - ``RESUME``: every member was lost; the next members resume from a checkpoint.
    """

    WAIT = "wait"
    SUCCEED = "succeed"
    FAIL = "fail"
    ROLL_BACK = "roll back"
    RESUME = "resume"


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """``act``, and ``why`` in words (an outcome's reason or an event; "" for ``WAIT``)."""

    act: Act
    why: str = ""


WAIT = Verdict(act=Act.WAIT)


def fail(why: str) -> Verdict:
    return Verdict(act=Act.FAIL, why=why)


def succeed(why: str = "") -> Verdict:
    return Verdict(act=Act.SUCCEED, why=why)
