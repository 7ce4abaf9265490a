"""Checkpoints at an fsspec URL (``--checkpoint-dir s3://...``): the rules as tables, then
the store against a real S3-compatible server (moto's server mode on 127.0.0.1, started by
the ``moto_server`` fixture), with faults: a write cut by the endpoint's death in the middle
of an upload, a writer SIGKILLed mid-upload, a damaged object, a fenced writer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest
import torch
from s3_server import Relay

from tidal.checkpoint import fence, location, remote, store
from tidal.checkpoint.layout import MANIFEST, found_on_disk, step_of
from tidal.checkpoint.writer import AsyncCheckpointer
from tidal.config import JobSpec, storage_error
from tidal.coordinator.records.home import checkpoint_folder
from tidal.coordinator.rules.checkpoint_rules import pruned_records


def model_and_opt(seed: int = 0, width: int = 16):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(5, 8)).sum().backward()
    o.step()
    return m, o


def snapshot(step: int, seed: int = 0, width: int = 16) -> store.Snapshot:
    m, o = model_and_opt(seed, width)
    return store.take_snapshot(step=step, module=m, optimizer=o, meta={"epoch": 0})


def steps_of(paths) -> list[int]:  # noqa: ANN001
    return [step_of(p) for p in paths]


# -- rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "url", "where"),
    [
        ("s3://b/ckpt", True, "s3://b/ckpt"),
        ("s3://b/ckpt/", True, "s3://b/ckpt"),
        ("gs://b", True, "gs://b"),
        ("abfs://container/x", True, "abfs://container/x"),
        ("/shared/ckpt", False, Path("/shared/ckpt")),
        ("relative/dir", False, Path("relative/dir")),
        ("file:///shared/ckpt", False, Path("/shared/ckpt")),
        ("FILE:///x", False, Path("/x")),
    ],
)
def test_a_location_is_a_folder_or_a_url(text, url, where) -> None:
    assert location.of(text) == where
    assert location.is_url(location.of(text)) is url
    assert location.base_name(location.join(location.of(text), "step-00000100")) == "step-00000100"


def test_joining_and_naming_locations() -> None:
    assert location.join("s3://b/c", "job", "step-00000001") == "s3://b/c/job/step-00000001"
    assert location.join(Path("/x"), "job") == Path("/x/job")
    assert step_of("s3://b/c/job/step-00000120") == 120
    assert step_of(Path("/x/step-00000007")) == 7
    with pytest.raises(ValueError, match="not a checkpoint's folder"):
        step_of("s3://b/c/job")
    assert checkpoint_folder(Path("/h"), "j", None) == Path("/h/jobs/j/checkpoints")
    assert checkpoint_folder(Path("/h"), "j", "s3://b/t/") == "s3://b/t/j"
    assert checkpoint_folder(Path("/h"), "j", "/shared") == Path("/shared/j")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("s3://b/x", None),
        ("/shared", None),
        ("file:///", None),
        ("", "must name a folder or a URL"),
        ("s3://", "names no bucket: write s3://BUCKET/PATH"),
        ("gs:///", "names no bucket: write gs://BUCKET/PATH"),
    ],
)
def test_checkpoint_dir_text(text, why) -> None:
    said = storage_error(text)
    assert (said is None) if why is None else (why in said), said


def test_checkpoint_dir_needs_checkpoints() -> None:
    with pytest.raises(ValueError, match="--checkpoint-dir needs --checkpoint-every"):
        JobSpec(name="j", script="/x.py", checkpoint_storage="s3://b/x")
    spec = JobSpec(name="j", script="/x.py", checkpoint_storage="s3://b/x", checkpoint_every=5)
    assert JobSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("folders", "keep", "gone"),
    [
        ([], 3, []),
        ([(10, True), (20, True), (30, True)], 2, [10]),
        ([(10, True), (20, False), (30, True)], 2, [20]),  # an interrupted write, older
        ([(10, True), (20, True), (30, False)], 1, [10]),  # newer: maybe in progress
        ([(10, False)], 1, []),  # nothing complete yet: maybe the first write
        ([(5, False), (10, True), (20, True), (30, True), (40, True)], 3, [5, 10]),
    ],
)
def test_what_a_prune_at_a_url_deletes(folders, keep, gone) -> None:
    assert remote.doomed(folders, keep) == gone


def test_records_of_checkpoints_a_writer_pruned() -> None:
    records = [(10, "/h/c/step-10"), (20, "s3://b/j/step-20"), (30, "s3://b/j/step-30")]
    here = {"/h/c/step-10"}
    assert pruned_records(records, keep=2, exists=here.__contains__) == []
    assert pruned_records(records, keep=1, exists=here.__contains__) == [20]
    assert pruned_records(records, keep=3, exists=lambda p: False) == [10]


def test_a_url_whose_filesystem_is_missing_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"fsspec knows no nosuch:// filesystem"):
        remote.check_url("nosuch://b/x")
    remote.check_url("s3://b/x")  # s3fs is installed (the `s3` extra)
    try:
        import gcsfs  # noqa: F401
    except ImportError:  # not a dependency: its absence is said, with the package to install
        with pytest.raises(ValueError, match=r"gs://b/x needs gcsfs, which is not installed"):
            remote.check_url("gs://b/x")


# -- against the S3 server --------------------------------------------------------------------
def test_a_checkpoint_at_a_url_round_trips_and_lists_like_a_folder(s3) -> None:
    url = s3.url("ckpt", "job")
    written = [store.write(snapshot(step), url) for step in (10, 20)]
    assert [w.path for w in written] == [f"{url}/step-00000010", f"{url}/step-00000020"]
    keys = s3.moto.keys(s3.bucket, "ckpt/job/step-00000020/")
    names = {k.rsplit("/", 1)[1] for k in keys}
    assert names == {MANIFEST, *store.REQUIRED, "tracked.safetensors", "tracked.json"}
    assert steps_of(store.list_checkpoints(url)) == [20, 10]
    path, warnings = store.newest_good(url)
    assert path == f"{url}/step-00000020" and warnings == []
    found = found_on_disk(url)
    assert [(s, p) for s, p, _ in found] == [(10, written[0].path), (20, written[1].path)]
    assert [b for _, _, b in found] == [w.bytes for w in written]
    # Loaded through a local copy: bit for bit what was saved.
    want, _ = model_and_opt(0)
    m, o = model_and_opt(seed=5)
    meta = store.load(path, m, o)
    assert meta["step"] == 20 and meta["epoch"] == 0
    for (name, a), b in zip(m.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # The fence and the job's spec live there too.
    fence.write(url, fence.Fence("e1"))
    fence.write_spec(url, {"name": "job", "workers": 2})
    assert fence.read(url) == fence.Fence("e1")
    assert fence.read_spec(url) == {"name": "job", "workers": 2}
    assert fence.read(s3.url("nothing")) is None and fence.read_spec(s3.url("nothing")) is None


def test_a_write_in_progress_is_not_a_checkpoint(s3) -> None:
    """The files of a write are on the store before its manifest: until it comes, the prefix
    is listed, refused (no manifest) and the previous checkpoint chosen."""
    url = s3.url("inprogress")
    store.write(snapshot(10), url)
    seen = {}

    def during() -> None:
        seen["listed"] = steps_of(store.list_checkpoints(url))
        seen["chosen"] = store.newest_good(url)
        seen["found"] = [s for s, _, _ in found_on_disk(url)]

    store.write(snapshot(20), url, during=during)
    assert seen["listed"] == [20, 10] and seen["found"] == [10]
    path, (warning,) = seen["chosen"]
    assert path == f"{url}/step-00000010"
    assert warning.startswith(f"checkpoint {url}/step-00000020 refused: unreadable manifest")
    assert store.newest_good(url)[0] == f"{url}/step-00000020"  # complete now


def test_a_damaged_object_is_refused_named_by_its_url_and_marked_bad(s3) -> None:
    url = s3.url("damaged")
    store.write(snapshot(10), url)
    newest = store.write(snapshot(20), url).path
    client, key = s3.moto.client(), "damaged/step-00000020/model.safetensors"
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[-3] ^= 0x5A
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))

    path, (warning,) = store.newest_good(url)
    assert path == f"{url}/step-00000010"
    assert warning == f"checkpoint {newest} refused: xxh3_128 mismatch in model.safetensors"
    m, o = model_and_opt()
    with pytest.raises(store.CheckpointError) as err:
        store.load(newest, m, o)
    assert str(err.value).startswith(f"checkpoint {newest} refused") and "/tmp" not in str(
        err.value
    )
    # Marked bad (as a worker does): refused for that, with the object to delete named.
    assert store.mark_bad(newest, str(err.value))
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data[:-3]) + b"\0\0\0")
    _, (warning,) = store.newest_good(url)
    assert "it failed to load before" in warning and f"delete {newest}/BAD" in warning
    assert [s for s, _, _ in found_on_disk(url)] == [10]


def test_a_prune_at_a_url_keeps_the_newest_and_removes_interrupted_writes(s3) -> None:
    url = s3.url("prune")
    for step in (10, 20, 30):
        store.write(snapshot(step), url)
    s3.moto.client().delete_object(Bucket=s3.bucket, Key=f"prune/step-00000020/{MANIFEST}")
    s3.moto.client().put_object(Bucket=s3.bucket, Key="prune/step-00000040/model.safetensors")
    assert steps_of(store.list_checkpoints(url)) == [40, 30, 20, 10]
    gone = store.prune(url, keep=1)
    assert steps_of(gone) == [10, 20]  # 40 is newer than every complete one: maybe writing
    assert steps_of(store.list_checkpoints(url)) == [40, 30]
    assert not s3.moto.keys(s3.bucket, "prune/step-00000010/")


def test_the_async_writer_keeps_k_at_a_url(s3) -> None:
    url = s3.url("async")
    written = []
    writer = AsyncCheckpointer(location.of(url), keep=2, on_written=written.append)
    m, o = model_and_opt()
    for step in (10, 20, 30):
        writer.save(step=step, module=m, optimizer=o, meta={})
    writer.wait()
    assert [w.step for w in written] == [10, 20, 30]
    assert steps_of(store.list_checkpoints(url)) == [30, 20, 10]  # pruned as a write begins
    writer.close()
    assert steps_of(store.list_checkpoints(url)) == [30, 20]


def test_a_fenced_writer_neither_publishes_nor_prunes_at_a_url(s3) -> None:
    url = s3.url("fenced")
    fence.write(url, fence.Fence("old"))
    store.write(snapshot(10), url, fence="old")
    fence.write(url, fence.Fence("new"))  # `tidal resume`: a new run owns the folder
    new = store.write(snapshot(20, seed=1), url, fence="new")
    before = s3.moto.keys(s3.bucket, "fenced/")
    # The old run's writes touch nothing: not the new run's checkpoint of the same step (a
    # write at a URL lands where the owner's does), not its prune.
    for step in (20, 30):
        with pytest.raises(fence.Fenced, match="owns its checkpoints"):
            store.write(snapshot(step), url, fence="old")
    assert store.prune(url, keep=1, fence="old") == []
    assert s3.moto.keys(s3.bucket, "fenced/") == before
    assert store.newest_good(url) == (new.path, [])


BIG = 1 << 20  # a width that makes the model's file ~16 MiB: a multipart upload of 4 parts


@pytest.mark.timeout(60)
def test_an_endpoint_that_dies_mid_upload_leaves_no_complete_checkpoint(s3, monkeypatch) -> None:
    """The store's endpoint SIGKILLed in the middle of a multipart upload (the relay the
    writer talks to dies after 6 MiB of the model's 16): the write fails in bounded time
    with one line naming the URL, and what it left on the store (moto, alive behind the
    relay) is no checkpoint: the previous one is chosen, and the next prune removes it."""
    # fsspec's configuration (what FSSPEC_S3_DEFAULT_BLOCK_SIZE sets in a new process).
    monkeypatch.setitem(fsspec.config.conf, "s3", {"default_block_size": 5 << 20})
    url = s3.url("cut")
    store.write(snapshot(10), url)
    relay = Relay(s3.moto.port, die_after=6 << 20)
    try:
        s3.use(monkeypatch, relay.endpoint)
        snap = snapshot(20, width=BIG // 4)
        started = time.monotonic()
        with pytest.raises(OSError) as err:
            store.write(snap, url)
        took = time.monotonic() - started
        assert relay.proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        relay.close()
    said = str(err.value)
    assert "\n" not in said and took < 30, (took, said)
    s3.use(monkeypatch, s3.moto.endpoint)
    # A partial upload: the model's multipart upload begun, never completed (not listed).
    assert s3.moto.pending_uploads(s3.bucket) == ["cut/step-00000020/model.safetensors"]
    assert not s3.moto.keys(s3.bucket, f"cut/step-00000020/{MANIFEST}")
    path, warnings = store.newest_good(url)
    assert path == f"{url}/step-00000010", warnings
    assert [s for s, _, _ in found_on_disk(url)] == [10]
    store.write(snapshot(30), url)
    store.prune(url, keep=3)
    assert steps_of(store.list_checkpoints(url)) == [30, 10]


WRITER = """
import sys, torch
from tidal.checkpoint import store
m = torch.nn.Linear(2048, 2048)  # 16 MiB of parameters: a multipart upload of 4 parts
snap = store.take_snapshot(step=20, module=m,
                           optimizer=torch.optim.SGD(m.parameters(), lr=0.1), meta={})
