"""The bench's pure pieces (no processes, no timing): rows and their contract, the split of
a rescale's generations into joins and leaves, recovery at equal world sizes, wall-clock
throughput, the peers' configurations and the results file's fields."""

from __future__ import annotations

import math

import pytest

from bench import peers
from bench.common import Rec
from bench.results import record
from bench.rows import (
    FIELDS,
    back_at_world,
    failed,
    public,
    row,
    split_by_direction,
    summary,
    wall_clock_rate,
)


def test_a_row_names_its_peer_and_its_ratio_favours_tidal() -> None:
    t = row("x", 2.0, 4.0, "s", higher_is_better=False, peer_name="torchrun", peer_config="c")
    assert t["ratio"] == 2.0 and t["peer_name"] == "torchrun" and t["peer_config"] == "c"
    r = row("y", 3.0, 2.0, "samples/s", higher_is_better=True, peer_name="ddp", peer_config={})
    assert r["ratio"] == 1.5
    assert set(public(r)) == set(FIELDS)


def test_a_row_without_a_peer_has_no_ratio() -> None:
    r = row("c", 0.4, None, "cores", higher_is_better=False, peer_name="none", peer_config="why")
    assert r["ratio"] is None and r["peer"] is None
    f = failed("torchft_join", "s", peer_name="torchft", reason="not installed")
    assert (f["tidal"], f["peer"], f["ratio"]) == (None, None, None)
    assert f["peer_config"] == "not installed" and f["peer_name"] == "torchft"
    nan = row("n", float("nan"), 1.0, "s", higher_is_better=False, peer_name="p", peer_config="")
    assert nan["ratio"] is None


def test_samples_are_kept_apart_from_the_contract() -> None:
    r = row("x", 1.0, 2.0, "s", higher_is_better=False, peer_name="p", peer_config="c",
            tidal_samples=[1.0, 3.0], peer_samples=[2.0])  # fmt: skip
    assert r["_samples"] == {"tidal": [1.0, 3.0], "peer": [2.0]}
    assert "_samples" not in public(r)
    assert summary([3.0, 1.0, 2.0]) == {"n": 3, "min": 1.0, "p50": 2.0, "p90": 2.8, "max": 3.0}
    assert summary([]) == {"n": 0}


def _gen(i: int, world: int, pause: float | None) -> dict:
    return {"id": i, "world_size": world, "pause_s": pause}


def test_joins_and_leaves_are_split_by_the_change_of_size() -> None:
    gens = [_gen(3, 2, 0.03), _gen(1, 2, None), _gen(2, 3, 0.05), _gen(4, 3, 0.06),
            _gen(5, 3, 0.9), _gen(6, 1, None), _gen(7, 2, 0.07)]  # fmt: skip
    joins, leaves = split_by_direction(gens)
    # 1->2 (first: neither), 2->3 join, 3->2 leave, 2->3 join, 3->3 neither, 3->1 no pause,
    # 1->2 join
    assert joins == [0.05, 0.06, 0.07] and leaves == [0.03]


def _recs(steps: list[tuple[float, int, int]]) -> list[Rec]:
    """(time, world, pid) of each step end."""
    return [Rec("E", t, i, w, 0, pid) for i, (t, w, pid) in enumerate(steps)]


def test_recovery_at_equal_world_size_waits_for_a_new_process_at_that_size() -> None:
    # kill at 10.0; pid 1 survives alone (world 1), replacement pid 3 joins at 12.5
    recs = _recs([(9.0, 2, 1), (9.5, 2, 2), (10.2, 2, 1), (11.0, 1, 1), (12.5, 2, 3),
                  (12.5, 2, 1)])  # fmt: skip
    assert back_at_world(recs, 10.0, 2) == (9.5, 12.5)
    assert back_at_world(recs[:4], 10.0, 2) is None  # not back yet
    assert back_at_world(recs, 1.0, 2) is None  # nothing before the kill


def test_throughput_counts_every_step_of_the_window() -> None:
    # 11 steps: after the first fifth (2 skipped), 8 intervals: six of 0.1 s, two of 0.5 s
    times = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.3, 1.8]
    recs = _recs([(t, 2, 1) for t in times])
    got = wall_clock_rate(recs, 2, batch=64)
    assert got["steps"] == 8 and got["span_s"] == pytest.approx(1.6)
    assert got["samples_per_s"] == pytest.approx(8 * 64 / 1.6)  # the slow steps count
    assert got["median_step_s"] == pytest.approx(0.1)  # the median would hide them
    with pytest.raises(ValueError):
        wall_clock_rate(recs[:2], 2, batch=64)


def test_torchrun_runs_with_its_rendezvous_tuned() -> None:
    opts = peers.torchrun_opts()
    conf = opts[0].removeprefix("--rdzv-conf=")
    got = dict(kv.split("=") for kv in conf.split(","))
    assert set(got) == {"join_timeout", "last_call_timeout", "close_timeout",
                        "keep_alive_interval", "keep_alive_max_attempt"}  # fmt: skip
    assert all(int(v) >= 1 for v in got.values())  # integer seconds, as torch parses them
    assert int(got["keep_alive_interval"]) * int(got["keep_alive_max_attempt"]) <= 3
    assert peers.TORCHRUN_ELASTIC["rdzv_conf"] == {k: int(v) for k, v in got.items()}
    assert opts[1] == "--monitor-interval=0.1"


