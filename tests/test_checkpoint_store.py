"""Checkpoint files: atomic, verified, pruned; a crash mid-write leaves nothing usable."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tidal.checkpoint import store
from tidal.checkpoint.writer import AsyncCheckpointer


def model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(5, 8)).sum().backward()
    o.step()
    return m, o


def save(directory: Path, step: int, seed: int = 0) -> store.Written:
    m, o = model_and_opt(seed)
    return store.write(store.take_snapshot(step=step, module=m, optimizer=o, meta={}), directory)


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    m, o = model_and_opt()
    torch.manual_seed(123)
    snap = store.take_snapshot(step=7, module=m, optimizer=o, meta={"world_size": 2})
    expected_draw = torch.rand(3)
    written = store.write(snap, tmp_path)
    assert Path(written.path).name == "step-00000007" and written.bytes > 0
    m2, o2 = model_and_opt(seed=1)
    meta = store.load(Path(written.path), m2, o2)
    store.restore_rng(meta)
    assert torch.equal(torch.rand(3), expected_draw)
    assert meta["step"] == 7 and meta["world_size"] == 2
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = o.state_dict(), o2.state_dict()
    assert s1["param_groups"][0]["betas"] == s2["param_groups"][0]["betas"]
    for pid in s1["state"]:
        for key, value in s1["state"][pid].items():
            assert torch.equal(value, s2["state"][pid][key])


def test_snapshot_is_a_copy(tmp_path):
    m, o = model_and_opt()
    snap = store.take_snapshot(step=1, module=m, optimizer=o, meta={})
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    for name, p in m.state_dict().items():
        assert not torch.equal(snap.model[name], p)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_damaged_checkpoint_is_refused_and_the_previous_one_used(tmp_path, damage):
    save(tmp_path, 10)
    newest = Path(save(tmp_path, 20, seed=1).path)
    target = newest / "model.safetensors"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "delete":
        target.unlink()
    else:
        (newest / store.MANIFEST).write_text("{not json")
    path, warnings = store.newest_good(tmp_path)
    assert path is not None and path.name == "step-00000010"
    assert len(warnings) == 1 and "step-00000020" in warnings[0] and "refused" in warnings[0]
    m, o = model_and_opt()
    with pytest.raises(store.CheckpointError, match="step-00000020"):
        store.load(newest, m, o)


def test_temporary_folders_are_never_checkpoints(tmp_path):
    save(tmp_path, 5)
    (tmp_path / ".tmp-step-00000009-abcd").mkdir()
    (tmp_path / "step-00000011").mkdir()  # no manifest: refused by verify
    names = [p.name for p in store.list_checkpoints(tmp_path)]
    assert ".tmp-step-00000009-abcd" not in names
    path, warnings = store.newest_good(tmp_path)
    assert path.name == "step-00000005" and "step-00000011" in warnings[0]


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step)
    store.prune(tmp_path, keep=2)
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-00000004", "step-00000003"]


def test_async_writer_reports_and_keeps_k(tmp_path):
    written = []
    writer = AsyncCheckpointer(tmp_path, keep=2, on_written=written.append)
    m, o = model_and_opt()
    for step in (10, 20, 30):
        writer.save(step=step, module=m, optimizer=o, meta={})
    writer.wait()
    assert [w.step for w in written] == [10, 20, 30]
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-00000030", "step-00000020"]
    with pytest.raises(ValueError, match="--keep-checkpoints"):
        AsyncCheckpointer(tmp_path, keep=0, on_written=written.append)


WRITER = """
import sys, torch
from pathlib import Path
from tidal.checkpoint import store
m = torch.nn.Linear(4096, 4096)  # 64 MiB of parameters: the write takes a while
snap = store.take_snapshot(step=int(sys.argv[2]), module=m,
                           optimizer=torch.optim.SGD(m.parameters(), lr=0.1), meta={})
print("ready", flush=True)
store.write(snap, Path(sys.argv[1]))
print("written", flush=True)
"""


@pytest.mark.timeout(120)
def test_sigkill_during_a_write_leaves_no_usable_folder(tmp_path):
    save(tmp_path, 1)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "2"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob(".tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert list(tmp_path.glob(".tmp-*")), "the writer never started its temporary folder"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    path, warnings = store.newest_good(tmp_path)
    assert path is not None and path.name == "step-00000001", (path, warnings)
    assert not (tmp_path / "step-00000002").exists()


def test_manifest_lists_every_file_with_its_hash(tmp_path):
    written = save(tmp_path, 3)
    manifest = json.loads((Path(written.path) / store.MANIFEST).read_text())
    files = sorted(p.name for p in Path(written.path).iterdir() if p.name != store.MANIFEST)
    assert sorted(manifest["files"]) == files
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
