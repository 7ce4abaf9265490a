"""``tidal resume``'s worker counts follow ``tidal run``'s rule (issue 50).

Before: ``tidal resume JOB --max-workers 1 --workers 2`` resumed with 2 workers and
``--max-workers 2``: the resume raised the given ``--max-workers`` to fit ``--workers``
(``max(workers, args.max_workers or recorded)``), where ``tidal run`` refuses the same flags.
Now ``launch.resume_counts`` keeps what is given as given and ``JobSpec`` refuses it in
``run``'s words, before the previous run's workers are ended or anything is recorded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from e2e_helpers import Home, summarize

from tidal.launch import resume_counts

SAVED = {"workers": 2, "max_workers": 3, "min_workers": 2}


@pytest.mark.parametrize(
    ("workers", "max_workers", "counts"),
    [
        (None, None, (2, 3, 2)),  # the recorded counts
        (3, None, (3, 3, 2)),
        (4, None, (4, 4, 2)),  # no --max-workers: raised to --workers, as run's default
        (1, None, (1, 3, 1)),  # --min-workers lowered: resume has no flag for it
        (None, 5, (2, 5, 2)),
        (2, 1, (2, 1, 2)),  # given: kept as given, for JobSpec to refuse (before: (2, 2, 2))
        (None, 1, (2, 1, 2)),  # the recorded 2 workers over --max-workers 1: refused too
        (3, 0, (3, 0, 2)),  # 0 is a value, not "not given" (before: the recorded 3)
    ],
)
def test_resume_counts(workers, max_workers, counts) -> None:
    got = resume_counts(SAVED, workers=workers, max_workers=max_workers)
    assert (got["workers"], got["max_workers"], got["min_workers"]) == counts


# Checkpoints every 2 steps, then the script raises at its 5th: a failed job to resume.
FAILS_AT_5 = """
import torch, tidal
from torch.utils.data import TensorDataset
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
trainer = tidal.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                        global_batch_size=8)
for n, step in enumerate(trainer.run(1000)):
    if n == 5:
        raise SystemExit(3)
    for x, y in step.micro_batches():
        step.backward(torch.nn.functional.cross_entropy(trainer.model(x), y))
"""


def files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_refuses_more_workers_than_max_workers_and_keeps_the_job(
    tidal_home: Home, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(FAILS_AT_5)
    proc, job = tidal_home.run(
        "counts", "--workers", "1", "--checkpoint-every", "2", script=script, timeout=60
    )
    assert proc.returncode == 1, proc.stderr
    before = job.status()
    assert before["state"] == "failed" and before["checkpoints"], summarize(before)
    kept = files(job.dir / "checkpoints")
    for flags, line in [
        (["--max-workers", "1", "--workers", "2"], "1 <= 2 <= 1"),
        (["--workers", "3", "--max-workers", "2"], "1 <= 3 <= 2"),
    ]:
        proc = tidal_home.cli("resume", "counts", "--quiet", *flags, timeout=60)
        assert proc.returncode == 1, (flags, proc.stderr)
        assert proc.stderr.strip().splitlines() == [
            "tidal: error: need --min-workers <= --workers <= --max-workers, got " + line
        ], (flags, proc.stderr)
        assert files(job.dir / "checkpoints") == kept, flags  # nothing saved lost or changed
        after = job.status()
        assert json.dumps(after, sort_keys=True) == json.dumps(before, sort_keys=True), flags
    tidal_home.assert_no_processes()
