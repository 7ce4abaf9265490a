"""The rules of resharding in process (issue 16): FSDP2's dim-0 layout at any world size,
and the rows a resize moves between the members of the new group. Milliseconds, no
processes (``tidal.worker.sharded.layout``; the layout was checked against ``fully_shard``)."""

from __future__ import annotations

import random

import pytest

from tidal.worker.sharded.layout import Move, ShardsLost, check_shardable, plan, shard_range


@pytest.mark.parametrize(
    "rows, world, ranges",
    [
        (16, 2, [(0, 8), (8, 16)]),
        (5, 3, [(0, 2), (2, 4), (4, 5)]),  # fully_shard on gloo: 2, 2, 1 rows
        (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),  # and 2, 2, 1, 0: the last rank is empty
        (3, 5, [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]),
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_the_layout_is_torch_chunks(rows, world, ranges):
    assert [shard_range(rows, world, r) for r in range(world)] == ranges


@pytest.mark.parametrize("rows, world, rank", [(5, 0, 0), (5, 2, 2), (5, 2, -1), (-1, 2, 0)])
def test_no_shard_outside_the_world(rows, world, rank):
    with pytest.raises(ValueError, match="no shard"):
        shard_range(rows, world, rank)


def test_a_joiner_receives_only_its_shard_and_survivors_only_what_they_lack():
    # 2 -> 3: the survivors keep ranks 0 and 1; the joiner is rank 2.
    assert plan(12, 2, 3, [0, 1]) == [
        Move(src=0, dst=0, start=0, stop=4, old=0),  # a local copy
        Move(src=0, dst=1, start=4, stop=6, old=0),
        Move(src=1, dst=1, start=6, stop=8, old=1),
        Move(src=1, dst=2, start=8, stop=12, old=1),
    ]


def test_a_member_may_hold_several_old_shards():
    # 3 -> 2: old rank 0 is new rank 1, old rank 1 is new rank 0, and old rank 2's rows are
    # held by new rank 1 too (the leaver handed them over, or a neighbour's copy).
    assert plan(6, 3, 2, [1, 0, 1]) == [
        Move(src=1, dst=0, start=0, stop=2, old=0),
        Move(src=0, dst=0, start=2, stop=3, old=1),
        Move(src=0, dst=1, start=3, stop=4, old=1),
        Move(src=1, dst=1, start=4, stop=6, old=2),
    ]


def test_rows_nobody_holds_are_named():
    with pytest.raises(ShardsLost) as info:
        plan(12, 3, 1, [0, None, None])
    assert info.value.rows == [(4, 8), (8, 12)]


def test_moves_rebuild_every_new_shard_exactly_for_any_resize():
    rng = random.Random(0)
    for _ in range(500):
        rows = rng.randint(0, 40)
        old, new = rng.randint(1, 7), rng.randint(1, 7)
        holders = [rng.randrange(new) for _ in range(old)]
        full = list(range(100, 100 + rows))
        held = {}  # new rank -> {row: value} it holds in the old layout
        for i, h in enumerate(holders):
            a, b = shard_range(rows, old, i)
            held.setdefault(h, {}).update({r: full[r] for r in range(a, b)})
        got = {d: {} for d in range(new)}
        for m in plan(rows, old, new, holders):
            got[m.dst].update({r: held[m.src][r] for r in range(m.start, m.stop)})
        for d in range(new):
            a, b = shard_range(rows, new, d)
            assert [got[d][r] for r in sorted(got[d])] == full[a:b], (rows, old, new, holders)


RESHARD = r"""
import json, sys, datetime, torch, torch.distributed as dist
from tidal.worker.sharded.layout import reshard, shard_range
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
full = torch.arange(13 * 2, dtype=torch.float64).reshape(13, 2)
out = {}
# 2 -> 3: ranks 0 and 1 held old shards 1 and 0 (the survivors swapped ranks); rank 2 joins
holders = [1, 0]
held = {o: full[slice(*shard_range(13, 2, o))].clone() for o, h in enumerate(holders) if h == rank}
mine = reshard(full[:0], held, rows=13, old_world=2, new_world=3, holders=holders, rank=rank)
out["grow"] = torch.equal(mine, full[slice(*shard_range(13, 3, rank))])
# 3 -> 3 with rank 2 holding two old shards and rank 1 none (a neighbour's copy of 1's)
holders = [0, 2, 2]
held = {o: full[slice(*shard_range(13, 3, o))].clone() for o, h in enumerate(holders) if h == rank}
mine = reshard(full[:0], held, rows=13, old_world=3, new_world=3, holders=holders, rank=rank)
out["copy"] = torch.equal(mine, full[slice(*shard_range(13, 3, rank))])
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_reshard_moves_the_rows_over_real_gloo_point_to_point():
    from ranks import run_ranks

    for out in run_ranks(RESHARD, 3, timeout=60):
        assert out == {"grow": True, "copy": True}


@pytest.mark.parametrize(
    ("shapes", "world", "error"),
    [
        ({"w": (6, 4), "b": (6,)}, 6, None),
        ({"w": (6, 4), "b": (2,)}, 4, None),  # small ones pad: FSDP2's uneven shards
        ({"w": (6, 4), "b": (6,)}, 7, "7 workers is more than .* \\(6, 'w'\\)"),
        ({"w": (6, 4), "s": ()}, 2, "parameter 's' is a scalar"),
        ({}, 1, "no parameters"),
    ],
)
def test_a_model_sharding_cannot_serve_is_one_line(shapes, world, error):
    if error is None:
        check_shardable(shapes, world)
        return
    with pytest.raises(ValueError, match=error) as info:
        check_shardable(shapes, world)
    assert "\n" not in str(info.value)
