"""Put on ``PYTHONPATH`` by ``bench.gpu`` parts (c) and (e) for the workers of their ``tidal
run`` of ``examples/gpt.py``: a worker (it has ``TIDAL_WORKER_ID``) whose environment names
``TIDAL_BENCH_GPU_STEPS=DIR`` writes ``B wall_time step generation backend device_bytes`` to
``DIR/steps-PID.txt`` as each step begins (the ``step`` probe point,
``tidal.worker.probes``), the format ``scripts/gpt_ddp.py`` writes for the torchrun peer.
A worker armed with ``TIDAL_FAULTS`` also gets the fault injector (this folder comes first
on ``PYTHONPATH``, so ``tidal.testing``'s own ``sitecustomize`` is not imported). The
example itself is run unchanged. Other processes import nothing."""

import os

if os.environ.get("TIDAL_BENCH_GPU_STEPS") and os.environ.get("TIDAL_WORKER_ID"):
    import time
    from pathlib import Path

    from tidal.worker import probes

    _dir = Path(os.environ["TIDAL_BENCH_GPU_STEPS"])
    _dir.mkdir(parents=True, exist_ok=True)
    _fh = open(_dir / f"steps-{os.getpid()}.txt", "a", buffering=1)  # noqa: SIM115

    def _record(phase, step, generation):
        if phase != "step":
            return
        import torch
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else "none"
        used = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
        _fh.write(f"B {time.time():.6f} {step} {generation} {backend} {used}\n")

    probes.install(_record)

if os.environ.get("TIDAL_FAULTS") and os.environ.get("TIDAL_WORKER_ID"):
    from tidal.testing.faults import install_from_environ

    install_from_environ()
