"""The simulator's model of a data-parallel job, and named presets.

A step of ``global_batch`` samples over ``n`` workers takes

    compute(n) = global_batch / n * compute_s_per_sample
    comm(n)    = 2(n-1)/n * grad_bytes / bandwidth_bytes_s + latency_s     (0 when n = 1)
    step(n)    = compute(n) + comm(n)

(no overlap of communication with the backward pass: the conservative reading, see
``docs/policies.md``). A membership change stalls training for ``rescale_pause_s``; the
job's start stalls it for ``startup_s`` (paid: the workers are starting). A model measured
on a real run may give the step time of the sizes it measured (``measured_step_s``, pairs
of world size and seconds): those replace the formula at those sizes (a host with fewer
cores than workers is not a ring all-reduce). The figures of each preset and their public
sources are listed in ``docs/policies.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

IMAGENET_TRAIN_IMAGES = 1_281_167  # ILSVRC-2012 training set
RESNET50_PARAMS = 25_557_032  # torchvision resnet50
TINYLLAMA_PARAMS = 1.1e9  # TinyLlama README: 1.1B
TINYLLAMA_TOKENS_S = 24_000  # per A100-40G GPU (TinyLlama README)
LLAMA2_7B_PARAMS = 6.74e9  # Llama 2 paper: 7B (6.74B in the released weights)
LLAMA2_7B_TOKENS_S = 2.0e12 / (184_320 * 3600)  # 2.0T tokens in 184,320 A100-80GB hours


@dataclass(frozen=True, kw_only=True)
class JobModel:
    """A job for the simulator. Invariants: every figure positive (latency, pause >= 0)."""

    name: str
    compute_s_per_sample: float
    grad_bytes: float
    bandwidth_bytes_s: float
    latency_s: float
    rescale_pause_s: float
    global_batch: int
    total_steps: int
    description: str = ""
    startup_s: float = 0.0
    measured_step_s: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"job {self.name!r}: {msg}")

        need(
            math.isfinite(self.compute_s_per_sample) and self.compute_s_per_sample > 0,
            f"compute per sample must be > 0 s, got {self.compute_s_per_sample} "
            "(e.g. --sample-time 0.00083 for 1,200 samples/s)",
        )
        need(
            math.isfinite(self.grad_bytes) and self.grad_bytes >= 0,
            f"gradient bytes must be >= 0, got {self.grad_bytes}",
        )
        need(
            math.isfinite(self.bandwidth_bytes_s) and self.bandwidth_bytes_s > 0,
            f"bandwidth must be > 0, got {self.bandwidth_bytes_s} B/s (e.g. --bandwidth-gbit 25)",
        )
        need(
            math.isfinite(self.latency_s) and self.latency_s >= 0,
            f"latency must be >= 0 s, got {self.latency_s}",
        )
        need(
            math.isfinite(self.rescale_pause_s) and self.rescale_pause_s >= 0,
            f"rescale pause must be >= 0 s, got {self.rescale_pause_s}",
        )
        need(self.global_batch >= 1, f"global batch must be >= 1, got {self.global_batch}")
        need(self.total_steps >= 1, f"total steps must be >= 1, got {self.total_steps}")
        need(
            math.isfinite(self.startup_s) and self.startup_s >= 0,
            f"start-up must be >= 0 s, got {self.startup_s}",
        )
        for n, s in self.measured_step_s:
            need(n >= 1, f"a measured step needs a world size >= 1, got {n}")
            need(math.isfinite(s) and s > 0, f"the measured step at {n} must be > 0 s, got {s}")
        object.__setattr__(self, "_measured", dict(self.measured_step_s))

    def compute_s(self, n: int) -> float:
        formula = self.global_batch / n * self.compute_s_per_sample
        measured = self._measured.get(n)
        return formula if measured is None else min(formula, measured)

    def comm_s(self, n: int) -> float:
        measured = self._measured.get(n)
        if measured is not None:
            return measured - self.compute_s(n)
        if n <= 1:
            return 0.0
        return 2.0 * (n - 1) / n * self.grad_bytes / self.bandwidth_bytes_s + self.latency_s

    def step_s(self, n: int) -> float:
        measured = self._measured.get(n)
        return measured if measured is not None else self.compute_s(n) + self.comm_s(n)

    def samples_per_s(self, n: int) -> float:
        return self.global_batch / self.step_s(n)

    @property
    def total_samples(self) -> int:
        return self.total_steps * self.global_batch

    def with_overrides(self, **changes: float | int | None) -> JobModel:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        given = {k: v for k, v in changes.items() if v is not None}
        if not given:
            return self
        return replace(self, name=f"{self.name} (modified)", **given)


_RESNET50_V100 = JobModel(
    name="resnet50-v100",
    compute_s_per_sample=1 / 1200,  # NVIDIA DLE: 1,200 img/s, 1 V100 16GB, mixed precision
    grad_bytes=RESNET50_PARAMS * 4,  # fp32 gradients (AMP keeps fp32 parameters)
    bandwidth_bytes_s=25e9 / 8,  # 25 Gbit/s Ethernet (AWS p3.16xlarge)
    latency_s=1e-3,
    rescale_pause_s=10.0,
    global_batch=1024,
    total_steps=90 * IMAGENET_TRAIN_IMAGES // 1024,  # 90 epochs of ImageNet
    description="ResNet-50 v1.5, ImageNet 90 epochs, V100 mixed precision, 25 Gbit/s Ethernet",
)

_TINYLLAMA = JobModel(
    name="tinyllama-1.1b-a100",
    # A worker is an 8 x A100-40GB node (AWS p4d.24xlarge); a sample is a 2,048-token
    # sequence; 24,000 tokens/s per GPU (TinyLlama README, FSDP + flash attention).
    compute_s_per_sample=2048 / (8 * TINYLLAMA_TOKENS_S),
    grad_bytes=TINYLLAMA_PARAMS * 2,  # bf16 gradients
    bandwidth_bytes_s=400e9 / 8,  # p4d.24xlarge: 400 Gbit/s EFA
    latency_s=1e-3,
    rescale_pause_s=20.0,
    global_batch=1024,  # 2M tokens a step (TinyLlama: 2048 x 1024)
    total_steps=10_490,  # 22B tokens, Chinchilla-optimal (TinyLlama README: 32 h on 8 A100)
    description="TinyLlama 1.1B pre-training to 22B tokens, 8 x A100-40GB nodes, 400 Gbit/s",
)

_LLAMA2_7B = JobModel(
    name="llama2-7b-a100",
    # A worker is an 8 x A100-80GB node; a sample is a 4,096-token sequence; 3,014 tokens/s
    # per GPU: Llama 2 7B took 184,320 A100-80GB hours for 2.0T tokens (Llama 2 paper).
    compute_s_per_sample=4096 / (8 * LLAMA2_7B_TOKENS_S),
    grad_bytes=LLAMA2_7B_PARAMS * 2,  # bf16 gradients
    bandwidth_bytes_s=8 * 200e9 / 8,  # 8 x 200 Gbit/s endpoints a node (Llama 2 paper)
    latency_s=1e-3,
    rescale_pause_s=30.0,
    global_batch=1024,  # 4M tokens a step (Llama 2: 4M-token batches of 4,096-token sequences)
    total_steps=round(20 * LLAMA2_7B_PARAMS / 4_194_304),  # 20 tokens a parameter (Chinchilla)
    description="Llama 2 7B pre-training to 135B tokens, 8 x A100-80GB nodes, 1.6 Tbit/s",
)

PRESETS: dict[str, JobModel] = {
    j.name: j
    for j in (
        _RESNET50_V100,
        _TINYLLAMA,
        _LLAMA2_7B,
        replace(
            _RESNET50_V100,
            name="resnet50-v100-fp32",
            compute_s_per_sample=1 / 367,  # NVIDIA DLE: 367 img/s, 1 V100 16GB, FP32
            description="as resnet50-v100 in FP32 (no tensor cores)",
        ),
        replace(
            _RESNET50_V100,
            name="resnet50-v100-100gbe",
            bandwidth_bytes_s=100e9 / 8,  # AWS p3dn.24xlarge: 100 Gbit/s
            description="as resnet50-v100 over 100 Gbit/s Ethernet",
        ),
    )
}
DEFAULT_JOB = _RESNET50_V100.name


def get_job(name: str) -> JobModel:
    """The preset called ``name``; a ValueError naming the known ones if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown job {name!r}; known jobs: {', '.join(sorted(PRESETS))}"
        ) from None
