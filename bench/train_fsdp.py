"""The sharded bench's training script: a float32 stack of Linear layers (3.4 M parameters,
13.7 MB; 41 MB with AdamW's two moments) on synthetic data, two ways.

``--mode tidal``: ``tidal.Trainer(..., sharding="fsdp")`` (or ``--sharding ddp``) under
``tidal run``. Once per generation, a few steps in, each member appends to
``OUT/mem-PID.jsonl`` what it holds: the bytes of its rows of the parameters and of the
optimizer state (``trainer._parts.sharded.fsdp.sharded.held()``) and of its neighbour copies
(``trainer._parts.sharded.fsdp.ring.copies``: its own snapshot and its neighbour's shard; none alone).
After every step it appends to ``OUT/copies-PID.jsonl`` each copy the ring took since
(``CopyLog``: the snapshot's and the exchange's seconds). The parameters must be float32
(``check_float32``: else the worker exits).

``--mode dcp``: what a torchtitan / DCP user does for a resize, run under ``torchrun``: FSDP2
(``fully_shard`` on every Linear, then the root) over gloo; with ``--resume DIR`` it loads
``dcp.load`` + ``set_state_dict`` from DIR and continues at the step saved there; at
``--stop-at S`` (committed steps) it saves ``get_state_dict`` + ``dcp.async_save`` to ``--save DIR``
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
    """This member's bytes at its current layout: its rows and the neighbour copies it
    keeps (whatever ``ring.copies`` holds: a lone member should keep none). None until
    AdamW's state exists and, at 2+ members, until the first exchange of this layout has
    completed (the copy is taken as every generation forms and exchanged on a thread)."""
    fsdp = trainer._parts.sharded.fsdp
    if fsdp is None or fsdp.module is None:
        return None
    held = fsdp.sharded.held()
    copies = fsdp.ring.copies
    if not any(k[0] == "o" for k in held.rows):  # AdamW's state exists after a step
        return None
    if held.layout.world > 1 and (
        copies is None or copies.layout != held.layout or set(copies.own) != set(held.rows)
    ):
        return None  # the copy of this layout is still in flight
    return {
        "generation": trainer.generation,
        "world": held.layout.world,
        "rank": held.layout.rank,
        "step": trainer.step,
        "dtypes": sorted({str(v.dtype) for v in held.rows.values()}),
        "params": nbytes(v for k, v in held.rows.items() if k[0] == "p"),
        "optimizer": nbytes(v for k, v in held.rows.items() if k[0] == "o"),
        "copy_own": nbytes(copies.own.values()) if copies else 0,
        "copy_theirs": nbytes(copies.theirs.values()) if copies else 0,
        "copy_blob": len(copies.blob) if copies else 0,
        "copy_every": fsdp.ring.every,
    }


class CopyLog:
    """Every neighbour copy this member takes, as the ring reports it (the numbers rank 0
    posts as ``copy_snapshot_s`` / ``copy_exchange_s`` in the job's metrics): a snapshot
    line when ``ring.snapshot_s`` changes (the training thread's part, at a copy step), an
    exchange line when a new whole copy lands (``ring.copies`` replaced: its thread's
    ``exchange_s``), an error line when ``ring.error`` changes. Read after every step."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.last: tuple | None = None

    def __call__(self, trainer) -> None:
        fsdp = trainer._parts.sharded.fsdp
        if self.path is None or fsdp is None:
            return
        ring = fsdp.ring
        now = (ring.snapshot_s, id(ring.copies) if ring.copies else None, ring.error)
        last, self.last = self.last, now
        if last is None:
            last = (0.0, None, None)
        base = {"generation": trainer.generation, "world": trainer.world_size, "step": trainer.step}
        lines = []
        if now[0] != last[0]:
            lines.append({**base, "kind": "snapshot", "seconds": ring.snapshot_s})
        if now[1] != last[1] and ring.copies is not None:
            lines.append(
                {**base, "kind": "exchange", "seconds": ring.exchange_s, "of": ring.copies.step}
            )
        if now[2] != last[2] and ring.error:
            lines.append({**base, "kind": "error", "error": ring.error})
        if lines:
            with open(self.path, "a") as fh:
                fh.writelines(json.dumps(x) + "\n" for x in lines)


def check_float32(trainer) -> None:
    """The bench measures float32 training (what FSDP2 reduced with PREMUL_SUM, which gloo
    refuses, before Tidal forced a plain SUM): fail loudly if the model is anything else."""
    dtypes = {p.dtype for p in trainer.model.parameters()}
    if dtypes != {torch.float32}:
        raise SystemExit(f"train_fsdp: the bench trains float32, got {sorted(map(str, dtypes))}")


def run_tidal(args: argparse.Namespace, rec: Recorder) -> None:
    import tidal

    model, opt, data = build(args.seed)
    trainer = tidal.Trainer(
        model, opt, data, global_batch_size=args.global_batch_size, sharding=args.sharding
    )
    mem_path = args.out / f"mem-{os.getpid()}.jsonl" if args.out else None
    copy_log = CopyLog(args.out / f"copies-{os.getpid()}.jsonl" if args.out else None)
    recorded: set[int] = set()
    checked = False
    for step in trainer.run(max_steps=args.steps):
        if not checked:
            check_float32(trainer)
            checked = True
        rec("B", step.index, trainer.world_size, trainer.rank)
        for x, y in step.micro_batches():
            step.backward(F.cross_entropy(trainer.model(x), y))
        rec("E", step.index, trainer.world_size, trainer.rank)
        copy_log(trainer)
        if mem_path is not None and trainer.generation not in recorded:
            facts = memory_facts(trainer)
            if facts is not None:
                recorded.add(trainer.generation)
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
        # the DCP user's best (bench.peers.DCP_ASYNC): async_save, the training waits for
        # the staging only; the upload is waited for before the process exits
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, True, False))
        resp = dcp.async_save(
            {"model": msd, "optim": osd}, checkpoint_id=str(args.save), async_stager=stager
        )
        resp.staging_completion.result()
        phases["save_staged"] = time.time()
        resp.upload_completion.result()
        stager.close()
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
