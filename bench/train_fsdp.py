"""The sharded bench's training script: a float32 stack of Linear layers (3.4 M parameters,
13.7 MB; 41 MB with AdamW's two moments) on synthetic data, two ways.

``--mode tidal``: ``tidal.Trainer(..., sharding="fsdp")`` (or ``--sharding ddp``) under
``tidal run``. Once per generation, a few steps in, each member appends to
``OUT/mem-PID.jsonl`` what it holds: the bytes of its rows of the parameters and of the
optimizer state (``trainer._fsdp.sharded.held()``), of its neighbour copies
(``trainer._fsdp.ring.copies``: its own snapshot and its neighbour's shard), and the last
copy's duration.

``--mode dcp``: what a torchtitan / DCP user does for a resize, run under ``torchrun``: FSDP2
(``fully_shard`` on every Linear, then the root) over gloo; with ``--resume DIR`` it loads
``dcp.load`` + ``set_state_dict`` from DIR and continues at the step saved there; at
``--stop-at S`` (committed steps) it saves ``get_state_dict`` + ``dcp.save`` to ``--save DIR``
and exits. Each process writes its phases (``OUT/phases-PID.json``: process start, group
formed, model built, state loaded, first step done, save begun and ended; wall times).

Both write ``OUT/steps-PID.txt`` like ``bench/train_mlp.py``: ``B|E time index world rank``;
here ``E`` is written once the step is complete (after the optimizer update in ``dcp``
mode, as Tidal's ``pause_s`` counts to the first *committed* step; after the backward in
``tidal`` mode, whose pauses are read from ``tidal status`` instead).
"""

from __future__ import annotations

import time

T_START = time.time()  # before torch is imported: a restarted process's start-up counts

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

torch.set_num_threads(1)  # several workers share two cores

IN, HIDDEN, DEPTH, OUT = 256, 1024, 3, 10  # 3.42 M float32 parameters


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, TensorDataset]:
    g = torch.Generator().manual_seed(1234)
    n = 64 * 50
    data = TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU()]
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(HIDDEN, OUT))
    model = torch.nn.Sequential(*layers)
    return model, adamw(model), data


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


class Recorder:
    """``bench/train_mlp.py``'s step records (copied: a script run by path cannot import
    the ``bench`` package)."""

    def __init__(self, out: Path | None) -> None:
        self.fh = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.fh = open(out / f"steps-{os.getpid()}.txt", "a", buffering=1)  # noqa: SIM115

    def __call__(self, kind: str, index: int, world: int, rank: int) -> None:
        if self.fh is not None:
            self.fh.write(f"{kind} {time.time():.6f} {index} {world} {rank}\n")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def ddp_bytes() -> dict[str, int]:
    """What a DDP member holds of the same model: every parameter and, after one step,
    every AdamW state tensor (measured on a real optimizer step, not computed)."""
    model, opt, data = build()
    x, y = data.tensors
    F.cross_entropy(model(x[:8]), y[:8]).backward()
    opt.step()
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return {"params": nbytes(model.parameters()), "optimizer": nbytes(states)}


def memory_facts(trainer) -> dict | None:
    """This member's bytes at its current layout, or None until its neighbour copy is of
    that layout (the copy is refreshed as every generation forms)."""
    fsdp = trainer._fsdp
    if fsdp is None or fsdp.module is None or fsdp.ring.copies is None:
        return None
    held = fsdp.sharded.held()
    copies = fsdp.ring.copies
    with_state = any(k[0] == "o" for k in held.rows)  # AdamW's state exists after a step
    if copies.layout != held.layout or set(copies.own) != set(held.rows) or not with_state:
        return None  # no step yet, or the copy predates this layout or AdamW's state
    return {
        "generation": trainer.generation,
        "world": held.layout.world,
        "rank": held.layout.rank,
        "step": trainer.step,
        "params": nbytes(v for k, v in held.rows.items() if k[0] == "p"),
        "optimizer": nbytes(v for k, v in held.rows.items() if k[0] == "o"),
        "copy_own": nbytes(copies.own.values()),
        "copy_theirs": nbytes(copies.theirs.values()),
        "copy_blob": len(copies.blob),
        "copy_s": fsdp.ring.seconds,
        "copy_every": fsdp.ring.every,
    }


