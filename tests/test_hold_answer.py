"""A scheduled change costs its members one round trip to the coordinator, not two: the
answer that releases a hold is the one ``Membership.join`` forms the next generation from
(``join(answer=...)``), with no ``fetch`` after it.

A real job (``examples/digits.py`` under ``tidal run --schedule``); a ``sitecustomize`` of
this test's own, on the workers' ``PYTHONPATH``, wraps ``Agent.fetch`` and ``Agent._beat``
(every heartbeat the training loop sends or has sent) to append one line per call to a file,
naming the thread that sent it (the library reads nothing of it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import Home, call_log, relative_l2, summarize


def run_scheduled(home: Home, name: str, opts: tuple[str, ...], script_args: list[str], sizes):
    """Run ``examples/digits.py`` under ``tidal run`` with ``opts``; assert it succeeded with
    generations of ``sizes`` ((world size, start step), in order); return its status."""
    proc, job = home.run(name, *opts, script_args=script_args, timeout=140)
    status = job.status()
    assert proc.returncode == 0, summarize(status)
    gens = status["generations"]
    assert [(g["world_size"], g["start_step"]) for g in gens] == sizes, summarize(status)
    return status


SITE = """
import os, threading
from tidal.worker.agent import client as _agent

# Once per process (the zygote's interpreter may run this again: then it is wrapped already).
if os.environ.get("HOLD_ANSWER_LOG") and not hasattr(_agent.Agent.fetch, "logged"):
    def _logged(name, fn):
        def call(self, *args, **kwargs):
            resp = fn(self, *args, **kwargs)
            holding = kwargs.get("holding", False)
            approaching = kwargs.get("approaching", False)
            step = kwargs.get("step", self.step)
            with open(os.environ["HOLD_ANSWER_LOG"], "a") as f:
                f.write(
                    f"{name} {self.worker_id} {self.generation} {step} {holding:d} "
                    f"{threading.current_thread().name} {approaching:d}\\n"
                )
            return resp
        call.logged = True
        return call

    _agent.Agent.fetch = _logged("fetch", _agent.Agent.fetch)
    _agent.Agent._beat = _logged("beat", _agent.Agent._beat)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_held_member_forms_the_next_generation_from_the_hold_answer(
    tidal_home: Home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = call_log(tmp_path, monkeypatch, SITE, "HOLD_ANSWER_LOG")
    status = run_scheduled(
        tidal_home,
        "held",
        ("--workers", "2", "--max-workers", "3", "--schedule", "30:3,60:2"),
        ["--max-steps", "90"],
        [(2, 0), (3, 30), (2, 60)],
    )
    gens = status["generations"]
    calls = [line.split() for line in log.read_text().splitlines()]
    # fetch/beat, worker, generation, step, holding, thread, approaching
    for before, after in zip(gens, gens[1:], strict=False):
        at, gen = after["start_step"], before["id"]
        # Every member told the coordinator as it reached the step before the change (an
        # approaching heartbeat, from the same thread), so the change was applied a step
        # ahead (``scale_rules.schedule_ahead``) ...
        approached = {
            int(c[1]) for c in calls if c[0] == "beat" and c[3] == str(at - 1) and c[6] == "1"
        }
        assert approached == set(before["members"]), (at, approached, calls)
        holds = [c for c in calls if c[0] == "beat" and c[3:5] == [str(at), "1"]]
        held = {int(c[1]) for c in holds}
        stay = set(before["members"]) & set(after["members"])
        # ... every member of the generation before the change that stays in the next held at
        # its step (a leaver that knew it leaves went before its update, ``leaving``) ...
        assert stay <= held <= set(before["members"]), (at, held, calls)
        # ... its first holding heartbeat sent as it committed the step, during the update,
        # from the thread ``Agent.beat_soon`` starts (not after it, from the training loop)
        for wid in held:
            first = next(c for c in holds if int(c[1]) == wid)
            assert first[5] == "tidal-hold", (at, first, calls)
        # ... and those that stay asked nothing more before forming the next generation
        # (a fetch while still in the old one at that step is the round trip saved; a
        # leaver, told to stand by, waits asking).
        again = [
            c
            for c in calls
            if c[0] == "fetch" and int(c[1]) in stay and c[2:4] == [str(gen), str(at)]
        ]
        assert not again, (at, again)


SLOW_BEATS = """
import os
from tidal.worker.agent import client as _agent

# The heartbeat thread's own beats a minute apart (the test's fault: nothing but an explicit
# send then carries the outbox); once per process, as above.
if os.environ.get("SLOW_BEATS") and not hasattr(_agent.Agent._register, "slowed"):
    _register = _agent.Agent._register

    def _slow(self, *args, **kwargs):
        resp = _register(self, *args, **kwargs)
        self._interval = 60.0
        return resp

    _slow.slowed = True
    _agent.Agent._register = _slow
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_change_at_the_step_after_a_change_does_not_wait_for_a_heartbeat(
    tidal_home: Home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation's first step's report waits in the outbox for the next commit
    (``PauseClock.send_report``), but the coordinator admits a joiner only once that report
    says the generation formed: a member holding at the very next step sends it first.
    With the heartbeat thread's own beats a minute apart (this test's ``sitecustomize``), a
    report left for the next beat would hold the change at step 11 back by up to a minute
    (the hold at 11 cannot be settled before generation (2, 10) formed)."""
    call_log(tmp_path, monkeypatch, SLOW_BEATS, "SLOW_BEATS")
    opts = ("--workers", "1", "--max-workers", "3", "--schedule", "10:2,11:3")
    opts += ("--heartbeat-timeout", "100", "--collective-timeout", "200", "--orphan-timeout", "300")
    status = run_scheduled(
        tidal_home, "consecutive", opts, ["--max-steps", "20"], [(1, 0), (2, 10), (3, 11)]
    )
    gens = status["generations"]
    # The pause of the change at 11 (its members' gap between steps 10 and 11): a hang
    # detector, a sixth of the beats' interval; such a change takes milliseconds.
    assert gens[2]["pause_s"] is not None and gens[2]["pause_s"] < 10.0, gens


LEAVER_WAITS = """
import os, time
from tidal.worker.trainer import membership as _membership

# A member at the step before a scheduled one first waits (up to 10 s) for an answer naming
# a newer generation than its own, as it would on a machine whose steps are longer than a
# round trip (a digits step takes a millisecond); then the library decides, logged. Once
# per process, as above.
if os.environ.get("LEAVER_LOG") and not hasattr(_membership.Membership.leaves_uncommitted, "w"):
    _decide = _membership.Membership.leaves_uncommitted

    def _waited(self, step, max_steps):
        seen = "-"
        link = self.parts.link
        if step in link.cfg.hold_steps and step < max_steps:
            seen, deadline = "timeout", time.monotonic() + 10.0
            while time.monotonic() < deadline:
                latest = link.agent.latest()
                if latest is not None and (
                    latest.generation is None or latest.generation.id > self.generation
                ):
                    seen = "seen"
                    break
                time.sleep(0.001)
        why = _decide(self, step, max_steps)
        if step in link.cfg.hold_steps:
            with open(os.environ["LEAVER_LOG"], "a") as f:
                f.write(f"{link.worker_id} {step} {'leave' if why else 'commit'} {seen}\\n")
        return why

    _waited.w = True
    _membership.Membership.leaves_uncommitted = _waited

    # Every member that finishes the job writes its parameters (the script saves rank 0's).
    from safetensors.torch import save_file
    from tidal.worker.trainer import runtime as _runtime

    _run = _runtime.Trainer.run

    def _run_and_save(self, max_steps):
        yield from _run(self, max_steps)
        if self.completed and self.worker_id is not None:  # not the reference run
            state = {k: v.contiguous() for k, v in self.module.state_dict().items()}
            folder = os.path.dirname(os.environ["LEAVER_LOG"])
            save_file(state, os.path.join(folder, f"member-{self.worker_id}.safetensors"))

    _runtime.Trainer.run = _run_and_save
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_leaver_that_knows_it_leaves_skips_its_last_update(
    tidal_home: Home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference_params
) -> None:
    """At a scheduled scale-down the member that leaves learns it while it runs the step
    before (the change applied a step ahead), and leaves with that step uncommitted
    (``worker.leaving``): the members that stay commit it and train on, equal in float64
    to one worker; the leaver's update was never needed."""
    log = call_log(tmp_path, monkeypatch, LEAVER_WAITS, "LEAVER_LOG")
    out = tmp_path / "final.safetensors"
    args = ["--max-steps", "90", "--double", "--save", str(out)]
    status = run_scheduled(
        tidal_home,
        "leaver",
        ("--workers", "2", "--max-workers", "3", "--schedule", "30:3,60:2"),
        args,
        [(2, 0), (3, 30), (2, 60)],
    )
    gens = status["generations"]
    said = {
        (int(w), int(step), what, seen)
        for w, step, what, seen in map(str.split, log.read_text().splitlines())
    }
    leaver = set(gens[1]["members"]) - set(gens[2]["members"])
    # ... and the job's events say so, once per leaver (``protocol.Departure``)
    left = [e["message"] for e in status["events"] if e["kind"] == "leave"]
    assert [m.split()[1] for m in left] == [str(w) for w in sorted(leaver)], left
    assert all("before the update of step 59 of generation 2" in m for m in left), left
    # Every member saw the next generation before its update of the step before the change,
    # without holding there first (no heartbeat said the step itself yet): the change was
    # applied a step ahead. The leaver then left without that update; the others made it.
    expect = {(w, 30, "commit", "seen") for w in gens[0]["members"]}
    expect |= {(w, 60, "leave", "seen") for w in leaver}
    expect |= {(w, 60, "commit", "seen") for w in gens[2]["members"]}
    assert said == expect, said
    reference = reference_params(90, 0, double=True)
    members = sorted(tmp_path.glob("member-*.safetensors"))
    assert [m.name for m in members] == [
        f"member-{w}.safetensors" for w in sorted(gens[2]["members"])
    ]
    for path in [out, *members]:
        rel = relative_l2(path, reference)
        assert rel <= 1e-12, f"{path.name} differs from the 1-worker run: relative L2 {rel:.3e}"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_members_held_at_a_scheduled_step_go_to_a_newer_generation_that_needs_them(
    tidal_home: Home, tmp_path: Path
) -> None:
    """A member SIGKILLed at step 15 of a 2-worker job scheduled to 3 at step 20: the lone
    survivor holds at step 20 while its replacement's generation (2 members, opened with the
    warm spare) waits for it to form, and the third worker waits for that generation to
    form. The hold is released into it at once (``scale_rules.schedule_settled``); before, the
    three waited for each other until the 120 s start timeout.

    Which two of the three workers form generation 1 is a race (the spare is whichever is
    ready last), so the members hold at step 14 and the test names the one to kill once it
    knows them."""
    faults = tmp_path / "faults"
    holds = ";".join(f"hold@worker={w},step=14,gen=1" for w in range(3))
    faults.write_text(holds)
    job = tidal_home.start(
        "deadlock",
        "--workers",
        "2",
        "--max-workers",
        "3",
        "--schedule",
        "20:3",
        script_args=["--max-steps", "40"],
        faults=f"@{faults}",
    )
    try:
        job.wait_for(lambda _s: Path(f"{faults}.held").exists(), 90, "a member held at 14")
        first = job.poll()["generations"][0]
        victim = first["members"][0]
        faults.write_text(f"{holds};sigkill@worker={victim},step=15,phase=allreduce")
    finally:
        Path(f"{faults}.release").touch()
    status = job.wait_state("succeeded", "failed", "stopped", "interrupted", timeout=120)
    assert status["state"] == "succeeded", summarize(status)
    gens = [g for g in status["generations"] if g["start_step"] is not None]
    # the case arose: the survivor alone from step 15, then with its replacement from 20
    sizes = [(g["world_size"], g["start_step"]) for g in gens]
    assert (1, 15) in sizes and (2, 20) in sizes, summarize(status)
    assert victim not in gens[1]["members"], summarize(status)
    assert max(g["pause_s"] or 0.0 for g in gens) < 10, summarize(status)
