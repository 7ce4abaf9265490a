"""Typed, validated job configuration: what ``tidal run`` was asked to do."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, is_dataclass
from typing import Any

from tidal.preemption import DEFAULT_POLL_S, notice_source_error
from tidal.restarts import DEFAULT_MAX_RESTARTS, RestartLimit, parse_max_restarts

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def storage_error(text: str) -> str | None:
    """Why ``text`` cannot be a ``--checkpoint-dir`` (a folder, or an fsspec URL with a
    bucket: ``s3://BUCKET/PATH``), or None. Whether the URL's filesystem is installed is
    checked where it is used (``checkpoint.remote.check_url``)."""
    if not text.strip():
        return "--checkpoint-dir must name a folder or a URL, got ''"
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() != "file" and not rest.strip("/"):
        return f"--checkpoint-dir {text!r} names no bucket: write {scheme}://BUCKET/PATH"
    return None


def job_name_error(name: object) -> str | None:
    """Why ``name`` cannot be a job's name, in one line, or None. A name is one folder under
    ``HOME/jobs`` and a key of the home's records, so every command checks it before it
    forms a path from it: ``../../B/jobs/x`` must not reach another home's job."""
    if isinstance(name, str) and NAME_RE.fullmatch(name):
        return None
    return f"bad job name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)"


# The largest number of seconds a setting may hold (~31 years): ``timedelta`` overflows
# beyond about 8.6e13, and nobody waits longer.
MAX_SECONDS = 1e9
# The largest amount of dollars (a price per worker-hour, a budget).
MAX_DOLLARS = 1e12
# ``--comm``: the process groups' backend; ``auto`` is NCCL where the worker has CUDA.
COMMS = ("nccl", "gloo", "auto")
WORKER_STARTS = ("fork", "exec")  # how the local backend starts a worker (``--worker-start``)


# -- one source for each setting: a spec field carries its flag, help and number rule --------
@dataclass(frozen=True, kw_only=True)
class Flag:
    """What a spec field's ``metadata["tidal"]`` says about it. ``name``: its ``tidal run``
    flag (None: no flag); ``help``: the flag's help, where ``{default}`` stands for the
    field's default; ``type``: the parser's type where the field's own does not fit;
    ``derived``: the parser keeps None and ``tidal run`` converts the text or derives the
    value itself (``from_flags`` refuses to guess it). Float fields: ``label``, the name
    their errors use (default: the flag), ``rule`` (``>0`` positive, ``>=0`` at least 0)
    and ``upper``, the largest value allowed."""

    name: str | None = None
    help: str | None = None
    type: Callable[[str], Any] | None = None
    derived: bool = False
    label: str | None = None
    rule: str = ">0"
    upper: float = MAX_SECONDS

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag's value under."""
        return (self.name or "").lstrip("-").replace("-", "_")

    @property
    def said_as(self) -> str:
        return self.label or self.name or "?"


def flag(name: str | None = None, help: str | None = None, **kw: Any) -> dict[str, Flag]:
    """A field's ``metadata``: ``field(default=3, metadata=flag("--keep", "keep K"))``."""
    return {"tidal": Flag(name=name, help=help, **kw)}


def flag_of(f: Field) -> Flag | None:
    return f.metadata.get("tidal")


def _nested(f: Field) -> type | None:
    """The spec class of a field that holds one (``JobSpec.cluster``), else None."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and is_dataclass(factory) else None


def flag_fields(cls: type) -> Iterator[tuple[Field, Flag]]:
    """Every field of ``cls`` that is a flag, nested specs' inline, in declaration order."""
    for f in fields(cls):
        nested = _nested(f)
        if nested is not None:
            yield from flag_fields(nested)
        elif (meta := flag_of(f)) is not None and meta.name:
            yield f, meta


_PARSER_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per flag field of ``cls``; its default is the field's own."""
    for f, meta in flag_fields(cls):
        hint = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        kind = _PARSER_TYPES.get(hint.removesuffix(" | None"))
        default = None if meta.derived or f.default is MISSING else f.default
        shown = f"{default:g}" if isinstance(default, (int, float)) else default
        text = meta.help.format(default=shown) if meta.help else None
        if kind is bool and meta.type is None:
            if default is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a switch must default to False")
            parser.add_argument(meta.name, action="store_true", help=text)
        elif meta.type is None and kind is None:
            raise TypeError(f"{cls.__name__}.{f.name} ({f.type}) needs Flag.type")
        else:
            parser.add_argument(meta.name, type=meta.type or kind, default=default, help=text)


def from_flags(cls: type, values: Mapping[str, Any], **given: Any) -> Any:
    """A ``cls`` from parsed flags (``vars(args)``): each flag field takes its flag's value,
    a nested spec is built the same way, ``given`` (by field name) wins over both, and the
    fields with no flag keep their defaults. A ``derived`` flag must be ``given``."""
    unknown = set(given) - {f.name for f in fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)}")
    kwargs = dict(given)
    for f in fields(cls):
        meta, nested = flag_of(f), _nested(f)
        if f.name in given:
            continue
        elif nested is not None:
            kwargs[f.name] = from_flags(nested, values)
        elif meta is not None and meta.name:
            if meta.derived:
                raise TypeError(f"{meta.name} is derived: give {cls.__name__}.{f.name}")
            kwargs[f.name] = values[meta.dest]
    return cls(**kwargs)


