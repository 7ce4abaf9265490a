"""The wire messages between a job's coordinator and the agents of the hosts that joined it
(``tidal worker --join URL --token-file FILE``: ``tidal.hosts``), and the agents' credential.

The design is pull: an agent calls the coordinator, never the other way round, so a host
behind NAT or a firewall that lets nothing in can still join. An agent registers its
capacity (``HostRegister``), then polls (``HostPoll``) for as long as the job runs. Each poll
reports what the host runs and the exits the coordinator has not yet acknowledged, and is
answered with the host's orders (``HostOrders``): the whole set of workers placed on it and
the signals not yet applied. Everything is level-triggered and idempotent, so an answer or
a report lost with a connection is made good by the next poll:

- a worker in ``HostOrders.workers`` that the agent never started is started once; one it
  runs that the answer no longer lists is unknown to the coordinator (the host was declared
  lost, or a restarted coordinator did not adopt it) and is killed;
- signals are numbered (``SignalOrder.seq``); the agent applies each once, in order, and says
  how far it got (``HostPoll.signal_seq``), after which the coordinator forgets them;
- an exit is reported in every poll until a poll that carried it is answered;
- a poll is answered at once when there is news (``version`` differs from the agent's),
  else held up to ``wait_s`` (a long poll: orders reach the host without a busy poll).

Every call carries the hosts' credential (``host_token``), derived from the job's token: it
lets a machine join the job and nothing else (it cannot scale or stop the job, nor speak for
a worker). The workers a host starts get their own credentials in their orders' ``env``.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from pydantic import BaseModel, Field

from tidal.protocol import API_PREFIX, MAX_ID

HOSTS_PATH = API_PREFIX + "/hosts"
#: The longest an agent may ask the coordinator to hold a poll (``HostPoll.wait_s``).
MAX_WAIT_S = 30.0
#: The most workers one host runs, and so the most entries of each list below.
MAX_SLOTS = 4096

HostId = Annotated[int, Field(ge=1, le=MAX_ID)]
WorkerId = Annotated[int, Field(ge=0, le=MAX_ID)]
Text = Annotated[str, Field(max_length=300)]


def host_token(job_token: str) -> str:
    """The credential of every host agent of a job: HMAC-SHA256 of ``hosts`` keyed by the
    job's token (hex). ``tidal run --listen`` writes it to the file the join line names."""
    return hmac.new(job_token.encode(), b"hosts", hashlib.sha256).hexdigest()


class HostWorker(BaseModel):
    """A worker process the agent runs."""

    worker_id: WorkerId
    pid: Annotated[int, Field(ge=1, le=MAX_ID)]


class HostExit(BaseModel):
    """A worker process of the host ended: its return code (< 0: killed by that signal),
    why when the code alone does not say, and the last line of its log."""

    worker_id: WorkerId
    returncode: Annotated[int, Field(ge=-255, le=255)]
    reason: Text = ""
    last_line: Text = ""


class HostRegister(BaseModel):
    """A host offers ``slots`` workers. ``address``: where its workers are reached (the
    address its route to the coordinator leaves from); ``running``: workers it still runs
    (a restarted coordinator adopts those it knows); ``exits``: ends not yet acknowledged."""

    name: Annotated[str, Field(min_length=1, max_length=255)]
    address: Annotated[str, Field(min_length=1, max_length=255)]
    slots: Annotated[int, Field(ge=1, le=MAX_SLOTS)]
    pid: Annotated[int, Field(ge=1, le=MAX_ID)]
    running: list[HostWorker] = Field(default_factory=list, max_length=MAX_SLOTS)
    exits: list[HostExit] = Field(default_factory=list, max_length=MAX_SLOTS)


class HostJoined(BaseModel):
    """The answer to a registration: the host's id, and what every worker it starts runs
    (``JobSpec.worker_argv``: the script and its arguments, with the host's own Python, in
    ``cwd`` where that folder exists there). ``lost_after_s``: a host the coordinator does
    not hear from for this long is lost, its workers failed; ``orphan_timeout_s``: how long
    the agent keeps its workers while the coordinator cannot be reached (they give up after
    it too)."""

    host_id: HostId
    job: str
    command: list[str]
    cwd: str
    lost_after_s: float
    orphan_timeout_s: float


class HostPoll(BaseModel):
    """``version``: the orders' version the agent last saw (0: none); ``signal_seq``: the
    last signal it applied; ``wait_s``: hold the answer this long at most when there is no
    news (0: answer at once); ``leaving``: the host is going away (its agent was told to
    stop): place nothing more on it; ``goodbye``: the agent's last call, its workers gone."""

    running: list[HostWorker] = Field(default_factory=list, max_length=MAX_SLOTS)
    exits: list[HostExit] = Field(default_factory=list, max_length=MAX_SLOTS)
    version: Annotated[int, Field(ge=0, le=2**62)] = 0
    signal_seq: Annotated[int, Field(ge=0, le=2**62)] = 0
    wait_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0
    leaving: bool = False
    goodbye: bool = False


class WorkerOrder(BaseModel):
    """Run worker ``worker_id`` with ``env`` over the host's own environment."""

    worker_id: WorkerId
    env: dict[str, str]


class SignalOrder(BaseModel):
    seq: Annotated[int, Field(ge=1)]
    worker_id: WorkerId
    signum: Annotated[int, Field(ge=1, le=64)]


class HostOrders(BaseModel):
    """Everything the host should be doing now (see the module doc)."""

    version: int
    workers: list[WorkerOrder] = Field(default_factory=list)
    signals: list[SignalOrder] = Field(default_factory=list)


__all__ = [
    "HOSTS_PATH",
    "MAX_SLOTS",
    "MAX_WAIT_S",
    "HostExit",
    "HostJoined",
    "HostOrders",
    "HostPoll",
    "HostRegister",
    "HostWorker",
    "SignalOrder",
    "WorkerOrder",
    "host_token",
]
