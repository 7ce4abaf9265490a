"""Checkpoint files: atomic, verified, pruned; a crash mid-write leaves nothing usable."""

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tidal.checkpoint import store
from tidal.checkpoint.layout import file_digest, stale_temporary
from tidal.checkpoint.tensorfile import HASH, write_tensors
from tidal.checkpoint.writer import AsyncCheckpointer


def model_and_opt(seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    m.to(device)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(5, 8).to(device)).sum().backward()
    o.step()
    return m, o


def save(directory: Path, step: int, seed: int = 0) -> store.Written:
    m, o = model_and_opt(seed)
    return store.write(store.take_snapshot(step=step, module=m, optimizer=o, meta={}), directory)


def test_round_trip_restores_model_optimizer_and_rng(tmp_path, device):
    """On every device: a CUDA state is snapshotted into (pinned) host memory and loads back
    onto the device, with the CUDA generator's state."""
    m, o = model_and_opt(device=device)
    torch.manual_seed(123)
    pool = store.Buffers()
    pending = store.begin_snapshot(
        step=7, module=m, meta={"world_size": 2}, tracked=None, pool=pool
    )
    snap = pending.complete(m, o)
    expected_draw = torch.rand(3)
    expected_device_draw = torch.rand(3, device=device)
    written = store.write(snap, tmp_path)
    assert Path(written.path).name == "step-00000007" and written.bytes > 0
    m2, o2 = model_and_opt(seed=1, device=device)
    meta = store.load(Path(written.path), m2, o2)
    store.restore_rng(meta)
    assert torch.equal(torch.rand(3), expected_draw)
    if device == "cuda":
        assert torch.equal(torch.rand(3, device=device), expected_device_draw)
        # Every copy of a GPU tensor is pinned; Adam's ``step`` counters live on the CPU
        # (not capturable) and their copies need not be.
        on_gpu = {f"m.{k}" for k, v in m.state_dict().items() if v.is_cuda} | {
            f"o.state.{pid}.{key}"
            for pid, st in o.state_dict()["state"].items()
            for key, v in st.items()
            if v.is_cuda
        }
        assert on_gpu and on_gpu <= set(pool._held)
        assert all(pool._held[k].is_pinned() for k in on_gpu)
    assert {p.device.type for p in m2.parameters()} == {device}
    assert {v.device.type for st in o2.state.values() for v in st.values() if v.dim() > 0} == {
        device
    }
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


@pytest.mark.parametrize("pool", [None, store.Buffers()])
def test_tracked_state_is_taken_when_the_snapshot_begins(pool) -> None:
    """An EMA updated in the next step's body (docs/porting.md) changes before the writer's
    thread completes the snapshot: the checkpoint holds the EMA of the step it is of."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from tidal.tracked import TrackedState

    m, o = model_and_opt()
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema.update_parameters(m)
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    pending = store.begin_snapshot(
        step=1, module=m, meta={}, tracked=TrackedState({"ema": ema}), pool=pool
    )
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    ema.update_parameters(m)  # the next step's body, while the copy is in flight
    snap = pending.complete(m, o)
    saved = snap.tracked_tensors
    assert len(saved) == len(before)
    for got, want in zip(saved.values(), before.values(), strict=True):
        assert torch.equal(got, want)  # n_averaged 1, the weights before the update


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
    """The newest ``keep`` stay at every moment; an older one goes as the next write begins
    (before its first file: it reuses the pages that frees), the last ones at ``close``."""
    written, seen = [], {}

    def steps() -> list[int]:
        return [int(p.name.split("-")[1]) for p in store.list_checkpoints(tmp_path)]

    writer = AsyncCheckpointer(
        tmp_path,
        keep=2,
        on_written=written.append,
        during_write=lambda step: seen.setdefault(step, steps()),
    )
    m, o = model_and_opt()
    for step in (10, 20, 30, 40):
        writer.save(step=step, module=m, optimizer=o, meta={})
    writer.wait()
    assert [w.step for w in written] == [10, 20, 30, 40]
    assert seen == {10: [], 20: [10], 30: [20, 10], 40: [30, 20]}
    assert steps() == [40, 30, 20]  # until the next write begins ...
    writer.close()
    assert steps() == [40, 30]  # ... or the writer closes
    writer.close()  # again: nothing more goes
    assert steps() == [40, 30]
    other = AsyncCheckpointer(tmp_path, keep=1, on_written=written.append)
    other.close()  # a writer that wrote nothing leaves the folder alone
    assert steps() == [40, 30]
    with pytest.raises(ValueError, match="--keep-checkpoints"):
        AsyncCheckpointer(tmp_path, keep=0, on_written=written.append)


WRITER = """
import sys, torch
from pathlib import Path
from tidal.checkpoint import store
from tidal.checkpoint.layout import file_digest, stale_temporary
from tidal.checkpoint.tensorfile import HASH, write_tensors
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
    # The dead writer's temporary folder goes with the next prune (a later write's).
    (left,) = tmp_path.glob(".tmp-*")
    assert left.name.endswith(f"-{proc.pid}@{socket.gethostname()}"), left.name
    assert left in store.prune(tmp_path, keep=2)
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize(
    "name, age_s, alive, why",
    [
        (".tmp-step-00000002-abcd1234-42@here", 1.0, False, "its writer (pid 42) is gone"),
        (".tmp-step-00000002-abcd1234-42@here", 1e6, True, None),  # a write in progress
        (".tmp-step-00000002-abcd1234-42@there", 1.0, False, None),  # another host's: ask later
        (".tmp-step-00000002-abcd1234-42@there", 7200.0, False, "2.0 h old"),
        (".tmp-step-00000002-abcd1234-42@a-b@c", 7200.0, True, "2.0 h old"),  # not this host
        (".tmp-step-00000009-abcd", 60.0, False, None),  # an older name: no writer to ask
        (".tmp-step-00000009-abcd", 4000.0, False, "1.1 h old"),
        ("step-00000009", 1e6, False, None),  # a checkpoint: prune's other rule decides
        (".hidden", 1e6, False, None),
    ],
)
def test_a_temporary_folder_is_stale_only_when_its_writer_is_gone(name, age_s, alive, why):
    got = stale_temporary(name, age_s=age_s, host="here", alive=lambda pid: alive)
    assert got == why


