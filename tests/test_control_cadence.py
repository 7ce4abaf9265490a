"""The control word rides on some steps only (``worker.ddp``'s module doc): every member of
a generation carries it on the same steps, the first step of each generation carries one,
and a change asked for between two words (``tidal scale``) still takes effect.

A real job (``examples/digits.py``: steps of a few milliseconds, so words are many steps
apart); a ``sitecustomize`` of this test's own, on the workers' ``PYTHONPATH``, wraps
``ElasticLoop.before_sync`` to append, for each step, whether it carried a word (the library
reads nothing of it)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from e2e_helpers import Home, call_log, summarize

SITE = """
import os
from tidal.worker.trainer import elastic as _elastic

# Once per process (the zygote's interpreter may run this again: then it is wrapped already).
if os.environ.get("CADENCE_LOG") and not hasattr(_elastic.ElasticLoop.before_sync, "logged"):
    _plain = _elastic.ElasticLoop.before_sync

    def before_sync(self, step):
        m = self.parts.membership
        word = m.ddp is not None and (self.next_word is None or step.index >= self.next_word)
        with open(os.environ["CADENCE_LOG"], "a") as f:
            f.write(f"{self.parts.link.worker_id} {m.generation} {step.index} {word:d}\\n")
        return _plain(self, step)

    before_sync.logged = True
    _elastic.ElasticLoop.before_sync = before_sync
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_members_carry_the_word_on_the_same_steps_and_a_scale_between_words_lands(
    tidal_home: Home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = call_log(tmp_path, monkeypatch, SITE, "CADENCE_LOG")
    job = tidal_home.start(
        "cadence", "--workers", "2", "--max-workers", "3", script_args=["--max-steps", "3000"]
    )
    status = job.wait_running(min_step=200, timeout=60)
    assert job.scale(3).returncode == 0
    status = job.wait_for(
        lambda s: any(g["world_size"] == 3 and g["pause_s"] is not None for g in s["generations"]),
        60,
        "the scale-up to take effect",
    )
    assert job.stop().returncode == 0
    status = job.wait_state("stopped", "succeeded", "failed", timeout=60)
    assert status["state"] == "stopped", summarize(status)

    steps: dict[int, dict[int, dict[int, bool]]] = defaultdict(lambda: defaultdict(dict))
    for line in log.read_text().splitlines():
        wid, gen, index, word = map(int, line.split())
        steps[gen][wid][index] = bool(word)  # a redone step: its last time counts
    formed = {g["id"]: g for g in status["generations"] if g["start_step"] is not None}
    assert len(formed) >= 2, summarize(status)
    for gid, g in formed.items():
        members = steps[gid]
        assert set(members) == set(g["members"]), (gid, sorted(members))
        ran = set.intersection(*(set(m) for m in members.values()))
        words = {wid: sorted(i for i in ran if m[i]) for wid, m in members.items()}
        # Every member carries a word on the same steps, the generation's first among them.
        assert len({tuple(w) for w in words.values()}) == 1, (gid, words)
        (carried,) = {tuple(w) for w in words.values()}
        assert carried and carried[0] == min(ran) == g["start_step"], (gid, carried[:5])
        # Steps of a few milliseconds: the words ride many steps apart, not on every step.
        if len(ran) > 100:
            assert len(carried) < len(ran) / 4, (gid, len(carried), len(ran))