def sum_reduction_on_gloo() -> list[bool]:
    """Work around a bug of ``sharding="fsdp"`` (found by this bench, reported, not fixed in
    ``tidal/``): Tidal sets ``set_gradient_divide_factor(1.0)`` on every FSDP unit, and for
    float32 or bfloat16 gradients FSDP2 then reduce-scatters with
    ``ReduceOp.PREMUL_SUM(1.0)``, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with
    Gloo"): every step fails and the job re-forms generations until it times out. float64
    (tests/scripts/sharded.py) takes FSDP2's other path (plain SUM) and works.

    This wraps ``ShardedModel.build`` so that each generation's module also gets
    ``set_force_sum_reduction_for_comms(True)`` (SUM, then a division by the factor 1.0:
    the same numbers), only where a unit does not have it already, so it turns itself off
    once Tidal does it. Returns a list that gets ``True`` each time it had to act."""
    from torch.distributed.fsdp import FSDPModule

    from tidal.worker import sharded

    acted: list[bool] = []
    original = sharded.ShardedModel.build

    def build(self, **kwargs):  # noqa: ANN001, ANN202 - the wrapped method's signature
        module = original(self, **kwargs)
        for sub in module.modules():
            if not isinstance(sub, FSDPModule):
                continue
            group = sub._get_fsdp_state()._fsdp_param_group
            if group is not None and not group.force_sum_reduction_for_comms:
                sub.set_force_sum_reduction_for_comms(True)
                acted.append(True)
        return module

    sharded.ShardedModel.build = build
    return acted


def run_tidal(args: argparse.Namespace, rec: Recorder) -> None:
    import tidal

    acted = sum_reduction_on_gloo() if args.sharding == "fsdp" else []
    model, opt, data = build(args.seed)
    trainer = tidal.Trainer(
        model, opt, data, global_batch_size=args.global_batch_size, sharding=args.sharding
    )
    mem_path = args.out / f"mem-{os.getpid()}.jsonl" if args.out else None
    recorded: set[int] = set()
    for step in trainer.run(max_steps=args.steps):
        rec("B", step.index, trainer.world_size, trainer.rank)
        for x, y in step.micro_batches():
            step.backward(F.cross_entropy(trainer.model(x), y))
        rec("E", step.index, trainer.world_size, trainer.rank)
        if mem_path is not None and trainer.generation not in recorded:
            facts = memory_facts(trainer)
            if facts is not None:
                recorded.add(trainer.generation)
                facts["workaround_sum_reduction"] = bool(acted)
                with open(mem_path, "a") as fh:
                    fh.write(json.dumps(facts) + "\n")


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)


def run_dcp(args: argparse.Namespace, rec: Recorder) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    phases: dict[str, float] = {"start": T_START}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    phases["group"] = time.time()
    model, _, data = build(args.seed)
    shard(model)
    opt = adamw(model)  # over the sharded parameters (fully_shard replaces them)
    phases["built"] = time.time()
    start = 0
    if args.resume is not None:
        msd, osd = get_state_dict(model, opt)  # initialises AdamW's state to load into
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(args.resume))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = json.loads((args.resume / "step.json").read_text())["step"]
        phases["loaded"] = time.time()
    x_all, y_all = data.tensors
    g = args.global_batch_size
    per_epoch = len(data) // g
    perm = None
    stop = args.stop_at if args.stop_at is not None else args.steps
    for index in range(start, stop):
        epoch, i = divmod(index, per_epoch)
        if i == 0 or perm is None:
            perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        rec("B", index, world, rank)
        share = perm[i * g : (i + 1) * g].tensor_split(world)[rank]
        # FSDP averages over the members: scaled so that the update is the global mean's
        loss = F.cross_entropy(model(x_all[share]), y_all[share], reduction="sum") * world / g
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec("E", index, world, rank)
        if index == start:
            phases["first_step"] = time.time()
    if args.save is not None:
        phases["save_begin"] = time.time()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(args.save))
        if rank == 0:
            (args.save / "step.json").write_text(json.dumps({"step": stop}))
        dist.barrier()
        phases["save_end"] = time.time()
    dist.destroy_process_group()
    if args.out is not None:
        facts = {"world": world, "rank": rank, "start_step": start, "phases": phases}
        (args.out / f"phases-{os.getpid()}.json").write_text(json.dumps(facts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("tidal", "dcp"), required=True)
    parser.add_argument("--sharding", default="fsdp", choices=("fsdp", "ddp"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for the per-process records")
    parser.add_argument("--resume", type=Path, help="dcp: the checkpoint to start from")
    parser.add_argument("--stop-at", type=int, help="dcp: save and exit at this step")
    parser.add_argument("--save", type=Path, help="dcp: where to save at --stop-at")
    args = parser.parse_args()
    rec = Recorder(args.out)
    (run_dcp if args.mode == "dcp" else run_tidal)(args, rec)


if __name__ == "__main__":
    main()
