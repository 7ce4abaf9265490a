"""What authenticating the rendezvous store (``tidal.store_auth``) costs a re-form, and what
it costs a step.

Two processes re-form a 2-member generation ``generations`` times in a row through the
worker's own code (``group.rendezvous``, ``publish_step``, ``form_group`` over gloo,
``member_steps``, then ``destroy_group``), alternating between an ``AuthStore`` over the
``TCPStore`` client (Tidal) and the bare client (the peer: the same path, unauthenticated),
so drift on a loaded machine falls on both alike. Rank 0 holds the store and plays the
coordinator: it opens each generation once the previous one formed, through the same kind
of store. Each member times its re-form from its arrival to its peers' steps read; the row is the
median over generations of the slower member's time (the first two of each kind are
warm-up). Each member also counts the values it sealed and checked per re-form, and, after
the re-forms, over ``steps`` all-reduce steps with the store idle: none (the steady state
reads nothing from the store; rank 0's change-notice thread waits on a key's existence and
reads a counter, neither authenticated).

``python -m bench.store_auth [--generations N] [--json FILE]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import Procs, free_port, log

KEY = "ab" * 32  # any 64-hex key: the cost does not depend on it


def _counted() -> dict[str, int]:
    """Count every value sealed or checked in this process (``store_auth``'s functions)."""
    from tidal import store_auth

    counts = {"sealed": 0, "checked": 0}
    seal, unseal = store_auth.seal, store_auth.unseal

    def counting_seal(*a):
        counts["sealed"] += 1
        return seal(*a)

    def counting_unseal(*a):
        counts["checked"] += 1
        return unseal(*a)

    store_auth.seal, store_auth.unseal = counting_seal, counting_unseal
    return counts


def _both_done(store, key: str) -> None:
    store.add(key, 1)
    while store.add(key, 0) < 2:
        time.sleep(0.0005)


def member(rank: int, port: int, generations: int, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from tidal.protocol import GenerationInfo
    from tidal.store_auth import AuthStore
    from tidal.store_keys import GEN_OPEN, state_key
    from tidal.worker.membership import group as grp

    torch.set_num_threads(1)
    counts = _counted()
    timeout = datetime.timedelta(seconds=60)
    raw = dist.TCPStore(
        "127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timeout
    )
    auth = AuthStore(raw, KEY)

    def store_of(g: int) -> dist.Store:
        return auth if g % 2 else raw

    if rank == 0:  # rank 0 also plays the coordinator: it opens each generation
        store_of(1).set(state_key("ns/gen1"), GEN_OPEN)
    times: dict[str, list[float]] = {"auth": [], "raw": []}
    per_reform: list[int] = []
    for g in range(1, generations + 1):
        kind, store = "auth" if g % 2 else "raw", store_of(g)
        info = GenerationInfo(id=g, members=[0, 1], store_prefix=f"ns/gen{g}", reason="bench")
        before = counts["sealed"] + counts["checked"]
        t0 = time.perf_counter()
        assert grp.rendezvous(store, info, timeout_s=60) == grp.Arrival.FORMED
        grp.publish_step(store, info, rank, 10)
        grp.form_group(store, info, rank, namespace="ns", timeout_s=60, connect_s=5)
        grp.member_steps(store, info, none=-1)
        times[kind].append(time.perf_counter() - t0)
        if kind == "auth":
            per_reform.append(counts["sealed"] + counts["checked"] - before)
        dist.all_reduce(torch.ones(1))  # the group works
        if rank == 0 and g < generations:  # after the forming: it would abandon it
            store_of(g + 1).set(state_key(f"ns/gen{g + 1}"), GEN_OPEN)
        _both_done(raw, f"done/{g}")  # neither tears down a group its peer still uses
        if g < generations:
            grp.destroy_group()
    before = counts["sealed"] + counts["checked"]
    t = torch.ones(1024)
    for _ in range(steps):  # the steady state: collectives only
        dist.all_reduce(t)
    steady = counts["sealed"] + counts["checked"] - before
    _both_done(raw, "done/steady")
    grp.destroy_group()
    out.write_text(json.dumps({"times": times, "per_reform": per_reform, "steady": steady}))


def measure(tmp: Path, *, generations: int = 40, steps: int = 200) -> dict:
    port = free_port()
    procs = Procs()
    outs = [tmp / f"store-auth-{r}.json" for r in (0, 1)]
    py = [sys.executable, "-m", "bench.store_auth"]
    try:
        members = [
            procs.start(
                py
                + [
                    "--member",
                    str(r),
                    str(port),
                    "--generations",
                    str(generations),
                    "--steps",
                    str(steps),
                    "--out",
                    str(outs[r]),
                ],
                tmp / f"store-auth-{r}.log",
            )  # fmt: skip
            for r in (0, 1)
        ]
        for r, p in enumerate(members):
            if p.wait(timeout=600) != 0:
                tails = [(tmp / f"store-auth-{i}.log").read_text(errors="replace")[-1500:]
                         for i in (0, 1)]  # fmt: skip
                raise RuntimeError(f"member {r} failed:\n" + "\n---\n".join(tails))
    finally:
        procs.cleanup()
    res = [json.loads(o.read_text()) for o in outs]
    slower = {
        kind: [max(a, b) for a, b in zip(*(r["times"][kind] for r in res), strict=True)][2:]
        for kind in ("auth", "raw")
    }
    return {
        "auth_s": statistics.median(slower["auth"]),
        "raw_s": statistics.median(slower["raw"]),
        "values_per_reform": max(max(r["per_reform"]) for r in res),
        "values_per_step": max(r["steady"] for r in res) / steps,
        "generations": generations,
        "config": f"2 processes, gloo, {generations} re-forms alternating; the same re-form "
        "(rendezvous, step, gloo group, peers' steps) over the bare TCPStore client",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generations", type=int, default=40)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", type=Path)
    p.add_argument("--member", nargs=2, type=int, metavar=("RANK", "PORT"))
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.member is not None:
        return member(a.member[0], a.member[1], a.generations, a.steps, a.out)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = measure(Path(tmp), generations=a.generations, steps=a.steps)
    log(json.dumps(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
