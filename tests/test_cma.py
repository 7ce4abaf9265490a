"""Cross-memory reads (``worker/state/cma.py``): when a receiver may read the source's memory
(a table of ``usable``'s rules, each with its reason), what a source offers, and a real read
between two processes, which copies the bytes exactly and fails loudly when the source is
gone."""

import json
import subprocess
import sys

import pytest
import torch

from tidal.worker.state import cma

HERE = cma.Host(boot_id="b-1", pid_ns=4026531836)


def _offer(tensors, **over):
    offer = {
        "boot_id": HERE.boot_id,
        "pid_ns": HERE.pid_ns,
        "pid": 1234,
        "spans": [[0, t.numel() * t.element_size()] for t in tensors],
    }
    return {**offer, **over}


T = [torch.zeros(4, 3), torch.zeros(5, dtype=torch.float64)]


@pytest.mark.parametrize(
    "offer, host, tensors, why",
    [
        (_offer(T), HERE, T, None),
        (None, HERE, T, "offered no read"),
        (_offer(T, boot_id="b-2"), HERE, T, "another host"),
        (_offer(T), None, T, "another host"),  # this process cannot tell its host
        (_offer(T, pid_ns=1), HERE, T, "another pid namespace"),
        (_offer(T), HERE, T[:1], "another number of tensors"),
        (_offer(T), HERE, [torch.zeros(3, 4).t(), T[1]], "not contiguous"),
        (_offer(T), HERE, [torch.zeros(4, 3, dtype=torch.float64), T[1]], "another size"),
        (_offer(T), HERE, [torch.zeros(12), T[1]], None),  # same bytes, another shape: fine
    ],
)
def test_usable(offer, host, tensors, why):
    got = cma.usable(offer, host, tensors)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got


def test_a_source_offers_contiguous_host_tensors_only(tmp_path, monkeypatch):
    assert cma.offerable(T)
    assert not cma.offerable([T[0], torch.zeros(3, 4).t()])
    hold = cma.Hold()
    offer = cma.offer(T, hold)
    assert offer["spans"] == [[T[0].data_ptr(), 48], [T[1].data_ptr(), 40]]
    assert offer["hold"] == [hold.mark.data_ptr(), int(hold.mark.item())] and offer["hold"][1]
    assert offer["boot_id"] == cma.Host.here().boot_id
    # Yama's scope 2 (admin only) or 3 (none): siblings can never read, so nothing is offered.
    yama = tmp_path / "ptrace_scope"
    monkeypatch.setattr(cma, "YAMA", yama)
    for scope, offered in (("0\n", True), ("1\n", True), ("2\n", False), ("3\n", False)):
        yama.write_text(scope)
        assert cma.offerable(T) == offered, scope


SOURCE = r"""
import json, sys, torch
from tidal.worker.state import cma
torch.manual_seed(3)
ts = [torch.randn(700, 300), torch.randn(5, dtype=torch.float64), torch.arange(9)]
hold = cma.Hold()
values = [t.flatten().tolist() for t in ts]
print(json.dumps({"offer": cma.offer(ts, hold), "values": values}), flush=True)
sys.stdin.readline()  # holds its tensors until told to release them
hold.release()
print("released", flush=True)
sys.stdin.readline()  # and lives on until told to go
"""


@pytest.mark.timeout(60)
def test_a_read_copies_the_source_bytes_and_fails_loudly_once_it_is_gone(cross_memory):
    if not cross_memory:
        pytest.skip("this machine refuses process_vm_readv")
    src = subprocess.Popen(
        [sys.executable, "-c", SOURCE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        got = json.loads(src.stdout.readline())
        offer = got["offer"]
        mine = [
            torch.zeros(700, 300),
            torch.zeros(5, dtype=torch.float64),
            torch.zeros(9, dtype=torch.int64),
        ]
        assert cma.usable(offer, cma.Host.here(), mine) is None
        for threads in (1, 3):  # one run, and three that cut the first tensor apart
            for t in mine:
                t.zero_()
            cma.read(offer, mine, threads=threads)
            assert [t.flatten().tolist() for t in mine] == got["values"], threads
        assert cma.held(offer)  # the source still holds them: the copy stands
        src.stdin.write("release\n")
        src.stdin.flush()
        assert src.stdout.readline().strip() == "released"
        assert not cma.held(offer)  # alive, but no longer holding: a copy would be refused
        src.stdin.write("go\n")
        src.stdin.flush()
        src.wait(timeout=30)
        assert not cma.held(offer)  # gone
        with pytest.raises(OSError, match="process_vm_readv"):
            cma.read(offer, mine)
    finally:
        src.kill()
        src.wait()


@pytest.mark.parametrize(
    "sizes, parts, want",
    [
        ([10], 1, [[10]]),
        ([10], 2, [[5], [5]]),
        ([10], 3, [[4], [4], [2]]),
        ([3, 7], 2, [[3, 2], [5]]),
        ([3, 7], 5, [[2], [1, 1], [2], [2], [2]]),
        ([4, 4], 2, [[4], [4]]),
        ([], 2, []),
    ],
)
def test_split_cuts_the_spans_into_runs_of_equal_bytes(sizes, parts, want):
    pieces, at = [], 0
    for n in sizes:  # local and remote addresses differ by a fixed offset
        pieces.append((at, at + 1000, n))
        at += n
    runs = cma._split(pieces, parts)
    assert [[n for _, _, n in run] for run in runs] == want
    flat = [piece for run in runs for piece in run]
    # In order, covering every byte once, each cut keeping local and remote in step.
    assert all(theirs - mine == 1000 for mine, theirs, _ in flat)
    assert [(m, n) for m, _, n in flat] == _contiguous(flat)
    assert sum(n for _, _, n in flat) == sum(sizes)


def _contiguous(flat):
    out, at = [], 0
    for _, _, n in flat:
        out.append((at, n))
        at += n
    return out


def test_readers_use_a_thread_per_four_mib_up_to_the_cores():
    cores = len(__import__("os").sched_getaffinity(0))
    assert cma.readers(0) == 1 and cma.readers(3 << 20) == 1
    assert cma.readers(8 << 20) == min(2, cores)
    assert cma.readers(1 << 30) == min(cma.MAX_THREADS, cores)