print("ready", flush=True)
store.write(snap, sys.argv[1])
print("written", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_writer_killed_mid_upload_leaves_no_complete_checkpoint(s3, monkeypatch) -> None:
    """A writer SIGKILLed once its upload began (the model's multipart upload has parts on
    the store, never completed): nothing of step 20 looks complete, the previous checkpoint
    is chosen, and the next write's prune removes the remains."""
    monkeypatch.setenv("FSSPEC_S3_DEFAULT_BLOCK_SIZE", str(5 << 20))
    url = s3.url("killed")
    store.write(snapshot(10), url)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while not s3.moto.pending_uploads(s3.bucket) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert s3.moto.pending_uploads(s3.bucket), "the writer's upload never began"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    path, warnings = store.newest_good(url)
    assert path == f"{url}/step-00000010", warnings
    assert not s3.moto.keys(s3.bucket, f"killed/step-00000020/{MANIFEST}")
    store.write(snapshot(30), url)
    store.prune(url, keep=3)
    assert steps_of(store.list_checkpoints(url)) == [30, 10]


def test_a_sharded_checkpoint_is_written_by_its_members_at_a_url(s3) -> None:
    """``sharding="fsdp"``: every member's rows go to the final prefix, rank 0's manifest
    last; it verifies and rolls back from the URL (a 1-rank group in this process)."""
    import test_sharded_checkpoint as sharded_tests
    import torch.distributed as dist

    from tidal.worker.sharded.checkpoint import load_for_roll_back, save_sharded

    url = s3.url("sharded")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = sharded_tests._model()
        opt = sharded_tests._trained(model)
        sm = sharded_tests.ShardedModel(model, opt)
        held = sm.held()
        sm.build(
            layout=sharded_tests.Layout(gen=1, world=1, rank=0),
            rows=held.rows,
            replicated={
                "buffers": held.buffers,
                "scalars": held.scalars,
                "param_groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
                ],
            },
            guard=sharded_tests.Guard(),
        )
        posted = sharded_tests.Posted()
        save_sharded(sm, directory=url, step=7, position={"epoch": 0}, tracked=None, keep=2,
                     agent=posted)  # fmt: skip
        assert not posted.failed and [v.path for v in posted.written] == [f"{url}/step-00000007"]
        manifest = json.loads(remote.read_bytes(f"{url}/step-00000007/{MANIFEST}"))
        assert manifest["layout"] == "sharded" and manifest["shards"] == 1
        assert store.newest_good(url)[0] == f"{url}/step-00000007"
        assert load_for_roll_back(sm, f"{url}/step-00000007", gen=2, tracked=None) == 7
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--checkpoint-dir", "s3://b/x"], "--checkpoint-dir needs --checkpoint-every N"),
        (["--checkpoint-dir", "nosuch://b/x", "--checkpoint-every", "5"], "no nosuch://"),
        (["--checkpoint-dir", "s3://", "--checkpoint-every", "5"], "names no bucket"),
    ],
)
def test_tidal_run_refuses_a_bad_checkpoint_dir_in_one_line(tmp_path, capsys, flags, says):
    from tidal.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["run", "--home", str(tmp_path / "home"), *flags, str(script)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tidal: error: ") and says in line, line
    assert not (tmp_path / "home").exists()  # nothing recorded