def test_the_results_file_has_the_runs_facts_and_every_row() -> None:
    rows = [
        row("rescale_join_p50", 0.05, 3.0, "s", higher_is_better=False, peer_name="torchrun",
            peer_config=peers.TORCHRUN_ELASTIC, tidal_samples=[0.05], peer_samples=[3.0]),
        row("cp_cpu", 0.3, None, "cores", higher_is_better=False, peer_name="none",
            peer_config="budget"),
    ]  # fmt: skip
    data = record(rows, run="full", measurements=["rescale"], errors=[], commit="abc1234",
                  dirty=False, date="2026-12-10", torch_version="2.13.0+cpu")  # fmt: skip
    assert {"date", "commit", "dirty", "run", "measurements", "machine", "python", "torch",
            "peers", "rows", "errors"} <= set(data)  # fmt: skip
    assert data["machine"]["cpus"] >= 1 and data["machine"]["model"]
    assert data["peers"] == {"torchrun": [peers.TORCHRUN_ELASTIC], "none": ["budget"]}
    first, second = data["rows"]
    assert set(first) == {*FIELDS, "samples"}
    assert first["samples"]["tidal"]["p50"] == 0.05 and first["samples"]["peer"]["n"] == 1
    assert second["samples"] == {"tidal": {"n": 0}, "peer": {"n": 0}}
    assert not math.isnan(first["ratio"])


def test_every_measurement_expects_named_rows() -> None:
    from bench.__main__ import MEASUREMENTS, RUNNERS

    assert set(MEASUREMENTS) == set(RUNNERS)
    names = [n for m in MEASUREMENTS for n in RUNNERS[m][1]]
    assert len(names) == len(set(names))
    assert {"rescale_join_p50", "rescale_leave_p50", "recovery_same_world_p50",
            "checkpoint_stall_floor_pct", "torchft_recovery"} <= set(names)  # fmt: skip


def test_the_results_plot_draws_each_row_with_samples_on_both_sides(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from bench.results import plot

    rows = [
        {
            "name": "recovery_p50",
            "unit": "s",
            "peer_name": "torchrun",
            "_samples": {"tidal": [0.07, 0.08, 0.09], "peer": [3.1, 3.4]},
        },  # fmt: skip
        {"name": "no_peer", "unit": "s", "peer_name": "none", "_samples": {"tidal": [1.0]}},
    ]
    path = plot(rows, tmp_path / "run.png")
    assert path == tmp_path / "run.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot(rows[1:], tmp_path / "none.png") is None  # no row with both sides: nothing
    assert not (tmp_path / "none.png").exists()


def test_a_second_run_of_a_commit_on_a_day_gets_its_own_file(tmp_path) -> None:
    from bench.results import free_name

    first = free_name(tmp_path, "2026-12-07-abc1234")
    assert first.name == "2026-12-07-abc1234.json"
    first.write_text("{}")
    second = free_name(tmp_path, "2026-12-07-abc1234")
    assert second.name == "2026-12-07-abc1234-2.json"
    second.write_text("{}")
    assert free_name(tmp_path, "2026-12-07-abc1234").name == "2026-12-07-abc1234-3.json"


def test_the_page_table_shows_both_runs_and_judges_each_goal() -> None:
    from bench.page import table

    def run(commit: str, ratio: float) -> dict:
        row = {"name": "throughput_ws1", "tidal": 100.0 * ratio, "peer": 100.0, "unit":
               "samples/s", "ratio": ratio, "peer_name": "ddp"}  # fmt: skip
        extra = {"name": "cold_start", "tidal": 2.0, "peer": 3.0, "unit": "s", "ratio": 1.5,
                 "peer_name": "torchrun"}  # fmt: skip
        return {"commit": commit, "rows": [row] + ([extra] if commit == "b" else [])}

    lines = table([run("a", 0.99), run("b", 0.97)]).splitlines()
    assert lines[0].startswith("| row | peer | a: Tidal | a: peer | a: ratio | b: Tidal")
    (thr,) = [line for line in lines if "`throughput_ws1`" in line]
    assert "| ddp | 99 | 100 | 0.99 | 97 | 100 | 0.97 |" in thr
    assert thr.endswith("ratio >= 0.98 (met / NOT met) |"), thr
    (cold,) = [line for line in lines if "`cold_start`" in line]
    assert "|  |  |  | 2 | 3 | 1.5 |" in cold  # a row only the second run has
    # two runs of one commit are told apart by their order
    head = table([run("a", 0.99), run("a", 0.97)]).splitlines()[0]
    assert head.startswith(
        "| row | peer | a (1): Tidal | a (1): peer | a (1): ratio | a (2): Tidal"
    )
