"""tidal.data.TokenShards: windows over flat token files, by global index; write_tokens."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import tidal
from tidal.data import TokenShards, write_tokens


def reference(arrays: list[np.ndarray], seq_len: int) -> list[list[int]]:
    """Every window of every file by plain slicing, in global order."""
    out = []
    for a in arrays:
        for j in range((len(a) - 1) // seq_len):
            out.append(a[j * seq_len : j * seq_len + seq_len + 1].astype(np.int64).tolist())
    return out


def tokens(n: int, high: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, n)


CASES = {
    # name: (files as (suffix, dtype written, token count), dtype argument, seq_len)
    "one_bin_uint16": ([(".bin", "uint16", 1000)], None, 16),
    "three_bin_uint16": (
        [(".bin", "uint16", 100), (".bin", "uint16", 37), (".bin", "uint16", 65)],
        None,
        8,
    ),
    "two_bin_uint32": ([(".bin", "uint32", 300), (".bin", "uint32", 301)], "uint32", 10),
    "uint32_torch_dtype": ([(".bin", "uint32", 50)], torch.uint32, 7),
    "npy_mixed_dtypes": (
        [(".npy", "uint16", 90), (".npy", "uint32", 41), (".npy", "int32", 12)],
        None,
        11,
    ),
    "bin_then_npy": ([(".bin", "uint16", 64), (".npy", "uint32", 64)], None, 9),
    "exact_fit": ([(".bin", "uint16", 17), (".bin", "uint16", 33)], None, 16),  # 1 and 2 windows
    "seq_len_1": ([(".bin", "uint16", 5), (".npy", "uint16", 2)], None, 1),
    "window_is_whole_file": ([(".bin", "uint16", 9)], None, 8),
}


@pytest.mark.parametrize("case", CASES)
def test_windows_equal_reference_slicing(tmp_path: Path, case: str) -> None:
    files, dtype, seq_len = CASES[case]
    arrays, paths = [], []
    for k, (suffix, file_dtype, n) in enumerate(files):
        high = 2**32 if file_dtype == "uint32" else 2**16 if file_dtype == "uint16" else 2**31
        a = tokens(n, high, seed=k).astype(file_dtype)
        paths.append(write_tokens(tmp_path / f"f{k}{suffix}", a, dtype=file_dtype))
        arrays.append(a)
    ds = TokenShards(paths, seq_len, dtype=dtype)
    ref = reference(arrays, seq_len)
    assert len(ds) == len(ref) == sum((n - 1) // seq_len for _, _, n in files)
    got = [ds[i] for i in range(len(ds))]
    assert all(w.dtype == torch.int64 and w.shape == (seq_len + 1,) for w in got)
    assert [w.tolist() for w in got] == ref
    assert ds[-1].tolist() == ref[-1] and ds[np.int64(0)].tolist() == ref[0]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds[-len(ds) - 1]


def test_layout_windows_overlap_by_one_and_never_cross_files(tmp_path: Path) -> None:
    a = write_tokens(tmp_path / "a.bin", np.arange(0, 21))  # 21 tokens: 2 windows of 8 (+1)
    b = write_tokens(tmp_path / "b.bin", np.arange(100, 110))  # 10 tokens: 1 window
    ds = TokenShards([a, b], 8)
    assert len(ds) == 3
    assert ds[0].tolist() == list(range(0, 9))
    assert ds[1].tolist() == list(range(8, 17))  # shares token 8 with window 0
    assert ds[2].tolist() == list(range(100, 109))  # file b's first window, not a's tail
    assert ds.locate(2) == (b, 0) and ds.locate(1) == (a, 8)
    assert ds.tokens == 31 and ds.paths == [a, b]
    assert TokenShards(str(a), 8)[1].tolist() == ds[1].tolist()  # one path, as a string


def test_reachable_as_tidal_data_and_nothing_loaded(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", np.arange(1000))
    ds = tidal.data.TokenShards([path], 10)
    assert all(s._map is None for s in ds.shards)  # nothing mapped until a window is read
    ds[5]
    assert isinstance(ds.shards[0]._map, np.memmap) and not ds.shards[0]._map.flags.writeable


def write_raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def npy_bytes(ids, dtype: str = "uint16") -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(list(ids), dtype))
    return buf.getvalue()


def save_npy(path: Path, array: np.ndarray) -> Path:
    np.save(path, array)
    return path


BAD = {
    # name: (setup(tmp) -> (paths, seq_len, dtype), the line's expected fragments)
    "size_not_multiple_of_dtype": (
        lambda t: ([write_raw(t / "odd.bin", b"\0" * 101)], 8, None),
        ["odd.bin", "101 bytes is not a multiple of uint16's 2 bytes"],
    ),
    "size_not_multiple_of_uint32": (
        lambda t: ([write_raw(t / "u32.bin", b"\0" * 102)], 8, "uint32"),
        ["u32.bin", "102 bytes is not a multiple of uint32's 4 bytes"],
    ),
    "window_longer_than_file": (
        lambda t: (
            [write_tokens(t / "ok.bin", range(100)), write_tokens(t / "short.bin", range(8))],
            8,
            None,
        ),
        ["short.bin", "8 tokens, fewer than one window of seq_len + 1 = 9"],
    ),
    "empty_file": (
        lambda t: ([write_raw(t / "empty.bin", b"")], 4, None),
        ["empty.bin", "0 tokens, fewer than one window"],
    ),
    "missing_file": (
        lambda t: ([write_tokens(t / "a.bin", range(100)), t / "nope.bin"], 8, None),
        ["nope.bin", "no such file"],
    ),
    "a_folder": (lambda t: ([t], 8, None), ["is not a file"]),
    "unsupported_dtype": (
        lambda t: ([write_tokens(t / "a.bin", range(100))], 8, "float32"),
        ["dtype argument", "unsupported dtype float32", "uint16, uint32"],
    ),
    "uint64_unsupported": (
        lambda t: ([write_tokens(t / "a.bin", range(100))], 8, np.uint64),
        ["unsupported dtype uint64"],
    ),
    "unknown_dtype_name": (
        lambda t: ([write_tokens(t / "a.bin", range(100))], 8, "nonsense"),
        ["unsupported dtype 'nonsense'"],
    ),
    "npy_of_floats": (
        lambda t: ([save_npy(t / "f.npy", np.zeros(50, np.float32))], 8, None),
        ["f.npy", "unsupported dtype float32"],
    ),
    "npy_not_flat": (
        lambda t: ([save_npy(t / "m.npy", np.zeros((5, 10), np.uint16))], 8, None),
        ["m.npy", "flat array", "(5, 10)"],
    ),
    "npy_dtype_disagrees": (
        lambda t: ([write_tokens(t / "a.npy", range(100), dtype="uint32")], 8, "uint16"),
        ["a.npy", "holds uint32, not dtype=uint16"],
    ),
    "npy_truncated": (
        lambda t: ([write_raw(t / "cut.npy", npy_bytes(range(100))[:-6])], 8, None),
        ["cut.npy", "header says 100 uint16 tokens", "truncated"],
    ),
    "npy_garbage": (
        lambda t: ([write_raw(t / "g.npy", b"not a numpy file at all")], 8, None),
        ["g.npy", "not a readable .npy file"],
    ),
    "seq_len_zero": (
        lambda t: ([write_tokens(t / "a.bin", range(100))], 0, None),
        ["seq_len must be an integer >= 1, got 0"],
    ),
    "seq_len_float": (
        lambda t: ([write_tokens(t / "a.bin", range(100))], 8.0, None),
        ["seq_len must be an integer >= 1, got 8.0"],
    ),
    "no_paths": (lambda t: ([], 8, None), ["no paths given"]),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    setup, fragments = BAD[case]
    paths, seq_len, dtype = setup(tmp_path)
    with pytest.raises(ValueError) as info:
        TokenShards(paths, seq_len, dtype=dtype)
    message = str(info.value)
    assert "\n" not in message and message.startswith("TokenShards: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_pickle_round_trip_reopens_without_carrying_the_bytes(tmp_path: Path) -> None:
    paths = [write_tokens(tmp_path / f"{k}.bin", tokens(50_000, 2**16, k)) for k in range(2)]
    ds = TokenShards(paths, 64)
    before = [ds[i].tolist() for i in (0, 500, len(ds) - 1)]  # maps both files
    blob = pickle.dumps(ds)
    assert len(blob) < 2_000  # the 200 kB of tokens stay on disk
    copy = pickle.loads(blob)
    assert len(copy) == len(ds)
    assert [copy[i].tolist() for i in (0, 500, len(ds) - 1)] == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_worker_processes_yield_the_same_windows(tmp_path: Path, context: str) -> None:
    arrays = [tokens(n, 2**16, k).astype(np.uint16) for k, n in enumerate((400, 333, 129))]
    paths = [write_tokens(tmp_path / f"{k}.bin", a) for k, a in enumerate(arrays)]
    ds = TokenShards(paths, 16)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    loader = DataLoader(
        ds, batch_size=5, sampler=order, num_workers=2, multiprocessing_context=context
    )
    got = torch.cat(list(loader)).tolist()
    ref = reference(arrays, 16)
    assert got == [ref[i] for i in order]


def test_write_tokens_refuses_ids_that_do_not_fit(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"ids range over \[0, 70000\], outside uint16's"):
        write_tokens(tmp_path / "t.bin", [0, 70000])
    with pytest.raises(ValueError, match=r"ids range over \[-1, 3\]"):
        write_tokens(tmp_path / "t.bin", np.array([-1, 3]), dtype="uint32")
    with pytest.raises(ValueError, match="must be integers"):
        write_tokens(tmp_path / "t.bin", [0.5])
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_write_tokens_is_raw_or_npy_and_atomic(tmp_path: Path) -> None:
    t = torch.tensor([1, 2, 70000])
    raw = write_tokens(tmp_path / "d" / "t.bin", t, dtype=np.uint32)  # makes the folder
    assert raw.read_bytes() == np.array([1, 2, 70000], np.uint32).tobytes()
    npy = write_tokens(tmp_path / "t.npy", t, dtype="uint32")
    assert np.load(npy).dtype == np.uint32 and np.load(npy).tolist() == [1, 2, 70000]
    write_tokens(raw, [7, 8], dtype="uint32")  # replaced whole
    assert np.fromfile(raw, np.uint32).tolist() == [7, 8]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["t.bin"]  # no temp files
