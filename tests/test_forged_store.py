"""An outsider who reaches the rendezvous store cannot make a member act on a value it
wrote (``tidal.store_auth``): real ``tidal run`` jobs, an intruder's raw ``TCPStore`` client
beside them that finds every key with ``list_keys``.

The deterministic case: the joiner of generation 2 holds right after it published its
gloo address (a ``hold`` fault at ``phase=connect``, released by the test), and the
intruder overwrites every connection key of generation 2 it finds, each with a value it
read from the store (generation 1's address of the same rank: a well-formed address with a
valid tag, of another key). The joiner reads its own key back when it connects, so at
least one member reads a forged key before anyone could fix it: not a race. The job must
say so (a ``security`` event naming a forged key), never form generation 2, re-form, and
end equal to an uninterrupted one-worker run (float64, ``examples/digits.py --double``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist
from e2e_helpers import Home, event_messages, relative_l2, store_port, summarize

STEPS = 60
EXACT = 1e-12  # float64, another micro-batch split (DESIGN.md section 4)


def _wait_file(path: Path, job, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = job.poll()["state"]
        assert state in ("pending", "running"), f"the job ended first\n{job.logs_tail()}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout:.0f} s"
        time.sleep(0.02)


def _forge_connection_keys(host: str, port: int, gen: int) -> dict[str, bytes]:
    """Overwrite generation ``gen``'s gloo address keys as an outsider; returns them."""
    intruder = dist.TCPStore(host, port, is_master=False, wait_for_workers=False)
    keys = intruder.list_keys()
    older = {k.rsplit("/", 1)[1]: k for k in keys if f"/gen{gen - 1}/pg/" in k}
    forged = {}
    for key in (k for k in keys if f"/gen{gen}/pg/" in k):
        rank = key.rsplit("/", 1)[1]
        value = intruder.get(older[rank]) if rank in older else b"\x7f" * 64
        intruder.set(key, value)
        forged[key] = value
    return forged


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forged_next_generation_connection_key_is_refused_loudly(
    tidal_home: Home, tmp_path: Path, reference_params
) -> None:
    faults = tmp_path / "faults"
    # Whichever worker joins generation 2 without state (``step=0``) holds once it published.
    faults.write_text(";".join(f"hold@worker={w},phase=connect,gen=2,step=0" for w in range(3)))
    out = tmp_path / "forged.safetensors"
    job = tidal_home.start(
        "forged-conn",
        "--workers",
        "2",
        "--max-workers",
        "3",
        "--schedule",
        "20:3",
        script_args=["--max-steps", str(STEPS), "--double", "--save", str(out)],
        faults=f"@{faults}",
    )
    try:
        _wait_file(Path(f"{faults}.held"), job, timeout=150)
        host = job.coordinator_info()["url"].removeprefix("http://").rsplit(":", 1)[0]
        forged = _forge_connection_keys(host, store_port(job), gen=2)
    finally:
        Path(f"{faults}.release").touch()
    assert forged, "the joiner's own address was not in the store"
    job.wait_state("succeeded", "failed", "stopped", timeout=200)
    status = job.status()

    refusals = event_messages(status, "security")
    named = [m for m in refusals if any(repr(k) in m for k in forged)]
    assert named, f"no security event names a forged key {sorted(forged)}\n{summarize(status)}"
    assert all("refused" in m for m in refusals), refusals
    gens = {g["id"]: g for g in status["generations"]}
    assert gens[2]["start_step"] is None, f"generation 2 trained\n{summarize(status)}"
    assert status["state"] == "succeeded" and status["step"] == STEPS, summarize(status)
    later = [g for g in status["generations"] if g["id"] > 2 and g["start_step"] is not None]
    assert later and later[-1]["world_size"] == 3, summarize(status)
    rel = relative_l2(out, reference_params(STEPS, 0, double=True))
    assert rel <= EXACT, f"parameters differ from the 1-worker run: relative L2 {rel:.3e}"


def _race(host: str, port: int, stop, counts: dict[str, int]) -> None:
    """An outsider overwriting, as fast as it can, every key it finds and the same keys of
    the next two generations, each with the value of another key it read (well-formed,
    validly tagged for that other key) or, where there is none, noise."""
    import re

    intruder = dist.TCPStore(host, port, is_master=False, wait_for_workers=False)
    while not stop.is_set():
        try:
            keys = intruder.list_keys()
            values = {k: intruder.get(k) for k in keys[:50]}
            donors = list(values.values()) or [b"\x7f" * 64]
            for i, key in enumerate(keys):
                gen = re.search(r"/gen(\d+)/", key)
                targets = [key]
                if gen:
                    n = int(gen[1])
                    targets += [key.replace(f"/gen{n}/", f"/gen{n + d}/") for d in (1, 2)]
                for target in targets:
                    intruder.set(target, donors[(i + 1) % len(donors)])
                    counts["writes"] += 1
            time.sleep(0.005)  # a round every few ms: the members still get the cores
        except Exception:  # noqa: BLE001 - the store went away with the job, or a key with it
            counts["errors"] += 1
            time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forger_racing_the_members_changes_nothing_silently(
    tidal_home: Home, tmp_path: Path, reference_params
) -> None:
    """An outsider overwrites every key of a live job's store in a loop through a 2 -> 3 ->
    2 change (and a failure it causes, if any). Whatever it wins, nothing changes silently:
    a job that succeeds ends equal to the one-worker run (float64), and every refusal is a
    ``security`` event; a job it stops fails with such an event, never with a wrong
    result."""
    import threading

    out = tmp_path / "raced.safetensors"
    job = tidal_home.start(
        "raced",
        "--workers",
        "2",
        "--max-workers",
        "3",
        "--schedule",
        "20:3,40:2",
        "--start-timeout",
        "30",  # a forger that denies the first generation for good: a failure within 30 s
        script_args=["--max-steps", str(STEPS), "--double", "--save", str(out)],
    )
    stop, counts = threading.Event(), {"writes": 0, "errors": 0}
    while job.coordinator_info() is None or not job.coordinator_info().get("url"):
        time.sleep(0.02)
    host = job.coordinator_info()["url"].removeprefix("http://").rsplit(":", 1)[0]
    racer = threading.Thread(target=_race, args=(host, store_port(job), stop, counts))
    racer.start()
    try:
        job.wait_state("succeeded", "failed", "stopped", timeout=240)
    finally:
        stop.set()
        racer.join(30)
    status = job.status()
    assert counts["writes"] > 1000, counts  # it raced the whole job, not a moment of it
    refusals = event_messages(status, "security")
    assert all("refused" in m for m in refusals), refusals
    if status["state"] == "succeeded":
        rel = relative_l2(out, reference_params(STEPS, 0, double=True))
        assert rel <= EXACT, f"parameters differ from the 1-worker run: relative L2 {rel:.3e}"
    else:  # denied service: loudly
        assert refusals, f"the job {status['state']} with no security event\n{summarize(status)}"
