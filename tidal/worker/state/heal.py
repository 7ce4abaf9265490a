"""Healing: every member of a new generation adopts the state of the most advanced one.

The members learn each other's committed step (each publishes its own in the store before
the group forms and reads the others' once it formed: ``group.member_steps``; or an
all-gather over the group, without them); the lowest rank among those with the highest
step is the source and sends model, optimizer, RNG and step to the members behind it, and
only to them: members already at that step hold the same state (synchronous training
keeps them equal), so a scale-up sends to the joiners alone and a scale-down sends nothing.
Joiners (no state yet) and laggards (a peer died mid all-reduce, leaving one survivor past
the step and another before it) take the same path, so a join and a failure share one code
path. Messages live on the group's wire device (``devices.wire_device``: the CPU for gloo,
whatever the tensors' device; the GPU for NCCL): a tensor elsewhere travels as a copy there
and lands back in place. The optimizer's structure travels as a small blob (``blob``:
tagged JSON and raw tensor bytes, no pickle), the tracked objects' as JSON text inside it; their tensors travel raw, into
tensors the receivers allocate from that structure. On gloo the heal waits for its messages through the
worker's ``Waits`` (``waits``), so the abort watch can cut a heal that a lost peer left
blocked. A receiver on the source's host reads the tensors straight from the source's
memory instead (``cma``: one copy, not two through loopback sockets), and says so; the
source waits for that word from each receiver and sends through gloo to those that could not.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal import devices
from tidal.tracked import Captured, TrackedState
from tidal.worker.state import blob, cma
from tidal.worker.state.landing import Landing, state_tensors
from tidal.worker.waits import Waits

CPU = torch.device("cpu")

NO_STATE = -1


class HealInterrupted(RuntimeError):
    """The heal failed after this member had begun to overwrite its state with the source's
    (the model's tensors are received in place): it holds a mix of two steps and must no
    longer claim any. Raised from the receiver's error; the caller forgets its state, so a
    later generation heals it, rolls back to a checkpoint, or refuses (``StateLost``), but
    never trains on the mix or offers it as a source."""

    def __init__(self, source: int, step: int, cause: BaseException) -> None:
        super().__init__(
            f"the heal from rank {source} (step {step}) was cut after this member's state "
            f"began to be overwritten: {type(cause).__name__}: {cause}"
        )
        self.source, self.step = source, step


class ModelMismatch(RuntimeError):
    """This receiver's model is not the source's: a parameter or buffer differs in shape or
    dtype, or one side has more (a script that builds its model from the rank, the world
    size or the machine). Raised before anything is received, so this member's state is
    untouched; the member reports it as ``FailureKind.SCRIPT_MISMATCH`` and the coordinator
    fails the job at once quoting this line (no re-form can mend it). Receiving anyway
    would abort in gloo, or, where the sizes happen to agree, load one tensor's data into
    another: a silent divergence. The sharded heal checks the same (``shard_heal``)."""

    def __init__(self, here: list[str] | None, there: list[str] | None) -> None:
        name = (here or there)[0]
        super().__init__(
            f"this worker's model differs from the source's at {name}: {_say(here)} here, "
            f"{_say(there)} at the source; every worker must build the same model"
        )


def _say(t: list[str] | None) -> str:
    return f"{t[1]} {t[2]}" if t is not None else "no such tensor"


class StateLost(RuntimeError):
    """No member of the generation holds the job's committed state (its holders were lost):
    training on would silently start over from an older step. Every member raises it at the
    same point (they all see the same gathered steps)."""

    def __init__(self, best: int, committed: int) -> None:
        held = (
            "no member holds any state"
            if best == NO_STATE
            else f"the most advanced member is at step {best}"
        )
        super().__init__(f"{held}, but the job had committed step {committed}")
        self.best, self.committed = best, committed


@dataclass(frozen=True, kw_only=True)
class HealResult:
    """``sent``: state moved to or from this member; ``direct``: this receiver read it from
    the source's memory (``cma``), not through the group."""

    source: int
    step: int
    sent: bool
    direct: bool = False


def _wait(works: list[dist.Work], waits: Waits | None) -> None:
    if waits is not None:
        waits.wait_all(works)
        return
    for work in works:
        work.wait()


#: Bytes of a blob's first message: its length (8 bytes) and as much of the blob as fits.
BLOB_FIRST = 128 << 10


def send_blob(
    blob: bytes | None,
    src: int,
    receivers: list[int],
    wire: torch.device = CPU,
    waits: Waits | None = None,
) -> bytes:
    """``src`` sends ``blob`` to ``receivers``; each gets its bytes back. One message of
    ``BLOB_FIRST`` bytes (the length, then the blob, zero-padded) carries a blob that fits,
    a second one the rest of one that does not: each message on the heal's path costs a
    hand-off between processes (~1 ms on busy cores), and a blob is ~12 KB for most models."""
    first = torch.zeros(BLOB_FIRST, dtype=torch.uint8)
    if blob is not None:
        head = len(blob).to_bytes(8, "little") + blob[: BLOB_FIRST - 8]
        first[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    first = first.to(wire)
    _transfer([first], src, receivers, waits)
    head = first[:8].cpu().numpy().tobytes() if blob is None else b""
    size = len(blob) if blob is not None else int.from_bytes(head, "little")
    rest = max(0, size - (BLOB_FIRST - 8))
    if rest:
        if blob is not None:
            more = torch.frombuffer(bytearray(blob[BLOB_FIRST - 8 :]), dtype=torch.uint8)
        else:
            more = torch.empty(rest, dtype=torch.uint8)
        more = more.to(wire)
        _transfer([more], src, receivers, waits)
    if blob is not None:
        return blob
    data = first[8 : 8 + size - rest].cpu().numpy().tobytes()
    return data + (more.cpu().numpy().tobytes() if rest else b"")


LARGE = 1 << 18  # elements: a tensor this big travels alone, in place, with no copy


def _transfer(
    tensors: list[torch.Tensor], src: int, receivers: list[int], waits: Waits | None = None
) -> None:
    """``src`` sends each tensor to every receiver; receivers fill theirs in place. All the
    messages are posted before any is waited for, so they stream back to back; gloo matches
    messages between two ranks in the order they were posted."""
    rank = dist.get_rank()
    if rank == src:
        works = [dist.isend(t, dst) for dst in receivers for t in tensors]
    elif rank in receivers:
        works = [dist.irecv(t, src) for t in tensors]
    else:
        return
    _wait(works, waits)


@torch.no_grad()
def _send_tensors(
    tensors: list[torch.Tensor],
    src: int,
    receivers: list[int],
    wire: torch.device = CPU,
    waits: Waits | None = None,
) -> None:
    """Large tensors travel one message each: in place when contiguous on the wire device,
    else as a contiguous copy there; the small ones are flattened into one message per dtype
    (a message each would cost its latency). Which message a tensor travels in depends on
    its size alone, never on its strides or device, which the sender's and a receiver's
    copies of it need not share (a receiver's tensors are allocated fresh, or taken from its
    landing): otherwise the two sides would disagree on the messages and gloo would abort,
    or, were the sizes to match, a tensor would receive another's data."""
    large, moved, by_dtype = [], [], {}
    sending = dist.get_rank() == src
    for t in tensors:
        if t.numel() >= LARGE:
            if t.device == wire and t.is_contiguous():
                large.append(t.detach())
            else:  # a copy travels: the sender's holds the data, the receiver's lands back
                copy = (
                    t.detach().to(wire).contiguous()
                    if sending
                    else torch.empty(t.shape, dtype=t.dtype, device=wire)
                )
                large.append(copy)
                moved.append((copy, t))
        else:
            by_dtype.setdefault(t.dtype, []).append(t)
    flats = [
        torch.cat([t.detach().reshape(-1).to(wire) for t in group])
        if sending
        else torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=wire)
        for group in by_dtype.values()
    ]
    _transfer(large + flats, src, receivers, waits)
    if sending:
        return
    for copy, t in moved:
        t.copy_(copy)
    for flat, group in zip(flats, by_dtype.values(), strict=True):
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def heal(
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int | None,
    committed_step: int = 0,
    tracked: TrackedState | None = None,
    wire: torch.device = CPU,
    waits: Waits | None = None,
    landing: Sequence[torch.Tensor] = (),
    steps: Sequence[int] | None = None,
) -> HealResult:
    """Make this member's state equal to the most advanced member's: model, optimizer, RNG
    and ``tracked`` objects. ``step`` is this member's committed step, or None if it holds
    no trained state yet; ``committed_step`` a lower bound of the job's committed step
    (``GenerationInfo.committed_step``). Raises ``StateLost`` when the most advanced member
    is more than one step behind it (members are at most one step apart, so a member with
    the state is never further behind). ``wire``: the group's wire device; ``waits``: on
    gloo, the worker's abortable waits (module doc). A receiver whose transfer fails raises
    ``HealInterrupted``: its state is then a mix and must be forgotten. A receiver receives
    the optimizer's state into its own optimizer's tensors and into ``landing``
    (``landing.prepare``) where shapes and dtypes match: memory already touched.
    ``steps``: every member's committed step by rank (``NO_STATE`` for none) when the caller
    already has them (``group.member_steps``, exchanged through the store as the group
    formed); None: gathered here, over the group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    values = _gather_steps(step, world, wire, waits) if steps is None else list(steps)
    if len(values) != world or values[rank] != (NO_STATE if step is None else step):
        raise ValueError(f"steps {values} do not name this member (rank {rank}) at {step}")
    best = max(values)
    if best < committed_step - 1:
        raise StateLost(best, committed_step)
    source = values.index(best)
    if best == NO_STATE:  # a fresh job: everybody adopts rank 0's initialisation
        best, source = 0, 0
        values = [NO_STATE if r else 0 for r in range(world)]
    receivers = [r for r, v in enumerate(values) if r != source and v != best]
    if not receivers:
        return HealResult(source=source, step=best, sent=False)
    if rank != source and rank not in receivers:  # already holds the source's state
        return HealResult(source=source, step=best, sent=False)
    # The optimizer's structure travels first, as a small blob, so that the receivers can
    # allocate its tensors; then every tensor (model, optimizer, tracked) streams in one
    # transfer: the model's in place, the rest straight into the allocated tensors.
    model = list(module.parameters()) + list(module.buffers())
    if rank == source:
        layout, tensors = _split_state(optimizer.state_dict())
        captured = tracked.capture() if tracked else Captured(skeleton={}, tensors=[])
        extra = captured.tensors
        sending = model + tensors + extra
        hold = cma.Hold()
        direct = cma.offer(sending, hold) if wire.type == "cpu" and cma.offerable(sending) else None
        meta = blob.encode(
            {
                "layout": layout,
                "torch_rng": torch.get_rng_state(),
                "python_rng": json.dumps(random.getstate()),  # JSON: 0.8 ms less to load
                "cuda_rng": devices.cuda_rng_state(),
                "tracked": captured.to_json(),  # JSON text: no pickle of user objects
                "model": model_layout(module),
                "cma": direct,
            }
        )
        with cma.allow(direct is not None):  # readable until each receiver said it is done
            try:
                send_blob(meta, source, receivers, wire, waits)
                readers = _hear_reads(source, receivers, wire, waits) if direct else set()
            finally:  # from here on the tensors may change: a read not done is refused
                hold.release()
        rest = [r for r in receivers if r not in readers]
        if rest:
            _send_tensors(sending, source, rest, wire, waits)
        return HealResult(source=source, step=best, sent=True)
    meta = blob.decode(send_blob(None, source, receivers, wire, waits))
    shipped = json.loads(meta["tracked"])
    # Into its own optimizer's tensors and the landing, where they fit.
    check_model(model_layout(module), meta["model"])
    land = Landing(state_tensors(optimizer.state_dict()) + list(landing))
    tensors = [land.take(shape, dtype) for shape, dtype in meta["layout"]["tensors"]]
    extra = [land.take(shape, dtype) for shape, dtype in shipped["tensors"]]
    direct, said = False, []
    try:  # from here on this member's own state is being overwritten
        if meta.get("cma") is not None:
            direct, said = _read_direct(meta["cma"], model + tensors + extra, source, wire, waits)
        if not direct:
            _send_tensors(model + tensors + extra, source, [rank], wire, waits)
        optimizer.load_state_dict(_join_state(meta["layout"], tensors))
        torch.set_rng_state(meta["torch_rng"])
        version, internal, gauss = json.loads(meta["python_rng"])
        random.setstate((version, tuple(internal), gauss))
        devices.set_cuda_rng_state(meta.get("cuda_rng"))
        if tracked is not None or shipped["skeleton"]:
            (tracked or TrackedState({})).restore(shipped["skeleton"], extra)
        _wait(said, waits)  # the word to the source, sent while the state above loaded
    except Exception as exc:  # noqa: BLE001 - whatever cut it, the state is now a mix
        raise HealInterrupted(source, best, exc) from exc
    return HealResult(source=source, step=best, sent=True, direct=direct)


def _gather_steps(
    step: int | None, world: int, wire: torch.device, waits: Waits | None
) -> list[int]:
    mine = torch.tensor([NO_STATE if step is None else step], dtype=torch.int64, device=wire)
    steps = [torch.empty_like(mine) for _ in range(world)]
    _wait([dist.all_gather(steps, mine, async_op=True)], waits)
    return [int(t.item()) for t in steps]


def _read_direct(
    offer: dict, tensors: list[torch.Tensor], source: int, wire: torch.device, waits: Waits | None
) -> tuple[bool, list[dist.Work]]:
    """Read the source's offer into ``tensors`` if this receiver can (``cma.usable``) and
    tell the source whether it did (1 or 0): it sends through the group otherwise. Returns
    whether it read, and the word's send, for the caller to wait for once it has loaded
    what it read (a wait here held the receiver up by a hand-off between processes, 0.5 to
    3 ms on busy cores, while the source already had its word; a read that failed waits at
    once, before the tensors travel through the group)."""
    why = cma.usable(offer, cma.Host.here(), tensors)
    if why is None:
        try:
            cma.read(offer, tensors)
        except OSError as exc:
            why = f"the kernel refused the read: {exc}"
        if why is None and not cma.held(offer):  # it may have changed under the read
            why = "the source stopped holding its state before the read ended"
    if why is not None:
        _say_once(why)
    word = torch.tensor([0 if why else 1], dtype=torch.int64, device=wire)
    said = [dist.isend(word, source)]
    if why is not None:
        _wait(said, waits)
        return False, []
    return True, said


def _hear_reads(
    source: int, receivers: list[int], wire: torch.device, waits: Waits | None
) -> set[int]:
    """The receivers that read the source's offer themselves (each sends 1 or 0). Until
    each has answered, the source's tensors stay as they are: the source waits here."""
    words = {r: torch.empty(1, dtype=torch.int64, device=wire) for r in receivers}
    _wait([dist.irecv(w, r) for r, w in words.items()], waits)
    return {r for r, w in words.items() if int(w.item()) == 1}


_SAID: set[str] = set()


def _say_once(why: str) -> None:
    """A receiver that falls back to the group says why, once per reason and process."""
    if why not in _SAID:
        _SAID.add(why)
        logging.getLogger(__name__).info("heal through the group: %s", why)


def model_layout(module: torch.nn.Module) -> list[list[str]]:
    """[name, shape, dtype] of each parameter and buffer, in the order ``heal`` sends them."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [[n, str(list(t.shape)), str(t.dtype).removeprefix("torch.")] for n, t in named]


def check_model(mine: list[list[str]], source: list[list[str]]) -> None:
    """Raise ``ModelMismatch`` at the first tensor whose shape or dtype differs from the
    source's, or that one side lacks (names are not compared: a wrapper may rename)."""
    for here, there in itertools.zip_longest(mine, source):
        if here is None or there is None or here[1:] != there[1:]:
            raise ModelMismatch(here, there)


def _split_state(state_dict: dict) -> tuple[dict, list[torch.Tensor]]:
    """An optimizer state dict as (its structure with tensor slots, the tensors in order)."""
    tensors: list[torch.Tensor] = []
    state: dict = {}
    for pid, entries in state_dict["state"].items():
        state[pid] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                state[pid][key] = {"tensor": len(tensors)}
                tensors.append(value.detach())
            else:
                state[pid][key] = {"value": value}
    layout = {
        "param_groups": state_dict["param_groups"],
        "state": state,
        "tensors": [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors],
    }
    return layout, tensors


def _join_state(layout: dict, tensors: list[torch.Tensor]) -> dict:
    state = {
        pid: {k: tensors[v["tensor"]] if "tensor" in v else v["value"] for k, v in entries.items()}
        for pid, entries in layout["state"].items()
    }
    return {"state": state, "param_groups": layout["param_groups"]}
