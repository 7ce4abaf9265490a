"""``tracked_copy_overhead``: what keeping a step undoable costs when the step body changes
tracked state in place (an EMA updated after the micro-batches, ``tidal.tracked``).

Tidal: a training loop as ``tidal run``'s loop drives it, in this process: before each step
``TrackedState.mark()`` over an EMA (``AveragedModel``) and an LR scheduler, as the Trainer
tracks them; then forward, backward, the AdamW update and the EMA update in the body. The
mark copies the EMA's tensors the previous step moved: one copy of the EMA a step. Peer: the
same loop without the mark (the floor: what the script costs with no undo at all). Both
are steps/s, one over the median step time, from short blocks alternated (``measure``);
``ratio`` is Tidal / peer (1 when the copy is free). One thread, float32, an MLP of 0.2 M
parameters whose step is a few ms on one core: a small step, where a copy of the
parameters weighs the most (a GPU step of the same model is launch-bound, and a copy of
0.8 MB on the device is microseconds).

``python -m bench.tracked_copy`` prints the result as JSON.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tidal.tracked import TrackedState

WIDTH, DEPTH, BATCH = 256, 4, 64


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, WIDTH), torch.nn.GELU()]
    for _ in range(DEPTH - 1):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    tracked = TrackedState({"lr_scheduler": sched, "ema": ema})
    x = torch.randn(BATCH, 32)
    y = torch.randint(0, 10, (BATCH,))
    return model, opt, sched, ema, tracked, x, y


def _block(setup, steps: int, mark: bool) -> tuple[list[float], list[float]]:
    """Each step's seconds (the mark included) and each mark's, over ``steps`` steps."""
    model, opt, sched, ema, tracked, x, y = setup
    step_s, mark_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        if mark:
            tracked.mark()
            mark_s.append(time.perf_counter() - t0)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        ema.update_parameters(model)  # in the body: before the update, as tutorials do
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step_s.append(time.perf_counter() - t0)
    return step_s, mark_s


def measure(steps: int = 300, block: int = 1) -> dict:
    """Tidal's and the peer's steps/s: one over the median step of each, from blocks of
    ``block`` steps alternated until each has ``steps`` (one step each in turn: both see
    the same load on the shared cores, and the median skips another process's burst).
    The step after a mark also pays for the cache lines the copy evicted: counted."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        setup = _setup()
        _block(setup, 20, True)  # warm-up: allocation, the first mark's copies
        tidal: list[float] = []
        peer: list[float] = []
        marks: list[float] = []
        for rep in range(max(1, steps // block)):
            for which in ("tidal", "peer") if rep % 2 == 0 else ("peer", "tidal"):
                step_s, mark_s = _block(setup, block, which == "tidal")
                (tidal if which == "tidal" else peer).extend(step_s)
                marks.extend(mark_s)
    finally:
        torch.set_num_threads(threads)
    tracked, ema = setup[4], setup[3]
    ema_bytes = sum(t.numel() * t.element_size() for t in ema.state_dict().values())
    step, mark, floor = statistics.median(tidal), statistics.median(marks), statistics.median(peer)
    return {
        "tidal": 1 / step,
        "peer": 1 / floor,
        "step_s_p50": step,
        "peer_step_s_p50": floor,
        "mark_s_p50": mark,
        "copied_per_mark": tracked.last_copied,  # the EMA's parameters and n_averaged
        "copied_bytes_per_mark": ema_bytes,
        "config": f"the same loop without TrackedState.mark(): MLP {DEPTH}x{WIDTH} fp32, "
        f"batch {BATCH}, AdamW, EMA updated in the body, 1 thread, {len(peer)} steps",
    }


if __name__ == "__main__":
    print(json.dumps(measure(), indent=2))
