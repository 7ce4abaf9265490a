"""The fault kinds of the chaos campaign: how each is injected and the pause it may cost.

Every kind acts on a settled job (``trial.settled``) at a random moment (the campaign idles
0-1 s first) and returns the ``Event`` it injected, or None when it could not apply (then
nothing is counted). Targets are drawn from the trial's seeded generator.

Kinds (and the bound on each pause they cause; hb is ``--heartbeat-timeout``):

- ``kill``: SIGKILL of a random member (2 s).
- ``stop``: SIGSTOP of a random member, left stopped: the coordinator kills it after hb
  (hb + 2 s).
- ``stop_cont``: SIGSTOP of a random member, SIGCONT after 0.3 s to hb/2; no member should
  be lost (the delay + 2 s).
- ``term``: SIGTERM of a random member, a spot preemption notice (2 s).
- ``storm``: 2-5 ``tidal scale`` calls in quick succession within min..max (2 s).
- ``point``: SIGKILL, SIGSTOP or SIGTERM at an exact protocol point, armed while the job
  runs (``TIDAL_FAULTS=@FILE``): inside the all-reduce, before a step, after a
  generation's first step, at the join, the rendezvous, the connect (its address published,
  its peers connecting to it) or the heal (a scale up or down
  makes the membership change; the target is a survivor or the joiner), or inside a
  checkpoint write (2 s; SIGSTOP: hb + 2 s).
- ``joiner``: SIGKILL of a worker joining after a scale up, 0-1 s after its start (a forked
  joiner is a member ~0.5 s after it; 2 s).
- ``double``: two of kill/stop/term at once on two of at least 3 members, or one of them
  and a SIGKILL of the coordinator (the larger bound; +2 s with the coordinator).
- ``coordinator``: SIGKILL of the coordinator (``coordinator_pid``): back within 2 s with
  the same worker processes, which committed steps meanwhile (2 s).
- ``late``: SIGKILL of a member or of the coordinator 2-25 steps before the end (2 s), or
  of rank 0 inside the write of the job's final checkpoint: the job must then succeed with
  its final checkpoint, or fail saying it was not written.
- ``kill_all``: SIGKILL of every member at once: the job goes on from its newest verified
  checkpoint (``rules.every_member_lost``; the trial's ``--checkpoint-every`` keeps one), and
  must end equal to the reference; or fail saying every worker was lost (none written yet).

The bound applies to every generation the fault opened (``pause_s``: from the last step of
the previous generation to the first of the new one) and to the longest time the job
committed no new step while it recovered (the members' step logs). A joiner starts its
process and imports torch while the others train, so a join is bounded by 2 s too.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from bench.chaos.records import Event, TrialFailure
from bench.chaos.trial import SLOW_PACE_S, Trial, members

LOST_S = 2.0  # a member lost, a planned change, a join: what it may cost the others
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
POINT_PHASES = ("allreduce", "step", "first", "join", "rendezvous", "connect", "heal", "checkpoint")


def bounds(hb: float) -> dict[str, object]:
    """The stated bound of each kind, for the campaign's JSON."""
    return {
        "kill": LOST_S,
        "stop": hb + LOST_S,
        "stop_cont": f"SIGCONT delay (<= {hb / 2:g} s) + {LOST_S:g}",
        "term": LOST_S,
        "storm": LOST_S,
        "point": f"{LOST_S:g} (sigstop: {hb + LOST_S:g})",
        "joiner": LOST_S,
        "double": "the larger of its two",
        "coordinator": f"{LOST_S:g} (back within {LOST_S:g} s, no generation needed)",
        "kill_all": "none (it goes on from its checkpoint, or fails saying every worker was lost)",
        "late": LOST_S,
        "join": LOST_S,
    }


def _bound(kind: str, hb: float) -> float:
    return hb + LOST_S if kind == "stop" else LOST_S


def _pick(tr: Trial, s: dict) -> dict:
    return tr.rng.choice(members(s))


def kill(tr: Trial) -> Event | None:
    return _one(tr, "kill")


def stop(tr: Trial) -> Event | None:
    return _one(tr, "stop")


def term(tr: Trial) -> Event | None:
    return _one(tr, "term")


def _one(tr: Trial, kind: str) -> Event | None:
    s = tr.ensure_world(2)  # one member lost alone: the job's state goes with it
    if s is None:
        return None
    w = _pick(tr, s)
    t = time.time()
    if not tr.signal(w["pid"], SIGNALS[kind]):
        return None
    hb = tr.settings.heartbeat_timeout_s
    what = f"{SIGNALS[kind].name} worker {w['id']} (rank {w['rank']} of {len(members(s))})"
    return Event(kind, [what], 1, _bound(kind, hb), time=t)


