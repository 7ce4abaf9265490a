"""Distributed evaluation: ``trainer.evaluate(fn, dataset, batch_size=...)``.

Contracts:

- The dataset is read in order, in batches of ``batch_size`` (the last may be shorter).
  ``fn(batch)`` runs under ``torch.no_grad()`` on the collated batch, moved to the trainer's
  device, and returns a mapping of metric name to the batch's MEAN over its samples (a
  float or a 0-dim tensor), or to per-sample values (a 1-D tensor: their mean is taken).
- The result is, for each name, ``sum_b(mean_b * n_b) / sum_b(n_b)`` over the batches, added
  up in batch order in float64 (``combine``): the same bits at any world size, alone or
  under ``tidal run``, and after a member was lost in the middle of it.
- Under ``tidal run``, in a formed generation, batch ``b`` is computed by the member of rank
  ``b % world_size`` (``owner``) and published to the job's rendezvous store under a key of
  the generation, the step and the call (``batch_key``); every member reads every batch.
  A missing batch whose owner the coordinator has dropped (its newest answer names a newer
  generation without it) is computed by the reader (``take_over``). No collective runs:
  a member lost during an evaluation fails nobody's evaluation; the next step's all-reduce
  finds the loss and the group re-forms as after any failure.
- Every member calls ``evaluate`` alike (the same arguments, in the same order, in a step).
  Outside a generation (training alone, or after ``run()`` ended) every batch is computed
  here: the same result, bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import default_collate

from tidal.devices import to_device
from tidal.protocol import Role
from tidal.worker import probes

if TYPE_CHECKING:
    from tidal.worker.trainer.parts import Parts

log = logging.getLogger(__name__)

#: How long a reader waits between looks at the store for its peers' batches, at most.
POLL_MAX_S = 0.05
#: A reader still waiting this long for live members' batches says so (each time again).
WARN_AFTER_S = 30.0

Result = tuple[int, dict[str, float]]  # a batch's sample count and its metrics' sums


# -- the rules, pure ----------------------------------------------------------------------
def batches(n: int, batch_size: int) -> list[range]:
    """The dataset's indices in order, cut into batches of ``batch_size``."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be an integer >= 1, got {batch_size!r}")
    return [range(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]


def owner(batch: int, world_size: int) -> int:
    """The rank that computes ``batch`` first."""
    return batch % world_size


def take_over(
    missing: list[int], members: list[int], dropped: set[int], *, world_size: int
) -> list[int]:
    """The missing batches a reader computes itself: those whose owner (``members[rank]``,
    the generation's worker ids by rank) the coordinator has dropped."""
    return [b for b in missing if members[owner(b, world_size)] in dropped]


def batch_result(out: Any, n: int) -> Result:
    """``fn``'s output for a batch of ``n`` samples as its metrics' sums (module doc)."""
    if not isinstance(out, Mapping) or not out:
        raise ValueError(
            "evaluate: fn(batch) must return a dict of metric name to the batch's mean "
            f"(a float or a 0-dim tensor) or per-sample values (1-D), got {type(out).__name__}"
        )
    sums = {}
    for name, value in out.items():
        if isinstance(value, torch.Tensor):
            if value.dim() > 1:
                raise ValueError(f"evaluate: metric {name!r} has shape {tuple(value.shape)}")
            value = value.detach().double().mean().item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"evaluate: metric {name!r} is a {type(value).__name__}")
        sums[str(name)] = float(value) * n
    return n, sums


def combine(results: list[Result]) -> dict[str, float]:
    """The means over every sample, added up in batch order (module doc)."""
    total = sum(n for n, _ in results)
    names = results[0][1].keys() if results else ()
    out = {}
    for name in names:
        acc = 0.0
        for _, sums in results:
            acc += sums[name]
        out[name] = acc / total if total else math.nan
    return out


def batch_key(namespace: str, gen: int, step: int, call: int, batch: int) -> str:
    return f"{namespace}/eval/g{gen}/s{step}/c{call}/b{batch}"


# -- the executor -------------------------------------------------------------------------
class Evaluator:
    """``trainer.evaluate`` for one Trainer, as one of its parts: see the module doc."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        #: ((generation, step), calls) of ``evaluate`` in the step in flight: the call's
        #: number in its keys.
        self.calls: tuple[tuple[int, int] | None, int] = (None, 0)

    def evaluate(
        self, fn: Callable[[Any], Mapping[str, Any]], dataset: Any, batch_size: int
    ) -> dict[str, float]:
        """``trainer.evaluate``: see the module doc."""
        if not (callable(getattr(dataset, "__len__", None)) and hasattr(dataset, "__getitem__")):
            raise ValueError("evaluate: the dataset must be map-style (__len__ and __getitem__)")
        cut = batches(len(dataset), batch_size)
        collate = self.parts.loader.collate or default_collate
        device = self.parts.objects.device

        def compute(b: int) -> Result:
            batch = collate([dataset[i] for i in cut[b]])
            with torch.no_grad():
                return batch_result(fn(to_device(batch, device)), len(cut[b]))

        m, link = self.parts.membership, self.parts.link
        shared = m.ddp is not None and link.store is not None and m.world_size > 1
        if not shared:
            return combine([compute(b) for b in range(len(cut))])
        return combine(self._shared(compute, len(cut)))

    def _shared(self, compute: Callable[[int], Result], count: int) -> list[Result]:
        m, link = self.parts.membership, self.parts.link
        step, gen, rank, world = self.parts.update.step, m.generation, m.rank, m.world_size
        calls = self.calls
        call = calls[1] + 1 if calls[0] == (gen, step) else 0
        self.calls = ((gen, step), call)
        store, ns = link.store, link.cfg.store_namespace
        keys = [batch_key(ns, gen, step, call, b) for b in range(count)]
        results: dict[int, Result] = {}
        for b in range(count):
            if owner(b, world) == rank:
                results[b] = compute(b)
                store.set(keys[b], json.dumps(results[b]))
                probes.point("evaluate", step, gen)
        started, pause = time.monotonic(), 0.001
        warned = started
        while len(results) < count:
            missing = [b for b in range(count) if b not in results]
            for b in missing:
                if store.check([keys[b]]):
                    n, sums = json.loads(store.get(keys[b]))
                    results[b] = (n, sums)
            missing = [b for b in missing if b not in results]
            if not missing:
                break
            for b in take_over(missing, m.members, self._dropped(), world_size=world):
                results[b] = compute(b)
                store.set(keys[b], json.dumps(results[b]))
            if time.monotonic() - warned > WARN_AFTER_S:
                warned = time.monotonic()
                log.warning(
                    "evaluate: waited %.0f s for %d batches of live members: every member "
                    "must call trainer.evaluate alike",
                    warned - started,
                    len(missing),
                )
            time.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)
        return [results[b] for b in range(count)]

    def _dropped(self) -> set[int]:
        """This generation's members the coordinator's newest answer leaves out."""
        m = self.parts.membership
        latest = self.parts.link.latest()
        if latest is None or latest.generation is None or latest.generation.id <= m.generation:
            return set()
        if latest.role == Role.EXIT:
            return set()
        return set(m.members) - set(latest.generation.members)
