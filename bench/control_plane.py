"""Control-plane capacity: N simulated workers heartbeating against one real coordinator.

``python -m bench.control_plane [--workers 256,1024] [--window-s 20] [--json FILE]``
(or ``python -m bench --only control_plane``).

The coordinator is the real one (``tidal.host.runner.run_job``: the ``Coordinator``,
its FastAPI/uvicorn server, the control loop every 20 ms, the dashboard's history recorder
writing to SQLite) in its own process, with one difference: its backend starts no
processes (``NullBackend``: a worker "runs" from ``start`` until it is signalled), so the
N workers are simulated by ``bench.control_plane_load`` in another process, over the real
HTTP API with their own credentials, at the real heartbeat interval (``JobSpec``'s default,
handed to workers at registration) and with the agent's heartbeat bodies. The coordinator
forms one generation of all N; the window is measured once every worker is its member.

Measured in the window: heartbeat latency (request sent to answer read, in the generator)
p50/p99/max, heartbeats per second, the coordinator process's CPU share (``/proc/PID/stat``,
all its threads; fraction of one core), the generator's own CPU share, and the latency of a
trivial page of the same server (``GET /docs``) under the same load. After the window, the
idle floor: one worker heartbeating alone (the same request, the same N-member answer).

With at least two CPUs the coordinator is pinned to CPU 0 ("one core") and the generator to
the others, so they do not compete for the same core; other processes on the machine still
can. Rows (``ratio`` > 1 when Tidal is better, as every bench row):

- ``control_plane_N``: heartbeat p99 at N workers (ms); peer: the idle floor's p99 measured
  in the same run (ms); ratio = floor / loaded (1.0: load adds no latency);
- ``control_plane_N_cpu``: the cores the coordinator needs to answer every heartbeat at the
  offered rate (``cores_needed``: its CPU per heartbeat answered in the window, times N /
  the heartbeat interval); no peer (``peer_name`` "none"): the goal is a budget of one
  core, not a measurement of anything else (docs/decisions/bench-peers.md). The measured
  CPU share is in the details.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Procs, log, wait_until
from bench.rows import failed, row
from tidal.backends.base import Backend

JOB = "capacity"
FLOOR_CONFIG = (
    "the same coordinator after the window, one worker heartbeating alone (the same request, "
    "the same N-member answer): its p99"
)
NO_CPU_PEER = (
    "none: the goal is a budget (one core answers every heartbeat at the offered rate); "
    "no other coordinator or floor is measured for CPU"
)
SIZES = (256, 1024)  # simulated workers


class NullBackend(Backend):
    """A backend whose workers are simulated elsewhere: ``start`` launches nothing; a worker
    counts as running until it is signalled (then it exits with that signal), and as alive
    until that exit is polled (``Backend.alive``). What it does not override is the base
    class's (no zygote, no exit descriptors)."""

    host = "127.0.0.1"
    max_starting = 1 << 20  # every worker "starts" at once

    def __init__(self, **_: object) -> None:
        self._alive: set[int] = set()
        self._exits: list = []

    @classmethod
    def check_capacity(cls, spec: object) -> None:
        return None

    def start(self, worker_id: int, env: dict[str, str]) -> int | None:
        self._alive.add(worker_id)
        return None

    def poll(self) -> list:
        from tidal.backends import Exit

        exits, self._exits = self._exits, []
        return [Exit(worker_id=w, returncode=-sig) for w, sig in exits]

    def signal(self, worker_id: int, sig: int) -> None:
        if worker_id in self._alive:
            self._alive.discard(worker_id)
            self._exits.append((worker_id, int(sig)))

    def alive(self) -> list[int]:
        return sorted(self._alive | {w for w, _ in self._exits})

    def waiting(self) -> set[int]:
        return set()

    def node(self, worker_id: int) -> str | None:
        return "simulated"