def stop_cont(tr: Trial) -> Event | None:
    s = tr.watch.last
    w = _pick(tr, s)
    delay = tr.rng.uniform(0.3, tr.settings.heartbeat_timeout_s / 2)
    t = time.time()
    if not tr.signal(w["pid"], signal.SIGSTOP):
        return None
    tr.watch.idle(delay)
    tr.signal(w["pid"], signal.SIGCONT)
    what = f"SIGSTOP worker {w['id']} (rank {w['rank']}), SIGCONT after {delay:.2f} s"
    return Event("stop_cont", [what], 1, round(delay + LOST_S, 2), time=t)


def storm(tr: Trial) -> Event | None:
    sizes = [tr.rng.randint(tr.min_workers, tr.max_workers) for _ in range(tr.rng.randint(2, 5))]
    gaps = [tr.rng.uniform(0, 0.3) for _ in sizes]
    t = time.time()
    for n, gap in zip(sizes, gaps, strict=True):
        tr.scale(n)
        time.sleep(gap)
    return Event("storm", [f"tidal scale {' '.join(map(str, sizes))}"], 1, LOST_S, time=t)


def point(tr: Trial) -> Event | None:
    s = tr.ensure_world(2)
    if s is None:
        return None
    rng = tr.rng
    sig = rng.choices(["sigkill", "sigstop", "sigterm"], weights=[5, 3, 2])[0]
    phase = rng.choice(POINT_PHASES)
    ms = members(s)
    resize = None
    if phase in ("allreduce", "step"):
        target = rng.choice(ms)["id"]
    elif phase == "checkpoint":
        target = ms[0]["id"]  # rank 0 writes
    elif s["target_workers"] < tr.max_workers:  # a scale up: a survivor or the joiner
        resize = s["target_workers"] + 1  # a replacement may still be starting (overlap)
        joiner = max(w["id"] for w in s["workers"]) + 1
        target = rng.choice([joiner, rng.choice(ms)["id"]])
    else:  # a scale down: rank 0 survives it
        resize, target = s["target_workers"] - 1, ms[0]["id"]
    spec = f"{sig}@worker={target},phase={phase},id={tr.seed}-{len(s['generations'])}-{s['step']}"
    tr.arm(spec)
    if resize is not None:
        tr.scale(resize)
    fired = tr.wait_fired(spec, timeout=45)
    tr.arm("")
    if fired is None:
        return None
    what = spec + (f" (after tidal scale {resize})" if resize else "")
    hb = tr.settings.heartbeat_timeout_s
    return Event("point", [what], 1, hb + LOST_S if sig == "sigstop" else LOST_S, time=fired)


def joiner(tr: Trial) -> Event | None:
    s = tr.watch.last
    n = s["target_workers"]  # not the members: a replacement may be starting (overlap)
    if n >= tr.max_workers:
        return None
    before = max(w["id"] for w in s["workers"])
    # A forked joiner is a member ~0.5 s after its start: the kill lands within a second of
    # it, inside its join or just after it.
    delay = tr.rng.uniform(0, 1)
    tr.scale(n + 1)
    # The joiner: a fresh worker (already a member if its join was quicker than this poll),
    # or one still starting from an earlier scale-up that a scale-down left running (the
    # coordinator keeps it as the spare the new target needs).
    s = tr.watch.until(
        lambda s: _joiners(s) + _started_after(s, before),
        30,
        f"a worker starting to join after tidal scale {n + 1}",
    )
    tr.watch.idle(delay)
    ids = {w["id"] for w in _joiners(s) + _started_after(s, before)}
    w = max((w for w in tr.watch.last["workers"] if w["id"] in ids), key=lambda w: w["id"])
    wid = w["id"]
    t = time.time()
    if not tr.signal(w["pid"], signal.SIGKILL):
        return None
    what = f"SIGKILL worker {wid} joining ({delay:.1f} s after its start, state {w['state']})"
    return Event("joiner", [what], 1, LOST_S, time=t)


def _started_after(s: dict, before: int) -> list[dict]:
    """Live workers with a process whose id is above ``before`` (started since)."""
    live = ("starting", "standby", "running")
    return [w for w in s["workers"] if w["id"] > before and w["pid"] and w["state"] in live]


def _joiners(s: dict) -> list[dict]:
    """Live workers with a process that are not members of the newest generation."""
    inside = {w["id"] for w in members(s)}
    live = ("starting", "standby", "running")
    return [w for w in s["workers"] if w["pid"] and w["state"] in live and w["id"] not in inside]


