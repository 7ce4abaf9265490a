"""State transfer to a joiner: Tidal's heal of a ~100 MB model against the raw loopback
transfer of the same bytes, in two processes on this machine.

Rank 0 holds a trained model (25 M float32 parameters, 100 MB) and its SGD momentum
(another 100 MB); rank 1 joins with a fresh model and no optimizer state, and both call
``tidal.worker.state.heal.heal`` in a 2-rank gloo group: rank 1 receives parameters, buffers,
optimizer state and RNG (what a joiner gets in a real scale-up). The joiner prepares its
landing memory first (``landing.prepare``), as a worker does in its warm-up before it is
ready; each repetition also heals a joiner without it (``heal_cold``: the optimizer state
lands in fresh memory, faulted in during the transfer). The peer is the floor for
moving those bytes: one gloo broadcast of a single flat tensor of the same size, a plain
TCP socket over loopback (``raw``: the faster of the two, the wire's speed), and one copy
from the first process's memory into the second's (``copy``: ``process_vm_readv``, as the
heal's own path on one host, ``tidal.worker.state.cma``; ``floor``: the fastest of all). Timed on
rank 0 between barriers, median of ``--reps``.

``python -m bench.state_transfer [--reps N] [--mb M]`` (runs both ranks itself).
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import Procs, free_port


def build(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:], len(buf) - got)
        if not n:
            raise ConnectionError("peer closed")
        got += n


def worker(rank: int, port: int, sock_port: int, width: int, reps: int, out: Path) -> None:
    import torch.distributed as dist

    from tidal.worker.state.heal import heal
    from tidal.worker.state.landing import prepare

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(rank)
    model, opt = build(width)
    if rank == 0:  # one update: momentum buffers exist, as after training
        model(torch.randn(8, width)).sum().backward()
        opt.step()
    heal_s, cold_s, raw_s, sock_s = [], [], [], []
    nbytes = 0
    for _ in range(reps):
        for timings, prepared in ((heal_s, True), (cold_s, False)):
            land = []
            if rank == 1:
                model, opt = build(width)  # a fresh joiner every time
                if prepared:  # as a worker does in its warm-up, before it is ready
                    land = prepare(opt)
            dist.barrier()
            t0 = time.perf_counter()
            heal(module=model, optimizer=opt, step=5 if rank == 0 else None, landing=land)
            dist.barrier()
            timings.append(time.perf_counter() - t0)
            del land
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes += sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    flat = torch.ones(nbytes // 4) if rank == 0 else torch.empty(nbytes // 4)
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(flat, 0)
        dist.barrier()
        raw_s.append(time.perf_counter() - t0)
    # plain TCP over loopback, the same bytes
    buf = memoryview(flat.numpy()).cast("B")
    if rank == 0:
        srv = socket.create_server(("127.0.0.1", sock_port))
        dist.barrier()
        conn, _ = srv.accept()
        for _ in range(reps):
            t0 = time.perf_counter()
            conn.sendall(buf)
            _recv_exact(conn, memoryview(bytearray(1)))
            sock_s.append(time.perf_counter() - t0)
        conn.close()
        srv.close()
    else:
        dist.barrier()
        conn = socket.create_connection(("127.0.0.1", sock_port))
        for _ in range(reps):
            _recv_exact(conn, buf)
            conn.sendall(b"k")
        conn.close()
    copy_s = _one_copy(rank, flat, reps)
    if rank == 0:
        result = {
            "bytes": nbytes,
            "heal_s": heal_s,
            "heal_cold_s": cold_s,
            "gloo_s": raw_s,
            "socket_s": sock_s,
            "copy_s": copy_s,
        }
        out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _one_copy(rank: int, flat: torch.Tensor, reps: int) -> list[float]:
    """Rank 1 copies rank 0's ``flat`` into its own (touched) one with ``process_vm_readv``,
    on as many threads as a heal's read of that many bytes: one copy, the floor of moving
    bytes between two processes on one host. Empty where the kernel refuses the call."""
    import torch.distributed as dist

    from tidal.worker.state import cma

    hold = cma.Hold()  # held for the whole measurement
    offers = [cma.offer([flat], hold) if rank == 0 and cma.offerable([flat]) else None]
    dist.broadcast_object_list(offers, 0)
    offer = offers[0]
    ok = torch.tensor([0 if offer is None else 1])
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 1 and int(ok.item()):
            try:
                cma.read(offer, [flat])
            except OSError:
                ok.zero_()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return times if int(ok.item()) else []


def measure(tmp: Path, *, mb: float = 100, reps: int = 5, timeout: float = 300) -> dict:
    width = int((mb * 1e6 / 4 / 2) ** 0.5)  # two width x width layers of float32
    port, sock_port = free_port(), free_port()
    out = tmp / "state_transfer.json"
    procs = Procs()
    try:
        ps = [
            procs.start(
                [sys.executable, "-m", "bench.state_transfer", "--worker", str(rank)]
                + ["--port", str(port), "--sock-port", str(sock_port), "--width", str(width)]
                + ["--reps", str(reps), "--out", str(out)],
                tmp / f"state-transfer-{rank}.log",
            )
            for rank in (0, 1)
        ]
        for p in ps:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"state transfer worker exited {p.returncode}; see {tmp}")
    finally:
        procs.cleanup()
    res = json.loads(out.read_text())
    res["heal"] = statistics.median(res["heal_s"])
    res["heal_cold"] = statistics.median(res["heal_cold_s"])
    res["gloo"] = statistics.median(res["gloo_s"])
    res["socket"] = statistics.median(res["socket_s"])
    res["copy"] = statistics.median(res["copy_s"]) if res["copy_s"] else None
    res["raw"] = min(res["gloo"], res["socket"])  # over the wire (loopback)
    res["floor"] = min(res["raw"], res["copy"] or res["raw"])  # any way between processes
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--sock-port", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.sock_port, args.width, args.reps, args.out)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        res = measure(Path(t), mb=args.mb, reps=args.reps)
    print(
        f"{res['bytes'] / 1e6:.0f} MB: heal {res['heal'] * 1000:.0f} ms (into fresh memory "
        f"{res['heal_cold'] * 1000:.0f} ms), gloo broadcast "
        f"{res['gloo'] * 1000:.0f} ms, socket {res['socket'] * 1000:.0f} ms, one copy "
        f"{res['copy'] * 1000 if res['copy'] is not None else float('nan'):.0f} ms: "
        f"{res['heal'] / res['raw']:.2f}x the raw transfer, "
        f"{res['heal'] / res['floor']:.2f}x the floor"
    )


if __name__ == "__main__":
    main()