def test_manifest_lists_every_file_with_its_hash(tmp_path):
    written = save(tmp_path, 3)
    manifest = json.loads((Path(written.path) / store.MANIFEST).read_text())
    files = sorted(p.name for p in Path(written.path).iterdir() if p.name != store.MANIFEST)
    assert sorted(manifest["files"]) == files
    for name, f in manifest["files"].items():  # XXH3-128, computed while writing
        assert f[HASH] == file_digest(Path(written.path) / name, HASH) and len(f[HASH]) == 32


def test_a_checkpoint_written_with_sha256_still_verifies_and_its_damage_is_found(tmp_path):
    written = save(tmp_path, 3)
    path = Path(written.path)
    manifest = json.loads((path / store.MANIFEST).read_text())
    for name, f in manifest["files"].items():  # as a checkpoint of an earlier Tidal holds it
        manifest["files"][name] = {"sha256": store._sha256(path / name), "bytes": f["bytes"]}
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    store.verify(path)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(store.CheckpointError, match="sha256 mismatch in model.safetensors"):
        store.verify(path)
    data[-1] ^= 1
    (path / "model.safetensors").write_bytes(bytes(data))
    del manifest["files"]["meta.json"]["sha256"]
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(store.CheckpointError, match="no checksum for"):
        store.verify(path)


def test_tensor_files_are_standard_safetensors_written_from_memory(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "f64": torch.randn(3, 5, dtype=torch.float64),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "i64": torch.arange(3),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.zeros(0, 4),
        "u8": torch.arange(5, dtype=torch.uint8),
    }
    size, digest = write_tensors(tmp_path / "x.safetensors", tensors)
    assert size == (tmp_path / "x.safetensors").stat().st_size
    assert digest == file_digest(tmp_path / "x.safetensors", HASH)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t)
    with pytest.raises(ValueError, match="contiguous CPU"):
        write_tensors(tmp_path / "y.safetensors", {"t": torch.randn(4, 4).t()})


def test_the_async_writer_reuses_its_snapshot_memory_and_writes_each_step_s_state(tmp_path):
    m, o = model_and_opt()
    writer = AsyncCheckpointer(tmp_path, keep=3, on_written=lambda w: None)
    held, expected = [], []
    for step in (1, 2):
        writer.save(step=step, module=m, optimizer=o, meta={})
        writer.quiesce()
        expected.append({k: v.clone() for k, v in m.state_dict().items()})
        writer.wait()
        held.append({k: v.data_ptr() for k, v in writer._buffers._held.items()})
        m(torch.randn(5, 8)).sum().backward()
        o.step()  # the state changes between the two checkpoints
    assert held[0] == held[1] and len(held[0]) == 4 + 4 * 3  # 4 parameters; Adam: step, 2 moments
    for step, want in zip((1, 2), expected, strict=True):
        m2, o2 = model_and_opt(seed=5)
        store.load(tmp_path / store.checkpoint_name(step), m2, o2)
        for k, v in m2.state_dict().items():
            assert torch.equal(v, want[k]), (step, k)


# -- consistent but bad checkpoints: hashes that match contents that are not a checkpoint ----
def rewrite(path: Path, name: str, data: bytes | None) -> None:
    """Replace (or, with None, remove) ``name`` and recompute the manifest's hashes, as a
    buggy writer or a hand-made folder would leave it: every hash matches."""
    manifest = json.loads((path / store.MANIFEST).read_text())
    if data is None:
        (path / name).unlink()
        manifest["files"].pop(name, None)
    else:
        (path / name).write_bytes(data)
    for f in manifest["files"]:
        manifest["files"][f] = {
            "sha256": store._sha256(path / f),
            "bytes": (path / f).stat().st_size,
        }
    (path / store.MANIFEST).write_text(json.dumps(manifest))