def host_main(home: str, n: int, cpus: str | None) -> int:
    """The coordinator process: ``run_job`` of an N-worker job on the null backend."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    from tidal.backends.base import register_backend
    from tidal.config import JobSpec
    from tidal.host.runner import run_job

    register_backend("bench-null", NullBackend)
    spec = JobSpec(
        name=JOB,
        script=str(Path(home) / "simulated.py"),
        workers=n,
        min_workers=1,
        max_workers=n,
        backend="bench-null",
        start_timeout_s=3600.0,
    )
    return run_job(spec, Path(home), quiet=True)


def load_args(
    url: str,
    token: str,
    n: int,
    pid: int,
    out: Path,
    window_s: float,
    warmup_s: float,
    cpus: str | None,
) -> list[str]:
    """The load generator's arguments (``control_plane_load.parse_args``): the options
    first, the positionals after ``--``, since a token may begin with ``-``
    (``token_urlsafe``), which argparse takes for an option (run Z2, 2026-12-04: the
    generator exited 2)."""
    opts = ["--window-s", str(window_s), "--warmup-s", str(warmup_s)]
    opts += ["--cpus", cpus] if cpus else []
    return [*opts, "--", url, token, str(n), str(pid), str(out)]


def measure(
    n: int,
    tmp: Path,
    *,
    window_s: float = 20.0,
    warmup_s: float = 3.0,
    pin: bool = True,
) -> dict:
    """One coordinator, N simulated workers; the generator's result (see the module doc)."""
    from tidal.coordinator.records.home import job_dir

    tmp.mkdir(parents=True, exist_ok=True)
    home, out = tmp / f"home-{n}", tmp / f"load-{n}.json"
    cpus = sorted(os.sched_getaffinity(0))
    host_cpus = gen_cpus = None
    if pin and len(cpus) >= 2:
        host_cpus, gen_cpus = str(cpus[0]), ",".join(map(str, cpus[1:]))
    procs = Procs()
    try:
        host = procs.start(
            [sys.executable, "-m", "bench.control_plane", "--host", str(home), str(n)]
            + (["--cpus", host_cpus] if host_cpus else []),
            tmp / f"coordinator-{n}.log",
        )
        info = wait_until(
            lambda: host.poll() is not None or job_dir(home, JOB).read_coordinator(),
            60,
            "the coordinator's address",
        )
        if host.poll() is not None:
            raise RuntimeError(f"the coordinator exited {host.returncode}; see {tmp}")
        pid = info.get("pid") or host.pid  # the coordinator's own (it may host it in a child)
        cmd = [sys.executable, "-m", "bench.control_plane_load"]
        cmd += load_args(info["url"], info["token"], n, pid, out, window_s, warmup_s, gen_cpus)
        gen = procs.start(cmd, tmp / f"load-{n}.log")
        rc = gen.wait(timeout=300 + window_s)
        if rc != 0:
            tail = (tmp / f"load-{n}.log").read_text()[-2000:]
            raise RuntimeError(f"the load generator exited {rc}: {tail}")
        result = json.loads(out.read_text())
        Procs.signal_group(host, signal.SIGTERM)
    finally:
        procs.cleanup()
    result["pinned"] = {"coordinator": host_cpus, "generator": gen_cpus}
    return result


def describe(r: dict) -> str:
    lat, probe, floor = r["latency_s"], r["probe_s"], r["floor_latency_s"]

    def ms(x: float) -> str:
        return f"{x * 1000:.1f}"

    return (
        f"{r['workers']} workers: {r['rate_per_s']:.0f} heartbeats/s "
        f"(at most {r['offered_per_s']:.0f}), latency p50 {ms(lat['p50'])} p99 {ms(lat['p99'])} "
        f"max {ms(lat['max'])} ms; /docs p50 {ms(probe['p50'])} p99 {ms(probe['p99'])} ms; "
        f"idle floor p50 {ms(floor['p50'])} p99 {ms(floor['p99'])} ms; coordinator "
        f"{r['coordinator_cpu']:.2f} cores ({ms(r['cpu_per_heartbeat_s'])} ms a heartbeat: "
        f"{cores_needed(r):.2f} cores at the offered rate), "
        f"generator {r['generator_cpu']:.2f}; load "
        f"{r['loadavg'][0]:.1f}->{r['loadavg'][1]:.1f}; errors {r['errors'] or 0}; "
        f"generations {r['generations']}, failures {r['failures']}"
        + (
            ""
            if r["members_ready"] == r["workers"]
            else f"; NOT FORMED: {r['members_ready']} members"
        )
    )


