"""The chaos campaign's training script: a small float64 MLP on generated data.

Float64, so that a job that went through faults and resizes can be compared with a plain
1-worker run of the same script to within 1e-12 (``python bench/chaos/train.py`` without
``tidal run`` trains alone with the same mathematics: that is the reference). It carries an
SGD momentum buffer, an LR scheduler, a GradScaler and an EMA of the weights (tracked
state, updated in the step body), so healing, rewinding and checkpoints must carry more
than the parameters.

``--pace FILE``: seconds to sleep after each step, re-read every step (default 0 if the
file is missing). The campaign slows the job down while it injects faults and lets it run
at full speed once the last fault has recovered; the sleep is outside the mathematics.

Each member appends ``TIME STEP`` to ``OUT/steps-worker-ID.txt`` for each step it knows
committed (the campaign's measure of stalls, whether or not the coordinator is up), and each
member that finishes the job writes ``OUT/worker-ID.safetensors`` (its parameters, momentum
buffers and EMA weights) and ``OUT/worker-ID.json`` (its final step, the scheduler's and the
scaler's state, the dataset's size). Each member also appends ``STEP GENERATION ID ...`` to
``OUT/samples-worker-ID.txt`` as it begins a step's body: the sample ids of its share (the
check of exactly-once consumption: ``checks.samples``).

The script registers no ``after_step`` hook: a member with hooks always commits its last
step before leaving (``tidal/worker/membership/leaving.py``), and the campaign's scale-downs are to
exercise the leaver that skips it. A step is recorded as the next one begins (a step is
yielded only to a member whose state has every step before it) and the last one after the
loop; a step redone after a failure is not recorded twice. The time is the commit's plus
whatever ran between it and the next step's start, a re-form included: a stall is then
charged to the gap before that commit instead of the one after it, and its length is the
same.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

import tidal

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
FEATURES, CLASSES = 16, 4


def data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(960, FEATURES, generator=g)
    y = (x[:, :4] @ torch.tensor([1.0, -1.0, 0.5, 2.0]) > 0).long() + 2 * (x[:, 4] > 0.5).long()
    return TensorDataset(x, y)


def pace(path: str | None) -> float:
    if not path:
        return 0.0
    try:
        return max(0.0, float(Path(path).read_text() or 0))
    except (OSError, ValueError):
        return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--pace", help="file holding the seconds to sleep after each step")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, CLASSES)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.8)
    # Scales by powers of two (exact in float64); grows every 25 steps, so its state moves.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=25)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    dataset = data(args.seed)
    trainer = tidal.Trainer(
        model,
        opt,
        dataset,
        global_batch_size=24,
        micro_batch_size=4,  # 6 micro-batches: 1 to 4 members split them differently
        seed=args.seed,
        lr_scheduler=sched,
        grad_scaler=scaler,
        state={"ema": ema},
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps_log = samples_log = None
    recorded = -1  # the newest step recorded (module doc)

    def record(index: int) -> None:
        nonlocal steps_log, recorded
        if index <= recorded or trainer.worker_id is None:
            return
        if steps_log is None:
            steps_log = open(out / f"steps-worker-{trainer.worker_id}.txt", "a", buffering=1)  # noqa: SIM115
        steps_log.write(f"{time.time():.4f} {index}\n")
        recorded = index

    def me() -> str:
        return str(trainer.worker_id) if trainer.worker_id is not None else f"alone-{os.getpid()}"

    for step in trainer.run(max_steps=args.max_steps):
        record(step.index - 1)
        if samples_log is None:
            samples_log = open(out / f"samples-worker-{me()}.txt", "a", buffering=1)  # noqa: SIM115
        ids = " ".join(map(str, step.indices.tolist()))
        samples_log.write(f"{step.index} {trainer.generation} {ids}\n")
        ema.update_parameters(model)  # in the body: the weights before this step's update
        for x, y in step.micro_batches():
            step.backward(F.cross_entropy(trainer.model(x), y))
        if delay := pace(args.pace):
            time.sleep(delay)
    if not trainer.completed:
        return
    record(trainer.step - 1)
    wid = me()
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors |= {f"ema.{k}": v.contiguous() for k, v in ema.module.state_dict().items()}
    for i, group in enumerate(opt.param_groups):
        for j, param in enumerate(group["params"]):
            buf = opt.state.get(param, {}).get("momentum_buffer")
            if buf is not None:
                tensors[f"momentum.{i}.{j}"] = buf.contiguous()
    safetensors.torch.save_file(tensors, str(out / f"worker-{wid}.safetensors"))
    facts = {
        "step": trainer.step,
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "ema_averaged": int(ema.n_averaged),
        "dataset_size": len(dataset),
    }
    (out / f"worker-{wid}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