def meta_without(key: str, path: Path) -> bytes:
    meta = json.loads((path / "meta.json").read_text())
    del meta[key]
    return json.dumps(meta).encode()


BAD_CASES = {
    "pickle as the model": (
        lambda p: rewrite(p, "model.safetensors", pickle.dumps({"w": [1.0, 2.0]})),
        "model.safetensors is not a safetensors file",
    ),
    "empty table of files": (
        lambda p: (p / store.MANIFEST).write_text('{"files": {}, "step": 20}'),
        "does not list model.safetensors",
    ),
    "manifest without step": (
        lambda p: (p / store.MANIFEST).write_text(
            json.dumps(
                {
                    k: v
                    for k, v in json.loads((p / store.MANIFEST).read_text()).items()
                    if k != "step"
                }
            )
        ),
        "no integer step",
    ),
    "meta.json without step": (
        lambda p: rewrite(p, "meta.json", meta_without("step", p)),
        "meta.json has no integer step",
    ),
    "meta.json of another step": (
        lambda p: rewrite(p, "meta.json", json.dumps({"step": 7}).encode()),
        "meta.json says step 7",
    ),
    "an extra file": (
        lambda p: add_extra_file(p),
        "unexpected files: x.bin",
    ),
    "optimizer.json missing": (
        lambda p: rewrite(p, "optimizer.json", None),
        "does not list optimizer.json",
    ),
    "odd optimizer tensor name": (
        lambda p: rewrite(p, "optimizer.safetensors", safetensors_bytes({"weird": [1.0]})),
        "tensor named 'weird'",
    ),
}


def add_extra_file(path: Path) -> None:
    (path / "x.bin").write_bytes(b"x")
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["files"]["x.bin"] = {"sha256": store._sha256(path / "x.bin"), "bytes": 1}
    (path / store.MANIFEST).write_text(json.dumps(manifest))


def safetensors_bytes(tensors: dict[str, list[float]]) -> bytes:
    from safetensors.torch import save

    return save({k: torch.tensor(v) for k, v in tensors.items()})


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_consistent_but_malformed_checkpoint_is_refused_before_it_is_chosen(tmp_path, case):
    damage, reason = BAD_CASES[case]
    save(tmp_path, 10)
    newest = Path(save(tmp_path, 20, seed=1).path)
    damage(newest)
    path, warnings = store.newest_good(tmp_path)
    assert path is not None and path.name == "step-00000010", (case, warnings)
    assert len(warnings) == 1 and "step-00000020" in warnings[0], warnings
    assert reason in warnings[0], warnings[0]
    assert "\n" not in warnings[0]


def test_checkpoint_of_another_model_is_refused_and_kept_a_damaged_one_marked_bad(tmp_path):
    save(tmp_path, 10)
    other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    opt = torch.optim.Adam(other.parameters())
    newest = Path(
        store.write(
            store.take_snapshot(step=20, module=other, optimizer=opt, meta={}), tmp_path
        ).path
    )
    assert store.newest_good(tmp_path)[0] == newest  # it is a well-formed checkpoint

    m, o = model_and_opt()
    before = [p.clone() for p in m.parameters()]
    with pytest.raises(
        store.CheckpointMismatch, match="step-00000020 refused, and kept: 0.weight is"
    ) as e:
        store.load(newest, m, o)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    # The script's fault, not the checkpoint's (issue 50, finding 4): never marked bad.
    assert not store.marks_bad(e.value) and "it does not fit this script" in str(e.value)
    assert store.newest_good(tmp_path)[0] == newest
    # A damaged one is (Durable.resume marks what ``verify`` refuses at load)
    store.mark_bad(newest, "xxh3_128 mismatch in model.safetensors")
    path, warnings = store.newest_good(tmp_path)
    assert path is not None and path.name == "step-00000010"
    assert "failed to load before: xxh3_128 mismatch in model.safetensors" in warnings[0]
    assert f"(delete {newest / store.BAD} to have it tried again)" in warnings[0]
    (newest / store.BAD).unlink()  # what docs/reliability.md says to do
    assert store.newest_good(tmp_path)[0] == newest


def test_checkpoint_of_another_dtype_is_refused(tmp_path):
    m, o = model_and_opt()
    written = store.write(store.take_snapshot(step=3, module=m, optimizer=o, meta={}), tmp_path)
    m64, o64 = model_and_opt()
    m64.double()
    with pytest.raises(store.CheckpointError, match="torch.float32 .* the model's torch.float64"):
        store.load(Path(written.path), m64, o64)