def cores_needed(r: dict) -> float:
    """The coordinator's CPU to answer every heartbeat at the offered rate: its CPU per
    heartbeat answered in the window (its whole process: the control loop too) times the
    rate N workers offer at their interval. Unlike its measured CPU share, this does not
    depend on how much of a core the machine gave it (a saturated coordinator on a shared
    core shows a share below 1 and still answers late)."""
    return r["cpu_per_heartbeat_s"] * r["offered_per_s"]


def rows_of(results: dict[int, dict]) -> list[dict]:
    rows = []
    for n, r in sorted(results.items()):
        if "error" in r:  # this size could not be measured: its rows say so ("-")
            rows += [failed(f"control_plane_{n}{s}", u, reason=str(r["error"]))
                     for s, u in (("", "ms p99"), ("_cpu", "cores"))]  # fmt: skip
            continue
        lat, floor = r["latency_s"]["p99"], r["floor_latency_s"]["p99"]
        rows.append(row(f"control_plane_{n}", lat * 1000, floor * 1000, "ms p99",
                        higher_is_better=False, peer_name="floor",
                        peer_config=FLOOR_CONFIG))  # fmt: skip
        rows.append(row(f"control_plane_{n}_cpu", cores_needed(r), None, "cores",
                        higher_is_better=False, peer_name="none",
                        peer_config=NO_CPU_PEER))  # fmt: skip
    return rows


def run(
    sizes: list[int],
    tmp: Path,
    *,
    window_s: float,
    warmup_s: float = 3.0,
    pin: bool = True,
) -> tuple[list[dict], dict]:
    results = {}
    for n in sizes:
        t0 = time.monotonic()
        try:
            results[n] = measure(n, tmp / f"n{n}", window_s=window_s, warmup_s=warmup_s, pin=pin)
        except Exception as exc:  # noqa: BLE001 - one size failing does not lose the others
            results[n] = {"workers": n, "error": f"{type(exc).__name__}: {exc}"[-2000:]}
            log(f"control plane, {n} workers: FAILED {results[n]['error']}")
            continue
        log(f"control plane, {describe(results[n])} ({time.monotonic() - t0:.0f} s)")
    return rows_of(results), {str(n): r for n, r in results.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--host":
        cpus = sys.argv[sys.argv.index("--cpus") + 1] if "--cpus" in sys.argv else None
        sys.exit(host_main(sys.argv[2], int(sys.argv[3]), cpus))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default=",".join(map(str, SIZES)), help="comma-separated sizes")
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--no-pin", action="store_true", help="let the OS place both processes")
    p.add_argument("--json", type=Path, help="write the rows here (details beside it)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tidal-bench-cp-") as tmp:
        sizes = [int(x) for x in args.workers.split(",")]
        rows, details = run(sizes, Path(tmp), window_s=args.window_s, pin=not args.no_pin)
    for r in rows:
        if r["tidal"] is None:
            print(f"{r['name']:<22} failed")
            continue
        peer, ratio = (float("nan") if v is None else v for v in (r["peer"], r["ratio"]))
        print(f"{r['name']:<22} {r['tidal']:>9.3f} {peer:>9.3f} {r['unit']:<8} {ratio:.3g}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
        args.json.with_suffix(".details.json").write_text(json.dumps(details, indent=2))
    sys.exit(1 if any(r["tidal"] is None for r in rows) else 0)


if __name__ == "__main__":
    main()