def check_numbers(spec: object) -> None:
    """Refuse, with the flag to fix, any float field of ``spec`` (a dataclass) that is not a
    finite number within its rule (``Flag.rule``, ``Flag.upper``): NaN would pass every
    comparison (a NaN heartbeat timeout never expires), infinity overflows timers. A float
    field without a ``Flag`` is refused as a programming error."""
    for f in fields(spec):
        if "float" not in str(f.type):
            continue
        meta = flag_of(f)
        if meta is None or not (meta.name or meta.label):
            raise TypeError(f"{type(spec).__name__}.{f.name} needs a flag or a label")
        label, rule, upper = meta.said_as, meta.rule, meta.upper
        value = getattr(spec, f.name)
        if value is None and "None" in str(f.type):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{label} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{label} must be a finite number, got {value}")
        if rule == ">0" and value <= 0:
            raise ValueError(f"{label} must be positive, got {value}")
        if rule == ">=0" and value < 0:
            raise ValueError(f"{label} must be at least 0, got {value}")
        if value > upper:
            raise ValueError(f"{label} must be at most {upper:g}, got {value:g}")


def parse_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """``"50:3,120:1"`` -> ``((50, 3), (120, 1))``: at step 50 the target becomes 3, ..."""
    entries = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        step, sep, count = part.partition(":")
        if not sep or not step.strip().isdigit() or not count.strip().isdigit():
            raise ValueError(
                f"bad --schedule entry {part!r}: write STEP:WORKERS pairs, e.g. 50:3,120:1"
            )
        entries.append((int(step), int(count)))
    steps = [s for s, _ in entries]
    if steps != sorted(set(steps)):
        raise ValueError(f"--schedule steps must be strictly increasing, got {steps}")
    return tuple(entries)


