"""The embedded engine's parameters laid out flat, and flattened buckets received straight
into them.

Why: a `flattened_bucket` broadcast (SGLang's format: the bytes of a bucket's tensors back to
back, `wire.transport`) received into a freshly allocated buffer and then copied into the
parameters costs each engine first-touch page faults over every byte and a memcpy of every
byte, on top of the transport itself. When the parameters lie back to back in the order the
sender sends them, a bucket is a byte range of the model: the broadcast lands in place, with
no buffer and no copy.

Layout (`FlatParameters`): one contiguous tensor per dtype, every parameter a view into it
(each tensor once: a tied `lm_head.weight` is the embedding's tensor and has no place of its
own, whichever of the two names a sender sends first). The order starts as the model's state
dict, the HF order a sender streaming an HF state dict uses (the benchmark, trainers holding an
HF model). The Megatron learner streams in its module order (`weights.stream`: per layer
input_layernorm, o_proj, q/k/v, ... in the local spec, another order in the TE spec), so the
layout follows the senders: when a sync's buckets arrive out of the layout's order, the
parameters are laid out again in the order they came, once, after the sync's last bucket (the
one carrying the weight version, while the engine is paused for the sync). From the next sync
on they land in place. A bucket mixing dtypes never lands in place and never asks for a
re-layout.

Fallback (`BucketReceiver`): a bucket that is not such a range (another order, another dtype,
which is cast, a tied model's `lm_head.weight`) is received into one of two scratch buffers
kept across buckets (allocated when a larger bucket comes, touched once) and copied, as
before. Two, because bucket k is loaded outside the receive lock while bucket k+1 is
received; a third receive waits until a load hands its buffer back.

Release / resume: releasing `weights` drops the storages (or keeps them as the CPU backup
with --enable-weights-cpu-backup) and the scratch buffers; resuming allocates the storages
again in the current order.

A re-layout goes one dtype at a time; on an accelerator each old storage is staged in host
memory before its successor is allocated, so the device never holds the model twice.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dapo_mega.engines.sglang.api import FLATTENED_BUCKET
from dapo_mega.wire import transport


@dataclass(frozen=True)
class _Slot:
    """Where one parameter lies: elements [start, end) of the storage of its dtype."""

    dtype: torch.dtype
    start: int
    end: int


class FlatParameters:
    """The model's parameters as views into one storage per dtype, in `order`.

    Not thread-safe: the caller (`ModelRunner`) holds its model lock around every method.
    """

    def __init__(self, params: Dict[str, torch.Tensor], shapes: Dict[str, Tuple[int, ...]]):
        self.params = params
        self.shapes = shapes
        self.order: List[str] = []
        """The names laid out, in storage order (one name per distinct tensor)."""
        self.slots: Dict[str, _Slot] = {}
        self.storages: Dict[torch.dtype, torch.Tensor] = {}
        """dtype -> the flat tensor its parameters view; empty while the weights are released."""
        self._backup: Dict[torch.dtype, torch.Tensor] = {}

    def plan(self, order: Sequence[str]) -> None:
        """Place the parameters in `order` (names it lacks follow in their present order);
        `allocate` moves them there."""
        slots, ends, placed, names = {}, {}, set(), []
        canonical: Dict[int, str] = {}  # a tied tensor's place is its first name's (the embedding's)
        for name, p in self.params.items():
            canonical.setdefault(id(p), name)
        for name in list(order) + self.order + list(self.params):
            p = self.params.get(name)
            if p is None or id(p) in placed:
                continue
            placed.add(id(p))
            name = canonical[id(p)]
            numel = 1
            for s in self.shapes[name]:
                numel *= s
            start = ends.get(p.dtype, 0)
            slots[name] = _Slot(p.dtype, start, start + numel)
            ends[p.dtype] = start + numel
            names.append(name)
        self.order, self.slots = names, slots

    def allocate(self, contents: str = "current") -> None:
        """New storages in the planned order, each parameter's data pointed at its view.
        contents: "current" (copied from the parameters), "backup" (the storages kept at
        release, laid out as now) or "zeros"."""
        sizes: Dict[torch.dtype, int] = {}
        for slot in self.slots.values():
            sizes[slot.dtype] = max(sizes.get(slot.dtype, 0), slot.end)
        device = next(iter(self.params.values())).device
        if contents == "backup":
            storages = self._backup
        elif contents == "zeros":
            storages = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()}
        else:
            storages = {dt: torch.empty(n, dtype=dt, device=device) for dt, n in sizes.items()}
        for name, slot in self.slots.items():
            p = self.params[name]
            view = storages[slot.dtype][slot.start:slot.end].view(self.shapes[name])
            if contents == "current":
                view.copy_(p.data)
            p.data = view
        self.storages, self._backup = storages, {}

    def relayout(self, order: Sequence[str]) -> None:
        """Lay the parameters out again in `order`, keeping their values, one dtype at a time.
        On an accelerator each old storage goes to host memory before its successor is
        allocated, so the device holds the model once (plus nothing); on a CPU the old and the
        new storage of one dtype coexist while it is copied."""
        old_slots, old_storages, self.storages = self.slots, self.storages, {}
        self.plan(order)
        for dtype in list(old_storages):
            storage = old_storages.pop(dtype)
            device = storage.device
            staged = storage if device.type == "cpu" else storage.to("cpu")
            for name, slot in old_slots.items():  # the parameters view the staged copy alone
                if slot.dtype == dtype:
                    self.params[name].data = staged[slot.start:slot.end].view(self.shapes[name])
            del storage, staged
            new = torch.empty(max(s.end for s in self.slots.values() if s.dtype == dtype), dtype=dtype, device=device)
            for name, slot in self.slots.items():
                if slot.dtype == dtype:
                    p = self.params[name]
                    view = new[slot.start:slot.end].view(self.shapes[name])
                    view.copy_(p.data)
                    p.data = view
            self.storages[dtype] = new

    def release(self, keep_backup: bool) -> None:
        """Free the storages (kept aside as the backup when `keep_backup`)."""
        self._backup = self.storages if keep_backup else {}
        for name in self.slots:
            p = self.params[name]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.storages = {}

    def resume(self) -> None:
        self.allocate("backup" if self._backup else "zeros")

    def in_layout(self, names: Sequence[str], dtypes: Sequence[torch.dtype]) -> bool:
        """Whether every tensor has a place of its own, of its dtype (in any order)."""
        return all(n in self.slots and self.slots[n].dtype == dt for n, dt in zip(names, dtypes))

    def span(self, names: Sequence[str], dtypes: Sequence[torch.dtype], nbytes: int) -> Optional[torch.Tensor]:
        """The bytes of the storage the bucket (`names` with `dtypes`, `nbytes` in all,
        flattened in list order) covers exactly, as a uint8 view; None when it covers no
        contiguous range of one storage in that order."""
        if not names or not self.storages or names[0] not in self.slots:
            return None
        first = self.slots[names[0]]
        end = first.start
        for name, dtype in zip(names, dtypes):
            slot = self.slots.get(name)
            if slot is None or slot.dtype != first.dtype or dtype != first.dtype or slot.start != end:
                return None
            end = slot.end
        flat = self.storages[first.dtype][first.start:end].view(torch.uint8)
        return flat if flat.numel() == nbytes else None


class ScratchBuffers:
    """Two uint8 receive buffers kept across buckets, touched when allocated; a buffer is
    held from its receive until its load is done, never handed to two at once."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: List[Optional[torch.Tensor]] = [None, None]
        self._free = [True, True]
        self._cond = threading.Condition()
        self.allocations = 0

    def acquire(self, nbytes: int) -> Tuple[int, torch.Tensor]:
        """(index, a buffer of exactly `nbytes`), waiting for a free one."""
        with self._cond:
            self._cond.wait_for(lambda: any(self._free))
            i = self._free.index(True)
            self._free[i] = False
            buf = self._buffers[i]
            if buf is None or buf.numel() < nbytes:
                self._buffers[i] = None  # freed before its successor is allocated
                buf = self._buffers[i] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
                self.allocations += 1
            return i, buf[:nbytes]

    def release(self, index: int) -> None:
        with self._cond:
            self._free[index] = True
            self._cond.notify()

    def free(self) -> None:
        """Drop the buffers no receive holds (the engine's memory is released): the next
        bucket that needs one allocates it again."""
        with self._cond:
            self._buffers = [None if free else buf for buf, free in zip(self._buffers, self._free)]


