"""One TorchFT replica group (one process) training the bench MLP: the peer of
``bench/torchft_measure.py``.

``python -m bench.torchft_replica --lighthouse`` runs the lighthouse instead (the settings
of ``bench.peers.TORCHFT_LIGHTHOUSE``, a port chosen by the OS), prints
``LIGHTHOUSE ADDRESS`` and serves until it is killed (its own process: its log stays out of
the bench's output).

``python -m bench.torchft_replica --replica N --out DIR [--steps S]`` with
``TORCHFT_LIGHTHOUSE`` set to the lighthouse's address. The replica hosts its own
``TCPStore`` (group world size 1), makes one ``Manager`` with the settings of
``bench.peers.TORCHFT_MANAGER`` and trains ``bench.train_mlp``'s model, data and global
batch (64, split into contiguous shares over the quorum's participants) through torchft's
``DistributedDataParallel`` and ``Optimizer`` wrapper until the manager's step reaches
``--steps``.

For each committed step it appends ``TIME STEP PARTICIPANTS`` to
``DIR/steps-N-PID.txt`` (``TIME`` = ``time.time()`` once the optimizer wrapper has
committed; ``STEP`` = the manager's step the batch was taken at), and writes the time its
``Manager`` is made (the replica ready: torch imported, model built, heartbeats starting)
to ``DIR/ready-N-PID.txt``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.peers import TORCHFT_LIGHTHOUSE, TORCHFT_MANAGER
from bench.train_mlp import build

torch.set_num_threads(1)  # several replicas share two cores


def ddp_class():
    """torchft's ``DistributedDataParallel`` with its comm hook's failure path completed.

    In torchft 0.2.0 (and on its main branch at 73dafea) the hook asserts on the work's
    inner future, which is unset when the all-reduce failed: on CPU gloo a peer's death
    raises in ``work.wait()`` (the manager records the error and returns False), and the
    assertion then kills the survivor too. This hook does the same all-reduce and, when it
    failed, hands DDP the bucket as it is: the manager has the error, ``should_commit``
    answers False and the step is not committed, which is what torchft intends.
    """
    from torchft import DistributedDataParallel

    class DDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # noqa: ANN001, ANN205 - torch's comm hook signature
            work = state.allreduce(bucket.buffer())
            if work.wait():
                inner = getattr(work.get_future(), "_fut", None)
                if inner is not None:
                    return inner
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return DDP


def lighthouse() -> None:
    from torchft.coordination import LighthouseServer

    conf = TORCHFT_LIGHTHOUSE
    server = LighthouseServer(
        bind=str(conf["bind"]),
        min_replicas=int(conf["min_replicas"]),
        join_timeout_ms=int(conf["join_timeout_ms"]),
        quorum_tick_ms=int(conf["quorum_tick_ms"]),
        heartbeat_timeout_ms=int(conf["heartbeat_timeout_ms"]),
    )
    # One write(2) of the whole line: print() writes the text and its newline apart, and the
    # lighthouse's own log (Rust, to the same file) once landed between the two, gluing its
    # timestamp onto the port ("http://vm:351272026-12-07T12:37:40").
    os.write(1, f"LIGHTHOUSE {server.address()}\n".encode())
    while True:
        time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", action="store_true")
    parser.add_argument("--replica", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=10_000_000)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.lighthouse:
        return lighthouse()
    if args.replica is None or args.out is None:
        parser.error("--replica and --out are required")

    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    conf = TORCHFT_MANAGER
    sec = lambda key: timedelta(seconds=conf[key])  # noqa: E731
    model, sgd, data = build(args.seed)  # before the manager: its heartbeats start with it
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=sec("pg_gloo_timeout_s"))

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        sgd.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": sgd.state_dict()}

    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=int(conf["min_replica_size"]),
        use_async_quorum=bool(conf["use_async_quorum"]),
        timeout=sec("timeout_s"),
        quorum_timeout=sec("quorum_timeout_s"),
        connect_timeout=sec("connect_timeout_s"),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        replica_id=f"bench_{args.replica}",
        hostname="127.0.0.1",
        heartbeat_interval=sec("heartbeat_interval_s"),
        init_sync=bool(conf["init_sync"]),
        checkpoint_transport=PGTransport(
            pg, timeout=sec("pg_transport_timeout_s"), device=torch.device("cpu")
        ),
    )
    ddp = ddp_class()(manager, model)
    opt = Optimizer(manager, sgd)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ready-{args.replica}-{os.getpid()}.txt").write_text(f"{time.time():.6f}\n")

    x_all, y_all = data.tensors
    g = args.global_batch_size
    per_epoch = len(data) // g
    perms: dict[int, torch.Tensor] = {}
    log = open(args.out / f"steps-{args.replica}-{os.getpid()}.txt", "a", buffering=1)  # noqa: SIM115
    while manager.current_step() < args.steps:
        opt.zero_grad()  # the quorum (synchronous here), healing a replica that is behind
        index = manager.current_step()
        n = max(manager.num_participants(), 1)
        r = manager.participating_rank() or 0
        epoch, i = divmod(index, per_epoch)
        if epoch not in perms:
            perms = {
                epoch: torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
            }
        share = perms[epoch][i * g : (i + 1) * g].tensor_split(n)[r]
        loss = F.cross_entropy(ddp(x_all[share]), y_all[share])
        loss.backward()  # torchft's comm hook averages over the participants
        opt.step()  # steps the optimizer only when the manager commits
        if manager.current_step() > index:
            log.write(f"{time.time():.6f} {index} {n}\n")
    log.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
