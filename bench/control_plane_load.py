"""The load generator of ``bench.control_plane``: N simulated workers on one event loop.

``python -m bench.control_plane_load URL TOKEN N HOST_PID OUT.json [options]``

Each simulated worker does what ``tidal.worker.agent.client.Agent`` does over the real HTTP API,
with its own credential (``protocol.worker_token``) and its own keep-alive connection:
register, then heartbeat, waiting ``heartbeat_interval_s`` (from the registration's
answer) after each answer. Its heartbeat body is what the agent sends (``HeartbeatRequest``
as ``model_dump(mode="json")``): the step and generation; one per-step record for each step
since its last heartbeat (every worker logs ``loss`` with ``reduce="mean"``; rank 0 also
``accuracy`` and ``lr``); rank 0's rate metrics every 0.5 s; and, once a member of a new
generation, its ``StepReport``. The simulated job steps every ``--step-s`` seconds.

The client is a minimal HTTP/1.1 one on asyncio streams (requests pre-formatted, answers
read by their Content-Length, only the generation id parsed) so that it costs the
coordinator's machine little CPU; the generator's own CPU is measured and reported.

Phases: registration (until every worker is a member of one generation of N), warm-up,
the measured window (heartbeat latencies, the coordinator's CPU from ``/proc/PID/stat``, and
a probe: ``GET /docs``, a trivial page of the same server, every 50 ms), then the idle
floor (every worker silent but one, which heartbeats one request at a time; the probe too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import time
from urllib.parse import urlparse

from tidal.protocol import API_PREFIX, worker_token

GEN_ID = re.compile(rb'"generation":\{"id":(\d+)')
INTERVAL = re.compile(rb'"interval_s":([0-9.eE+-]+)')  # the next beat's, if the answer sets it
PROBE_EVERY_S = 0.05
# Registrations in flight at once: workers come up in waves, as a backend starts them (the
# local and Ray backends start at most a few at a time); a thousand registrations at once
# would queue every early worker's heartbeats behind them.
REGISTERING = 32


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Conn:
    """One keep-alive HTTP/1.1 connection (TCP_NODELAY, as the workers' client)."""

    def __init__(self, host: str, port: int, auth: str | None) -> None:
        self.host, self.port = host, port
        self.head = f"Host: {host}:{port}\r\n" + (
            f"Authorization: Bearer {auth}\r\n" if auth else ""
        )
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        if self.writer is None:
            await self._open()
        head = f"{method} {API_PREFIX if path.startswith('/workers') else ''}{path} HTTP/1.1\r\n"
        head += self.head
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write((head + "\r\n").encode() + (body or b""))
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
            lines = raw.split(b"\r\n")
            status = int(lines[0].split()[1])
            length = 0
            for line in lines[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            return status, await self.reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            self.close()
            raise

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        u = urlparse(args.url)
        self.host, self.port = u.hostname, u.port
        self.args, self.n = args, args.n
        self.phase = "register"
        self.t0 = time.time()
        self.members_of: dict[int, int] = {}  # generation id -> member count
        self.ready: set[int] = set()  # workers that are members of a generation of n
        self.lat: dict[str, list[float]] = {"window": [], "floor": []}
        self.probe: dict[str, list[float]] = {"window": [], "floor": []}
        self.errors: dict[str, int] = {}
        self.sent = 0
        self.inflight = 0  # heartbeats sent and not answered yet
        self.answered = 0
        self.exited = 0  # simulated workers the coordinator told to exit
        self.alive: set[int] = set()  # registered and not told to exit
        self.floor_worker = 0  # the one that heartbeats in the floor phase
        self.interval = float("nan")

    def step(self) -> int:
        return int((time.time() - self.t0) / self.args.step_s)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def worker(self, wid: int) -> None:
        conn = Conn(self.host, self.port, worker_token(self.args.token, wid))
        path = f"/workers/{wid}/heartbeat"
        reg = json.dumps({"pid": os.getpid(), "host": "bench", "max_steps": 10**9}).encode()
        async with self.registering:
            while True:  # the coordinator starts its workers (null backend) at its first tick
                status, body = await conn.request("POST", f"/workers/{wid}/register", reg)
                if status == 200:
                    break
                if status != 400:
                    raise RuntimeError(f"worker {wid}: register answered {status}: {body[:200]}")
                await asyncio.sleep(0.05)
        self.alive.add(wid)
        interval = base_interval = json.loads(body)["config"]["heartbeat_interval_s"]
        self.interval = interval
        gen, last_step, last_rate, report = 0, self.step(), 0.0, None
        await asyncio.sleep(random.uniform(0, interval))
        while self.phase != "done":
            if self.phase == "drain" or (self.phase == "floor" and wid != self.floor_worker):
                await asyncio.sleep(0.05)
                continue
            now, step = time.time(), self.step()
            records = []
            for s in range(max(last_step, step - 10), step):  # the steps since the last beat
                values = {"loss": 2.0 / (1 + s * 1e-3) + wid * 1e-6}
                if wid == 0:
                    values.update(accuracy=min(1.0, s * 1e-4), lr=0.1)
                records.append({"step": s, "generation": gen, "values": values})
            last_step = max(last_step, step)
            metrics = {}
            if wid == 0 and now - last_rate >= 0.5:
                last_rate = now
                metrics = {"samples_per_s": 1e5, "world_size": float(self.n), "compute_s": 0.08,
                           "comm_s": 0.02}  # fmt: skip
            body = {
                "step": step, "generation": gen, "leaving": False, "metrics": metrics,
                "reports": [report] if report else [], "checkpoints": [],
                "checkpoint_failures": [], "step_metrics": records,
            }  # fmt: skip
            phase = self.phase
            t = time.perf_counter()
            self.inflight += 1
            try:
                status, answer = await conn.request("POST", path, json.dumps(body).encode())
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                self.error(type(exc).__name__)
                await asyncio.sleep(interval)
                continue
            finally:
                self.inflight -= 1
            dt = time.perf_counter() - t
            self.answered += self.phase == "window"  # answered in the window, sent whenever
            if phase in self.lat:  # sent in the window (or the floor), answered whenever
                self.lat[phase].append(dt)
                self.sent += phase == "window"
            if status != 200:
                self.error(f"http {status}")
            elif answer.startswith(b'{"role":"exit"'):
                self.exited += 1  # told to leave (killed as hung, or retired): it exits
                self.alive.discard(wid)
                break
            else:
                report = None
                m = GEN_ID.search(answer)
                if m and answer.startswith(b'{"role":"member"') and int(m[1]) != gen:
                    info = json.loads(answer)["generation"]
                    gen = info["id"]
                    self.members_of[gen] = len(info["members"])
                    report = {"generation": gen, "start_step": step, "first_step_time": time.time()}
                if m and self.members_of.get(int(m[1]), 0) == self.n:
                    self.ready.add(wid)
                m = INTERVAL.search(answer)
                interval = self.interval = float(m[1]) if m else base_interval
            await asyncio.sleep(0.01 if self.phase == "floor" else interval)
        conn.close()

    async def prober(self) -> None:
        conn = Conn(self.host, self.port, None)
        while self.phase != "done":
            phase = self.phase
            t = time.perf_counter()
            try:
                status, _ = await conn.request("GET", "/docs")
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                self.error("probe")
                await asyncio.sleep(PROBE_EVERY_S)
                continue
            if phase in self.probe and status == 200:
                self.probe[phase].append(time.perf_counter() - t)
            await asyncio.sleep(PROBE_EVERY_S)
        conn.close()

    async def run(self) -> dict:
        a = self.args
        self.registering = asyncio.Semaphore(REGISTERING)
        tasks = [asyncio.create_task(self.worker(w)) for w in range(self.n)]
        tasks.append(asyncio.create_task(self.prober()))
        t_start = time.monotonic()
        while len(self.ready) < self.n:
            failed = [t for t in tasks if t.done() and t.exception()]
            if failed:
                raise failed[0].exception()
            if time.monotonic() - t_start > a.ready_timeout:
                break  # never formed (that is the finding): measure the heartbeats as they are
            await asyncio.sleep(0.1)
        ready_s = time.monotonic() - t_start
        members = len(self.ready)
        self.phase = "warmup"
        await asyncio.sleep(a.warmup_s)
        cpu0, own0, wall0 = cpu_seconds(a.host_pid), time.process_time(), time.monotonic()
        load0 = os.getloadavg()[0]
        self.phase = "window"
        await asyncio.sleep(a.window_s)
        self.phase = "drain"  # the floor starts once every heartbeat sent is answered
        wall = time.monotonic() - wall0
        cpu, own = cpu_seconds(a.host_pid) - cpu0, time.process_time() - own0
        load1 = os.getloadavg()[0]
        t_drain = time.monotonic()
        while self.inflight and time.monotonic() - t_drain < 60:
            await asyncio.sleep(0.02)
        drain_s = time.monotonic() - t_drain
        self.floor_worker = min(self.alive, default=0)
        self.phase = "floor"
        floor_cpu0, floor_wall0 = cpu_seconds(a.host_pid), time.monotonic()
        await asyncio.sleep(a.floor_s)
        floor_cpu = (cpu_seconds(a.host_pid) - floor_cpu0) / (time.monotonic() - floor_wall0)
        self.phase = "done"
        await asyncio.gather(*tasks, return_exceptions=True)
        conn = Conn(self.host, self.port, None)
        status = json.loads((await conn.request("GET", "/api/v1/status"))[1])
        conn.close()
        return {
            "workers": self.n,
            "ready_s": ready_s,
            # workers that were members of one generation of all N when the window began
            # (fewer: the coordinator never formed it within --ready-timeout)
            "members_ready": members,
            "window_s": wall,
            "heartbeats": self.sent,
            "rate_per_s": self.sent / wall,
            "heartbeat_interval_s": self.interval,
            "offered_per_s": self.n / self.interval,
            "latency_s": summary(self.lat["window"]),
            "probe_s": summary(self.probe["window"]),
            "floor_latency_s": summary(self.lat["floor"]),
            "floor_probe_s": summary(self.probe["floor"]),
            "coordinator_cpu": cpu / wall,
            # the coordinator's CPU per heartbeat answered in the window: its capacity is
            # about one core / this, whatever else runs on the machine
            "cpu_per_heartbeat_s": cpu / max(1, self.answered),
            "floor_coordinator_cpu": floor_cpu,  # one heartbeat at a time
            "drain_s": drain_s,  # from the window's end until every heartbeat was answered
            "generator_cpu": own / wall,
            "loadavg": [load0, load1],
            "errors": self.errors,
            "generations": len(status["generations"]),
            "job_state": status["state"],
            "failures": sum(1 for e in status["events"] if e["kind"] == "failure"),
            "exited": self.exited,
        }


def summary(xs: list[float]) -> dict:
    from bench.common import percentile

    return {
        "n": len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs) if xs else float("nan"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("token")
    p.add_argument("n", type=int)
    p.add_argument("host_pid", type=int)
    p.add_argument("out")
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--floor-s", type=float, default=3.0)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--cpus", help="comma-separated CPUs to run on")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    random.seed(0)
    result = asyncio.run(Load(args).run())
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