@dataclass
class ReceiveStats:
    """How flattened buckets were received (the engine's `/server_info` `weight_receive`)."""

    direct_buckets: int = 0
    """Received straight into the parameters."""
    scratch_buckets: int = 0
    """Received into a scratch buffer and copied (another order or dtype, a tied lm_head)."""
    scratch_allocations: int = 0
    relayouts: int = 0
    """Times the parameters were laid out again in the order a sync sent them."""


@dataclass
class Received:
    """One received bucket, still to be loaded: tensors to copy (none when it landed in place)
    and the scratch buffer to hand back afterwards."""

    named: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    release: Callable[[], None] = lambda: None


class BucketReceiver:
    """Receives `/update_weights_from_distributed` buckets into a `ModelRunner` and loads them
    (the runner is not imported here: model_runner imports this module)."""

    def __init__(self, runner):
        self.runner = runner
        self.scratch = ScratchBuffers(runner.device)
        self.stats = ReceiveStats()
        self._sent_order: List[str] = []
        """Names received since the last sync ended, in order."""
        self._misplaced = False
        """A bucket of this sync had the layout's dtypes but not its order."""

    def stats_dict(self) -> dict:
        return {**asdict(self.stats), "scratch_allocations": self.scratch.allocations}

    def receive(self, pg, names: List[str], dtypes: List[torch.dtype], shapes: List[List[int]],
                load_format: Optional[str]) -> Received:
        """Receive one bucket from group rank 0 as SGLang's receiver does: flattened_bucket is
        one uint8 broadcast of the tensors' bytes back to back, the per-tensor format one
        broadcast per tensor in list order."""
        runner = self.runner
        flat = runner.flat
        if load_format != FLATTENED_BUCKET:
            return Received(_receive_per_tensor(pg, names, dtypes, shapes, runner.device))
        metas, nbytes = transport.bucket_layout(names, dtypes, shapes)
        with runner.model_lock:  # a forward step never sees a half-received bucket
            if runner.weights_released:
                raise RuntimeError("weights are released; call /resume_memory_occupation first")
            if len(self._sent_order) > len(runner.views):  # syncs that never set a version
                self._sent_order, self._misplaced = [], False
            self._sent_order.extend(names)
            target = flat.span(names, dtypes, nbytes)
            if target is None:
                # a bucket of one dtype whose tensors all have places of it lands in place once
                # the layout follows the sender; one of mixed dtypes never can (one storage per dtype)
                self._misplaced = self._misplaced or (len(set(dtypes)) == 1 and flat.in_layout(names, dtypes))
            else:
                torch.distributed.broadcast(target, src=0, group=pg)
                self.stats.direct_buckets += 1
                return Received()
        index, buf = self.scratch.acquire(nbytes)
        try:
            torch.distributed.broadcast(buf, src=0, group=pg)
        except BaseException:
            self.scratch.release(index)
            raise
        self.stats.scratch_buckets += 1
        return Received(transport.unflatten_bucket(buf, metas), lambda: self.scratch.release(index))

    def load(self, received: Received, weight_version: Optional[str]) -> None:
        """Copy what did not land in place, set the version; a sync's last bucket (the one with
        a version) lays the parameters out in the order the sync sent them, if it differed."""
        try:
            self.runner.load_named_tensors(received.named, weight_version)
        finally:
            received.release()
        if weight_version is not None:
            with self.runner.model_lock:
                if self._misplaced and not self.runner.weights_released:
                    self.runner.flat.relayout(self._sent_order)
                    self.stats.relayouts += 1
                self._sent_order, self._misplaced = [], False


def _receive_per_tensor(pg, names, dtypes, shapes, device) -> List[Tuple[str, torch.Tensor]]:
    out, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty([int(s) for s in shape], dtype=dtype, device=device)
        handles.append(torch.distributed.broadcast(t, src=0, group=pg, async_op=True))
        out.append((name, t))
    for h in handles:
        h.wait()
    return out