def parse_listen(text: str) -> tuple[str, int]:
    """``--listen HOST:PORT`` (``[::1]:7000`` for IPv6) -> ``(host, port)``; port 0: one the
    OS picks. ``ValueError`` with the fix for anything else, or a wildcard address: workers
    on other machines are given ``HOST`` to reach the coordinator and its store at."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip().removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"--listen takes HOST:PORT, the address other machines reach this one at (e.g. "
            f"10.0.0.5:7000; port 0: one the OS picks), got {text!r}"
        )
    if host in ("0.0.0.0", "::", "*"):
        raise ValueError(
            f"--listen needs the address other machines reach this one at, not {host}: the "
            "hosts' workers are given it to connect to (e.g. --listen 10.0.0.5:7000)"
        )
    return host, int(port)


# ``--track``: the experiment trackers the coordinator sends each step's metrics to.
TRACKERS = ("mlflow", "wandb")


@dataclass(frozen=True)
class Track:
    """``--track KIND[:TARGET]`` read: ``kind`` one of ``TRACKERS``; ``target`` MLflow's
    tracking URI or W&B's ``[ENTITY/]PROJECT`` (None: the library's own default)."""

    kind: str
    target: str | None = None


def parse_track(text: str) -> Track:
    """``"mlflow:file:///tmp/mlruns"`` -> ``Track("mlflow", "file:///tmp/mlruns")``; one line
    with the fix for anything else."""
    kind, sep, target = text.partition(":")
    usage = "write mlflow[:TRACKING_URI] or wandb[:[ENTITY/]PROJECT]"
    if kind not in TRACKERS:
        raise ValueError(f"bad --track {text!r}: {usage}")
    if sep and not target.strip():
        raise ValueError(f"bad --track {text!r}: nothing after ':' ({usage})")
    if kind == "wandb" and sep:
        parts = target.split("/")
        if len(parts) > 2 or not all(re.fullmatch(r"[A-Za-z0-9._-]+", p) for p in parts):
            raise ValueError(f"bad --track {text!r}: a W&B project is [ENTITY/]PROJECT")
    return Track(kind, target if sep else None)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Where workers run on a cluster backend (``ray``): the cluster's address and what each
    worker asks the cluster for. The local backend ignores it."""

    # "auto": the running cluster this machine belongs to; "local": a private one
    address: str = field(
        default="auto",
        metadata=flag(
            "--ray-address",
            "ray backend: the cluster, auto (the one this machine is in; default), "
            "HOST:PORT, or local (a private one-node cluster)",
        ),
    )
    worker_cpus: float = field(
        default=1.0,
        metadata=flag(
            "--worker-cpus", "ray backend: CPUs per worker (default {default})", upper=1e6
        ),
    )
    worker_gpus: float = field(
        default=0.0,
        metadata=flag(
            "--worker-gpus",
            "ray backend: GPUs per worker (default {default})",
            rule=">=0",
            upper=1e6,
        ),
    )

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.worker_cpus <= 0:
            raise ValueError(f"--worker-cpus must be positive, got {self.worker_cpus}")
        if self.worker_gpus < 0:
            raise ValueError(f"--worker-gpus must be at least 0, got {self.worker_gpus}")
        if not self.address.strip():
            raise ValueError("--ray-address must be 'auto', 'local' or HOST:PORT")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One job. Invariants: 1 <= min_workers <= workers <= max_workers, every scheduled
    count within [min_workers, max_workers]."""

    name: str = field(metadata=flag("--name", "job name (default SCRIPT-xxxx)", derived=True))
    script: str
    script_args: list[str] = field(default_factory=list)
    workers: int = field(
        default=1, metadata=flag("--workers", "initial worker count (default {default})")
    )
    min_workers: int = field(
        default=1,
        metadata=flag("--min-workers", "the fewest workers to run with (default {default})"),
    )
    max_workers: int = field(
        default=1,
        metadata=flag("--max-workers", "default: the largest count asked for", derived=True),
    )
    backend: str = field(
        default="local",
        metadata=flag(
            "--backend",
            "local (subprocesses, default), ray (a Ray cluster) or slurm (job steps inside a "
            "Slurm allocation, else jobs of their own)",
        ),
    )
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    listen: str | None = field(
        default=None,
        metadata=flag(
            "--listen",
            "serve the job on HOST:PORT, an address other machines reach, for the hosts that "
            "join it with `tidal worker --join` (the hosts backend; its token is required on "
            "every call), or for a Slurm job's nodes (slurm backend; default: the address "
            "this machine's route to the controller leaves from)",
        ),
    )
    local_slots: int = field(
        default=0,
        metadata=flag(
            "--local-slots",
            "with --listen: workers this machine runs itself besides the joined hosts' "
            "(default {default})",
        ),
    )
    policy: str = field(
        default="static", metadata=flag("--policy", "scaling policy (default {default})")
    )
    schedule: tuple[tuple[int, int], ...] = field(
        default=(),
        metadata=flag(
            "--schedule",
            "scripted scaling, STEP:WORKERS pairs, e.g. 50:3,120:1",
            type=str,
            derived=True,
        ),
    )
    # Heartbeats carry liveness and telemetry (the step, metrics, per-step records); members
    # learn of a change at the next step through the store (``worker.notice``), not here. At
    # 0.1 s (when they did) the heartbeats of a 2-worker job took ~2% of each worker's core
    # and ~1% of the coordinator's, out of the training's cores.
    heartbeat_interval_s: float = field(default=1.0, metadata=flag(label="the heartbeat interval"))
    heartbeat_timeout_s: float = field(
        default=10.0, metadata=flag("--heartbeat-timeout", "seconds (default {default})")
    )
    collective_timeout_s: float = field(
        default=120.0, metadata=flag("--collective-timeout", "seconds (default {default})")
    )
    # How long the job waits for its first generation (every initial worker started, its
    # script imported, its Trainer registered, the group formed) before it fails; also how
    # long members held at a --schedule step wait for the joiners (``end_rules.start_timed_out``,
    # ``scale_rules.schedule_settled``).
    start_timeout_s: float = field(
        default=120.0,
        metadata=flag(
            "--start-timeout",
            "seconds the job waits for its first generation to form (the workers started, "
            "their scripts imported, their Trainers joined) before it fails, and members held "
            "at a --schedule step wait for joiners before going on without them "
            "(default {default})",
        ),
    )
    # How long a worker trains on without reaching any coordinator before it exits: its
    # coordinator is restarted by its supervisor within a second or two, or re-attached by
    # ``tidal attach`` (``WorkerConfig.orphan_timeout_s``).
    orphan_timeout_s: float = field(
        default=600.0,
        metadata=flag(
            "--orphan-timeout",
            "seconds a worker trains on without any coordinator before it exits "
            "(default {default})",
        ),
    )
    spares: int = field(
        default=0,
        metadata=flag(
            "--spares",
            "warm standby workers kept started outside the group, billed like any: a "
            "scale-up or a failure's replacement joins at the next step (default {default})",
        ),
    )
    # An int (a spec saved before rates) or the flag's text: ``restarts.parse_max_restarts``.
    max_restarts: int | str = field(
        default=DEFAULT_MAX_RESTARTS,
        metadata=flag(
            "--max-restarts",
            "lost workers replaced: N over the job's life, a rate N/h (also N/m, N/d) or "
            "unlimited (default {default})",
            type=str,
        ),
    )
    preemption_notice: str | None = field(
        default=None,
        metadata=flag(
            "--preemption-notice",
            "each worker polls its machine's spot notices, aws, gcp or azure (their metadata "
            "endpoints), or a URL answering as AWS's spot/instance-action ({{worker}}: the "
            "worker's id); a notice is a planned leave, as SIGTERM",
        ),
    )
    preemption_poll_s: float = field(
        default=DEFAULT_POLL_S,
        metadata=flag(
            "--preemption-poll",
            "seconds between two reads of --preemption-notice (default {default})",
            upper=3600.0,
        ),
    )
    checkpoint_every: int | None = field(
        default=None, metadata=flag("--checkpoint-every", "checkpoint every N steps")
    )
    checkpoint_interval_s: float | None = field(
        default=None, metadata=flag("--checkpoint-interval", "checkpoint every S seconds")
    )
    keep_checkpoints: int = field(
        default=3, metadata=flag("--keep-checkpoints", "keep the last K (default {default})")
    )
    # Where the job's checkpoints go: ``STORAGE/NAME/`` (``home.checkpoint_folder``), a folder
    # every host mounts or an fsspec URL (``tidal.checkpoint.remote``); None: the job's folder
    # under ``--home``. A folder is stored absolute.
    checkpoint_storage: str | None = field(
        default=None,
        metadata=flag(
            "--checkpoint-dir",
            "where the checkpoints go, in DIR/NAME: a folder (shared by the hosts) or an "
            "fsspec URL such as s3://BUCKET/PATH, gs://..., az://... (default: the job's "
            "folder under --home)",
        ),
    )
    price_per_worker_hour: float = field(
        default=0.0,
        metadata=flag(
            "--price", "dollars per worker-hour (default {default})", rule=">=0", upper=MAX_DOLLARS
        ),
    )
    capacity_trace: str | None = field(
        default=None,
        metadata=flag(
            "--capacity", "CSV trace: time_s,capacity,price_per_worker_hour", derived=True
        ),
    )
    min_efficiency: float = field(
        default=0.7,
        metadata=flag("--min-efficiency", "throughput policy (default {default})", upper=1.0),
    )
    deadline_s: float | None = field(
        default=None,
        metadata=flag(
            "--deadline", "cost policy: finish within, e.g. 2h30m", type=str, derived=True
        ),
    )
    budget: float | None = field(
        default=None,
        metadata=flag("--budget", "cost policy: dollars for the whole job", upper=MAX_DOLLARS),
    )
    decision_interval_s: float = field(
        default=30.0,
        metadata=flag(
            "--decision-interval",
            "seconds between policy changes (default {default})",
            rule=">=0",
        ),
    )
    oversubscribe: bool = field(
        default=False,
        metadata=flag(
            "--oversubscribe",
            "local backend: allow more than 4 workers per core (memory still limits them)",
        ),
    )
    comm: str = field(
        default="auto",
        metadata=flag(
            "--comm", "process groups: nccl, gloo, or auto (nccl where workers have CUDA, default)"
        ),
    )
    share_gpus: bool = field(
        default=False,
        metadata=flag("--share-gpus", "local backend: let more workers than GPUs share them"),
    )
    worker_start: str = field(
        default="fork",
        metadata=flag(
            "--worker-start",
            "local backend: fork workers from an interpreter that imported torch once (fork, "
            "default) or start each as a fresh interpreter (exec)",
        ),
    )
    torchrun: bool = field(
        default=False,
        metadata=flag(
            "--torchrun",
            "run an unmodified torchrun script: each worker gets torchrun's environment "
            "(RANK, WORLD_SIZE, MASTER_ADDR...), and every membership change stops every "
            "worker and starts the new world, which resumes from the script's own snapshot",
        ),
    )
    track: str | None = field(
        default=None,
        metadata=flag(
            "--track",
            "send every committed step's tidal.log values, once, to mlflow[:TRACKING_URI] or "
            "wandb[:[ENTITY/]PROJECT]: one run per job, kept across resizes, coordinator "
            "restarts and tidal resume",
        ),
    )
    python: str = sys.executable

    @property
    def beat_interval_s(self) -> float:
        """How often workers heartbeat: ``heartbeat_interval_s``, or a fifth of the
        heartbeat timeout when that is shorter (a short ``--heartbeat-timeout`` must still
        tell a silent worker from a slow one)."""
        return min(self.heartbeat_interval_s, self.heartbeat_timeout_s / 5)

    def __post_init__(self) -> None:
        check_numbers(self)
        if (why := job_name_error(self.name)) is not None:
            raise ValueError(why)
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.min_workers < 1:
            raise ValueError(f"--min-workers must be at least 1, got {self.min_workers}")
        if not self.min_workers <= self.workers <= self.max_workers:
            raise ValueError(
                f"need --min-workers <= --workers <= --max-workers, got "
                f"{self.min_workers} <= {self.workers} <= {self.max_workers}"
            )
        for step, count in self.schedule:
            if not self.min_workers <= count <= self.max_workers:
                raise ValueError(
                    f"--schedule asks for {count} workers at step {step}, outside "
                    f"[{self.min_workers}, {self.max_workers}]: raise --max-workers"
                )
        if self.collective_timeout_s <= self.heartbeat_timeout_s:
            raise ValueError(
                "--collective-timeout must be longer than --heartbeat-timeout: a hung peer is "
                "found by its missed heartbeats before a collective gives up on it"
            )
        if self.orphan_timeout_s <= self.heartbeat_timeout_s:
            raise ValueError(
                "--orphan-timeout must be longer than --heartbeat-timeout: a worker waits out "
                "a coordinator's restart before it gives up on the job"
            )
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(
                f"--checkpoint-every must be at least 1 step, got {self.checkpoint_every}"
            )
        if self.checkpoint_interval_s is not None and self.checkpoint_interval_s <= 0:
            raise ValueError(
                f"--checkpoint-interval must be positive seconds, got {self.checkpoint_interval_s}"
            )
        if self.keep_checkpoints < 1:
            raise ValueError(f"--keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.checkpoint_storage is not None:
            if (why := storage_error(self.checkpoint_storage)) is not None:
                raise ValueError(why)
            if not self.checkpoints:
                raise ValueError(
                    "--checkpoint-dir needs --checkpoint-every N or --checkpoint-interval S"
                )
        if self.price_per_worker_hour < 0:
            raise ValueError(f"--price must be at least 0, got {self.price_per_worker_hour}")
        if not 0 < self.min_efficiency <= 1:
            raise ValueError(f"--min-efficiency must be in (0, 1], got {self.min_efficiency}")
        if self.decision_interval_s < 0:
            raise ValueError(
                f"--decision-interval must be at least 0 s, got {self.decision_interval_s}"
            )
        if self.spares < 0:
            raise ValueError(f"--spares must be at least 0, got {self.spares}")
        parse_max_restarts(self.max_restarts)
        if (why := notice_source_error(self.preemption_notice)) is not None:
            raise ValueError(why)
        if self.comm not in COMMS:
            raise ValueError(f"--comm must be nccl, gloo or auto, got {self.comm!r}")
        if self.torchrun and self.checkpoints:
            raise ValueError(
                "--torchrun scripts keep their own snapshots: --checkpoint-every and "
                "--checkpoint-interval are tidal.Trainer's (drop them)"
            )
        if self.torchrun and self.preemption_notice is not None:
            raise ValueError(
                "--preemption-notice is tidal.Trainer's: a --torchrun script gets the "
                "machine's SIGTERM itself, as under torchrun (drop the flag)"
            )
        if self.backend == "hosts" and self.listen is None:
            raise ValueError(
                "--backend hosts needs --listen HOST:PORT, the address the hosts reach this "
                "machine at"
            )
        if self.listen is not None:
            parse_listen(self.listen)
            if self.backend not in ("hosts", "slurm"):
                raise ValueError(
                    f"--listen serves the hosts that join the job (the hosts backend) or a "
                    f"Slurm job's nodes, not the {self.backend} backend"
                )
        if self.local_slots < 0:
            raise ValueError(f"--local-slots must be at least 0, got {self.local_slots}")
        if self.local_slots and self.backend != "hosts":
            raise ValueError("--local-slots goes with --listen (workers beside joined hosts)")
        if self.track is not None:
            parse_track(self.track)
        if self.worker_start not in WORKER_STARTS:
            raise ValueError(f"--worker-start must be fork or exec, got {self.worker_start!r}")

    @property
    def worker_argv(self) -> list[str]:
        """What each worker's interpreter runs (after the interpreter itself): the script and
        its arguments, or under ``--torchrun`` the launcher that gives the script torchrun's
        environment first (``tidal.worker.compat.torchrun``)."""
        if self.torchrun:
            return ["-m", "tidal.worker.compat.torchrun", self.script, *self.script_args]
        return [self.script, *self.script_args]

    @property
    def restart_limit(self) -> RestartLimit:
        """``max_restarts`` read (``restarts``): validated in ``__post_init__``."""
        return parse_max_restarts(self.max_restarts)

    @property
    def checkpoints(self) -> bool:
        return self.checkpoint_every is not None or self.checkpoint_interval_s is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> JobSpec:
        data = dict(data)
        data["schedule"] = tuple(tuple(e) for e in data.get("schedule", ()))
        data["cluster"] = ClusterSpec(**data.get("cluster", {}))
        return cls(**data)