def double(tr: Trial) -> Event | None:
    """Two faults at once: two of kill/stop/term on two members, or (one time in three,
    where status names the coordinator) one of them and a SIGKILL of the coordinator."""
    s = tr.ensure_world(3)
    if s is None:
        return None
    hb = tr.settings.heartbeat_timeout_s
    coord = s.get("coordinator_pid") if tr.rng.random() < 1 / 3 else None
    pair = tr.rng.sample(members(s), 1 if coord else 2)
    kinds = [tr.rng.choice(list(SIGNALS)) for _ in pair]
    t = time.time()
    sent = [tr.signal(w["pid"], SIGNALS[k]) for w, k in zip(pair, kinds, strict=True)]
    what = [
        f"{SIGNALS[k].name} worker {w['id']} (rank {w['rank']})"
        for w, k, ok in zip(pair, kinds, sent, strict=True)
        if ok
    ]
    bound = max(_bound(k, hb) for k in kinds)
    if coord and tr.signal(coord, signal.SIGKILL):
        what.append(f"SIGKILL coordinator (pid {coord})")
        bound += LOST_S  # the membership change waits for the coordinator's return
    if len(what) < 2:
        return Event("double", what, len(what), bound, time=t) if what else None
    return Event("double", what, 2, bound, time=t)


def kill_all(tr: Trial) -> Event | None:
    ms = members(tr.watch.last)
    t = time.time()
    for w in ms:
        tr.signal(w["pid"], signal.SIGKILL)
    what = [f"SIGKILL every member: workers {[w['id'] for w in ms]}"]
    return Event("kill_all", what, 1, 60.0, time=t, may_fail="every worker was lost", final=True)


def late(tr: Trial) -> Event | None:
    """In the job's last steps: SIGKILL of a member or of the coordinator 2-25 steps before
    the end (the job runs free to near its end, then at ``SLOW_PACE_S`` a step), or of
    rank 0 inside the write of the job's final checkpoint."""
    s = tr.ensure_world(2)
    if s is None:
        return None
    left = tr.rng.randint(2, 25)
    target = tr.rng.choice(["member", "coordinator", "final checkpoint"])
    end = tr.settings.max_steps
    if target == "final checkpoint":
        spec = f"sigkill@worker={members(s)[0]['id']},phase=checkpoint,step={end},id=late"
        tr.arm(spec)
        tr.set_pace(0.0)
        fired = tr.wait_fired(spec, timeout=120)
        if fired is None:
            return None
        # Its writer lost, the final checkpoint is missing: the job fails saying so (0e4f711).
        return Event("late", [spec], 1, LOST_S, time=fired, may_fail="was not written", final=True)
    tr.set_pace(0.0)
    tr.until_committed(end - 80)
    tr.set_pace(SLOW_PACE_S)
    tr.until_committed(end - left)
    s = tr.watch.poll()
    pid = s.get("coordinator_pid") if target == "coordinator" else tr.rng.choice(members(s))["pid"]
    t = time.time()
    if not tr.signal(pid, signal.SIGKILL):
        return None
    what = f"SIGKILL {target} (pid {pid}) {left} steps before the end"
    return Event("late", [what], 1, LOST_S, time=t, final=True)


def coordinator(tr: Trial) -> Event | None:
    s = tr.watch.last
    pid = s.get("coordinator_pid")
    if not pid:
        return None
    before = {w["id"]: w["pid"] for w in members(s)}
    step = s["step"]
    t = time.time()
    if not tr.signal(pid, signal.SIGKILL):
        return None
    s = tr.watch.until(
        lambda s: s.get("coordinator_pid") not in (None, pid) and s["state"] == "running",
        tr.settings.recovery_timeout_s,
        "new coordinator",
    )
    back = time.time() - t
    event = Event("coordinator", [f"SIGKILL coordinator (pid {pid})"], 1, LOST_S, time=t)
    event.notes.append(f"back after {back:.2f} s at step {s['step']} (killed at {step})")
    if back > LOST_S:
        raise TrialFailure("pause", f"the coordinator came back after {back:.2f} s > {LOST_S} s")
    after = {w["id"]: w["pid"] for w in members(s)}
    if any(after.get(i) != p for i, p in before.items()):
        raise TrialFailure("recovery", f"workers {before} before the restart, {after} after")
    trained = tr.commits_between(t + 0.1, t + back)
    event.notes.append(f"{trained} steps committed while it was down")
    if back > 0.5 and trained == 0:
        raise TrialFailure("recovery", f"no step committed in the {back:.2f} s outage")
    return event


KINDS: dict[str, Callable[[Trial], Event | None]] = {
    "kill": kill,
    "stop": stop,
    "stop_cont": stop_cont,
    "term": term,
    "storm": storm,
    "point": point,
    "joiner": joiner,
    "double": double,
    "coordinator": coordinator,
    "kill_all": kill_all,
    "late": late,
}
WEIGHTS = {
    "kill": 3,
    "stop": 1.5,
    "stop_cont": 1,
    "term": 1.5,
    "storm": 1.5,
    "point": 5,
    "joiner": 1,
    "double": 1.5,
    "coordinator": 1.5,
    "kill_all": 0.25,
    "late": 0.5,
}
FINAL = ("kill_all", "late")  # only as a trial's last fault
# ``coordinator`` needs ``coordinator_pid`` in ``tidal status --json`` (coordinator crash
# survival): on by default, it is not applicable (and not counted) where status lacks it.
