"""Which GPU each worker gets, and whether a job's GPU settings can run: the launch side.

Pure decisions (``assign_gpu``, ``check_launch``, ``device_entry``) plus one probe
(``visible_gpus``). The local backend gives each worker one GPU through
``CUDA_VISIBLE_DEVICES`` (so every worker sees its GPU as ``cuda:0``), never more workers
than GPUs unless ``--share-gpus``; with no GPU it sets nothing and workers run on the CPU.
On Ray the cluster places workers on GPUs (``--worker-gpus``) and sets
``CUDA_VISIBLE_DEVICES`` itself, so only the settings are checked here.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from tidal.config import COMMS, JobSpec

log = logging.getLogger(__name__)

#: Files one of which exists wherever a GPU torch could use exists.
DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def visible_gpus(override: int | None = None) -> int:
    """How many CUDA GPUs this process may use (0 without CUDA or torch's CUDA build).
    ``override`` (tests only) is returned as is. ``torch.cuda.device_count`` counts through
    NVML where it can and does not initialise CUDA in this process (the coordinator's), so
    ``torch.cuda.is_initialized()`` stays False and the workers it starts are unaffected.
    A machine without a GPU driver's device files (NVIDIA's, or ROCm's ``/dev/kfd``) has none:
    counted without importing torch (~2 s of ``tidal run``'s start)."""
    if override is not None:
        if override < 0:
            raise ValueError(f"a GPU count must be at least 0, got {override}")
        return override
    drivers = [f for f in DRIVER_FILES if Path(f).exists()]
    if not drivers:
        return 0
    count, error = 0, None
    try:
        import torch

        count = int(torch.cuda.device_count())
    except Exception as exc:  # noqa: BLE001 - a broken driver: no GPU, and said so
        error = f"{type(exc).__name__}: {exc}"
    n, warning = probed(drivers, count, error)
    if warning is not None:
        log.warning("%s", warning)
    return n


def probed(drivers: list[str], count: int, error: str | None) -> tuple[int, str | None]:
    """The GPUs a probe found, and a warning when a GPU driver is there but torch sees none
    (a broken driver, a CPU build of torch): the workers would train on the CPU, which is
    never done without a word."""
    if count > 0 and error is None:
        return count, None
    why = (
        error
        or "torch.cuda.device_count() is 0 (a CPU build of torch, or a driver torch cannot use)"
    )
    return 0, (
        f"a GPU driver is present ({', '.join(drivers)}) but torch sees no GPU ({why[:300]}): "
        "the workers train on the CPU"
    )


def assign_gpu(*, n_gpus: int, in_use: Mapping[int, int], share: bool) -> int | None:
    """The GPU index (0 <= index < ``n_gpus``) for a new worker, given ``in_use`` (worker id
    -> GPU index of the live workers). None when ``n_gpus`` is 0: the worker's
    ``CUDA_VISIBLE_DEVICES`` is left as it is. Otherwise the lowest index no live worker
    holds; if every one is held, with ``share`` the least used (lowest index on ties), and
    without it ``ValueError`` saying the fix."""
    if n_gpus < 0:
        raise ValueError(f"a GPU count must be at least 0, got {n_gpus}")
    if n_gpus == 0:
        return None
    used = Counter(i for i in in_use.values() if 0 <= i < n_gpus)
    free = [i for i in range(n_gpus) if not used[i]]
    if free:
        return free[0]
    if not share:
        raise ValueError(
            f"all {n_gpus} GPUs of this machine are held by live workers: lower --max-workers "
            "or pass --share-gpus"
        )
    return min(range(n_gpus), key=lambda i: (used[i], i))


def device_entry(index: int, parent: str | None) -> str:
    """What to set a worker's ``CUDA_VISIBLE_DEVICES`` to for GPU ``index`` of those this
    process sees: ``str(index)``, or, when this process was itself restricted (``parent``,
    its own ``CUDA_VISIBLE_DEVICES``, e.g. ``"2,3"`` or GPU UUIDs), that list's entry at
    ``index`` (GPU 1 of ``"2,3"`` is ``"3"``), as torchrun users expect."""
    entries = [e.strip() for e in (parent or "").split(",") if e.strip()]
    if not entries:
        return str(index)
    if index >= len(entries):
        raise ValueError(f"GPU {index} is not among CUDA_VISIBLE_DEVICES={parent!r}")
    return entries[index]


def entry_index(entry: str | None, parent: str | None) -> int | None:
    """The inverse of ``device_entry``: the GPU index a worker's ``CUDA_VISIBLE_DEVICES``
    (``entry``) names, None if it names none of them (a worker started without one)."""
    if not entry:
        return None
    entries = [e.strip() for e in (parent or "").split(",") if e.strip()]
    if entries:
        return entries.index(entry) if entry in entries else None
    return int(entry) if entry.isdigit() else None


def check_launch(
    *,
    n_gpus: int,
    max_workers: int,
    share: bool,
    comm: str,
    backend: str,
    spares: int = 0,
    worker_gpus: float = 0.0,
) -> None:
    """Refuse (``ValueError``, one line naming the flag and the fix) GPU settings a job
    cannot run with, before anything is started. ``n_gpus``: this machine's GPUs (the
    local backend's); ``max_workers`` + ``spares``: the most worker processes at once;
    ``worker_gpus``: Ray's GPUs per worker. Rules: ``--comm`` is one of ``COMMS``; local:
    ``--comm nccl`` needs a GPU, and more workers than GPUs need ``--share-gpus``, which
    NCCL cannot do (``--share-gpus`` makes ``auto`` gloo: ``WorkerConfig.from_spec``); ray:
    ``--comm nccl`` needs ``--worker-gpus`` above 0 (Ray places the GPUs)."""
    if comm not in COMMS:
        raise ValueError(f"--comm must be nccl, gloo or auto, got {comm!r}")
    if backend == "hosts":
        return  # the joined hosts' GPUs: each agent gives its workers one each
    if backend == "ray":
        if comm == "nccl" and worker_gpus <= 0:
            raise ValueError(
                "--comm nccl needs GPUs, and --worker-gpus is 0: pass --worker-gpus 1 "
                "(or more), or use --comm gloo or auto"
            )
        return
    if comm == "nccl" and n_gpus == 0:
        raise ValueError(
            "--comm nccl needs CUDA GPUs, and this machine has none: use --comm gloo or auto"
        )
    wanted = max_workers + spares
    if comm == "nccl" and share and wanted > n_gpus:
        raise ValueError(
            "--comm nccl cannot share a GPU between workers (NCCL holds one member of a group "
            "per GPU): use --comm gloo (or auto) with --share-gpus, or fewer workers"
        )
    if n_gpus > 0 and wanted > n_gpus and not share:
        asked = f"--max-workers {max_workers}" + (f" + --spares {spares}" if spares else "")
        raise ValueError(
            f"{asked} is more than this machine's {n_gpus} GPU{'s' if n_gpus > 1 else ''}: "
            "lower it or pass --share-gpus"
        )


def check_spec(spec: JobSpec, *, n_gpus: int | None = None) -> None:
    """``check_launch`` for a job: the local backend counts this machine's GPUs
    (``visible_gpus(n_gpus)``); Ray's are the cluster's, not counted here."""
    check_launch(
        n_gpus=0 if spec.backend in ("ray", "hosts") else visible_gpus(n_gpus),
        max_workers=spec.max_workers,
        spares=spec.spares,
        share=spec.share_gpus,
        comm=spec.comm,
        backend=spec.backend,
        worker_gpus=spec.cluster.worker_gpus,
    )
