"""Transport of named tensors between learners and engines.

* `init_custom_process_group`: SGLang's own way of creating a second "world" beside the
  default process group (sglang 0.5.23 `srt/utils/common.py`, after OpenRLHF): a `tcp://`
  rendezvous, a `PrefixStore(group_name, store)` and torch's `_new_process_group_helper`.
  The learner's source rank and every engine call this one function with the same
  address, world size and group name, so both sides build the identical group (NCCL on
  GPU, gloo on CPU), with NCCL's watchdog told to leave it alone
  (`WEIGHT_SYNC_NCCL_ERROR_HANDLING`): a member lost mid-broadcast is aborted by the trainer. One difference: rank 0 here always hosts the rendezvous store.
  torch's `tcp://` rendezvous does not under torchrun (TORCHELASTIC_USE_AGENT_STORE=True
  makes every rank a client of a store it expects torchrun's agent to host), and a
  learner rank started by torchrun is rank 0 of the weight-update group: nobody would
  host its store and every engine would wait out the timeout.
* Flattened buckets: SGLang's `load_format="flattened_bucket"` layout
  (`weight_sync/tensor_bucket.py`): the bytes of every tensor of a bucket concatenated
  into one uint8 tensor in list order; one broadcast moves the whole bucket.
* Shared-memory handles (CPU colocated mode): the learner writes a bucket's bytes into a
  file under /dev/shm and sends JSON metadata (path, names, dtypes, shapes, offsets); the
  engine maps the file and copies. Nothing received over the network is ever unpickled.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from dapo_mega.distributed import NCCL_ERROR_HANDLING_ENV
from dapo_mega.run_files.checkpoints import write_bytes_atomic

DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
    "int8": torch.int8, "bool": torch.bool,
}
ENGINE_DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                                          "float16": torch.float16, "half": torch.float16, "auto": torch.float32}
"""An engine's `--dtype` (sglang.launch_server's names) -> the dtype the embedded engine loads
the model in, which the learner's checksums of its weights are computed in."""
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
SHM_PREFIX = "dapo_mega_weights_"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the spelling SGLang's `dtypes` field takes)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" -> torch.bfloat16; ValueError for anything else."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[key]


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: Optional[timedelta] = None,
):
    """A process group independent of the default one (SGLang's `init_custom_process_group`).

    Args:
        backend: "gloo" (CPU) or "nccl".
        init_method: "tcp://host:port" of the rendezvous (rank 0 hosts the store).
        world_size: learner source rank + all engine ranks.
        rank: 0 for the learner source; engines use rank_offset + their TP rank.
        group_name: distinct per group (one group per PP stage); also the store prefix.
    Returns:
        the ProcessGroup; use it as `group=` in collectives with group-local ranks.
    """
    from urllib.parse import urlparse

    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
    )

    timeout = timeout or default_pg_timeout
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    # rank 0 hosts the store itself, also under torchrun (see the module docstring)
    store = TCPStore(url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    store = PrefixStore(group_name, store)
    with _nccl_error_handling(WEIGHT_SYNC_NCCL_ERROR_HANDLING):  # read by ProcessGroupNCCL's constructor
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), store, group_name=group_name,
            backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


WEIGHT_SYNC_NCCL_ERROR_HANDLING = "0"
"""NCCL_ERROR_HANDLING_ENV of a weight-update group: torch 2.13's `_abort_process_group`
(`abort_custom_process_group`, an engine lost mid-sync) "should be used with
TORCH_NCCL_ASYNC_ERROR_HANDLING turned off (i.e. set to 0). Otherwise, ProcessGroupNCCL's
watchdog may automatically handle errors or timeouts for you including aborting the
ProcessGroup"; at torch's default (3) that handling ends the learner process, which the
trainer would otherwise outlive by dropping the engine. Only this group: the learner's own
keep `distributed.LEARNER_NCCL_ERROR_HANDLING`."""


@contextlib.contextmanager
def _nccl_error_handling(value: str) -> Iterator[None]:
    """NCCL_ERROR_HANDLING_ENV = `value` while a group is built, the process's own afterwards."""
    saved = os.environ.get(NCCL_ERROR_HANDLING_ENV)
    os.environ[NCCL_ERROR_HANDLING_ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(NCCL_ERROR_HANDLING_ENV, None)
        else:
            os.environ[NCCL_ERROR_HANDLING_ENV] = saved


def destroy_custom_process_group(pg) -> None:
    """Tear down a group made by `init_custom_process_group`."""
    torch.distributed.destroy_process_group(pg)


def abort_custom_process_group(pg) -> None:
    """Tear down a group made by `init_custom_process_group` whose collective may still be in
    flight towards a member that is gone: NCCL aborts its communicator (a destroy would wait
    for the enqueued broadcast under the watchdog); gloo's failed or pending work ends with
    its sockets."""
    try:
        torch.distributed.distributed_c10d._abort_process_group(pg)
    except (RuntimeError, ValueError, NotImplementedError, AttributeError):  # gloo: no abort
        torch.distributed.destroy_process_group(pg)


@dataclass
class TensorMeta:
    """Where one tensor lies inside a flattened bucket: bytes [start, end)."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    start: int
    end: int


def bucket_layout(names: Sequence[str], dtypes: Sequence[torch.dtype],
                  shapes: Sequence[Sequence[int]]) -> Tuple[List[TensorMeta], int]:
    """Byte offsets of each tensor in SGLang's flattened-bucket layout; returns (metas, nbytes)."""
    metas, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        metas.append(TensorMeta(name, dtype, tuple(int(s) for s in shape), offset, offset + nbytes))
        offset += nbytes
    return metas, offset


def flatten_bucket(tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate the bytes of `tensors` into one uint8 tensor [sum nbytes] (into `out` if given)."""
    flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    total = sum(f.numel() for f in flats)
    if out is None:
        return torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8)
    out = out[:total]
    torch.cat(flats, out=out)
    return out


def unflatten_bucket(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> List[Tuple[str, torch.Tensor]]:
    """Views of `flat` (uint8) as the named tensors of `metas` (no copy)."""
    return [(m.name, flat[m.start:m.end].view(m.dtype).view(m.shape)) for m in metas]


# ---------------------------------------------------------------- shared memory (CPU colocated)

def write_shm_bucket(named_tensors: Sequence[Tuple[str, torch.Tensor]],
                     shm_dir: Path = SHM_DIR) -> dict:
    """Write a bucket's bytes to a fresh shared-memory file; return its JSON handle.

    Handle: {"path", "nbytes", "tensors": [{"name", "dtype", "shape", "start", "end"}]}.
    The caller deletes the file (`remove_shm_bucket`) once every engine has loaded it.
    """
    names = [n for n, _ in named_tensors]
    tensors = [t for _, t in named_tensors]
    metas, nbytes = bucket_layout(names, [t.dtype for t in tensors], [t.shape for t in tensors])
    path = Path(shm_dir) / f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex}.bin"
    # tmpfs and read at once by the engines: a crash loses nothing an fsync would have kept
    write_bytes_atomic(path, flatten_bucket(tensors).cpu().numpy().tobytes(), durable=False)
    return {"path": str(path), "nbytes": nbytes,
            "tensors": [{"name": m.name, "dtype": dtype_name(m.dtype), "shape": list(m.shape),
                         "start": m.start, "end": m.end} for m in metas]}


def remove_shm_bucket(handle: dict) -> None:
    Path(handle["path"]).unlink(missing_ok=True)


def parse_shm_handle(handle: dict, shm_dir: Path = SHM_DIR) -> Tuple[Path, List[TensorMeta]]:
    """Validate a JSON handle: the file must be one of ours under `shm_dir`; metas consistent."""
    if not isinstance(handle, dict) or set(handle) != {"path", "nbytes", "tensors"}:
        raise ValueError("shared-memory handle must have exactly the keys path, nbytes, tensors")
    path = Path(handle["path"]).resolve()
    if path.parent != Path(shm_dir).resolve() or not path.name.startswith(SHM_PREFIX):
        raise ValueError(f"shared-memory handle path {handle['path']!r} is not a {SHM_PREFIX}* file "
                         f"in {shm_dir}")
    metas = []
    for t in handle["tensors"]:
        metas.append(TensorMeta(str(t["name"]), parse_dtype(t["dtype"]), tuple(int(s) for s in t["shape"]),
                                int(t["start"]), int(t["end"])))
    expect, nbytes = bucket_layout([m.name for m in metas], [m.dtype for m in metas], [m.shape for m in metas])
    if [(m.start, m.end) for m in expect] != [(m.start, m.end) for m in metas] or nbytes != int(handle["nbytes"]):
        raise ValueError("shared-memory handle offsets do not match the names/dtypes/shapes")
    return path, metas


def read_shm_bucket(path: Path, metas: Sequence[TensorMeta]) -> List[Tuple[str, torch.Tensor]]:
    """Map the file and return named tensor views of it (the file is read-only mapped)."""
    nbytes = metas[-1].end if metas else 0
    if path.stat().st_size != nbytes:
        raise ValueError(f"{path} has {path.stat().st_size} bytes, handle says {nbytes}")
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=nbytes)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return unflatten_bucket(flat, metas)


# ---------------------------------------------------------------- CUDA IPC (GPU colocated)

REDUCE_TENSOR_ARG_DEVICE_INDEX = 6
"""Position of `storage_device` in the arguments torch's `reduce_tensor` returns for
`rebuild_cuda_tensor` (the constant of sglang 0.5.23 `utils/patch_torch.py`)."""


def device_to_uuid(device: int, uuid_of: Optional[Callable[[int], str]] = None) -> str:
    """A CUDA device index of this process -> the GPU's UUID (the same in every process)."""
    uuid_of = uuid_of or (lambda index: str(torch.cuda.get_device_properties(index).uuid))
    return uuid_of(device)


def device_from_uuid(device: Union[int, str], uuids: Optional[Sequence[str]] = None) -> int:
    """A device index or UUID from another process -> this process's index of that GPU.

    Indices differ between processes whose CUDA_VISIBLE_DEVICES differ (a learner sees
    8 GPUs, an engine TP rank 4); UUIDs do not. `uuids`: the UUID of each device index
    this process sees (default: asked from torch)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        if uuids is None:
            uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        for index, uuid in enumerate(uuids):
            if uuid == device:
                return index
        raise ValueError(f"no visible CUDA device has uuid {device}")
    raise TypeError(f"device must be an index or a uuid, got {device!r}")


def _replace_arg(args: tuple, index: int, fn: Callable) -> tuple:
    return (*args[:index], fn(args[index]), *args[index + 1:])


def reduce_tensor(*args, **kwargs):
    """torch's `reduce_tensor`, a CUDA tensor's device given by its GPU's UUID (sending side)."""
    from torch.multiprocessing import reductions

    fn, fn_args = reductions._reduce_tensor_original(*args, **kwargs)
    if fn is reductions.rebuild_cuda_tensor or fn is reductions._rebuild_cuda_tensor_original:
        fn_args = _replace_arg(fn_args, REDUCE_TENSOR_ARG_DEVICE_INDEX, device_to_uuid)
    return fn, fn_args


def rebuild_cuda_tensor(*args):
    """torch's `rebuild_cuda_tensor`, the device given by index or UUID (receiving side)."""
    from torch.multiprocessing import reductions

    args = _replace_arg(args, REDUCE_TENSOR_ARG_DEVICE_INDEX, device_from_uuid)
    return reductions._rebuild_cuda_tensor_original(*args)


# A CUDA tensor's pickle names the function torch's reduce_tensor finds under
# `torch.multiprocessing.reductions.rebuild_cuda_tensor`, where `patch_torch_reductions`
# installs this one. SGLang's SafeUnpickler admits that name (and its own patch's), never a
# function of this package, and resolves it to the engine's own patched rebuild, which maps
# the UUID back to its device index. pickle checks that the name leads back to the object.
rebuild_cuda_tensor.__module__ = "torch.multiprocessing.reductions"


def patch_torch_reductions() -> None:
    """Pickle CUDA tensors with their GPU's UUID instead of its index, as SGLang's engine
    does (`monkey_patch_torch_reductions`, until pytorch#149248): the engine unpickles with
    the same patch and maps the UUID back to its own index. Idempotent; the same attribute
    names as SGLang's, so whichever runs first wins and both agree. What is pickled names
    `torch.multiprocessing.reductions.rebuild_cuda_tensor` (see `rebuild_cuda_tensor`)."""
    from torch.multiprocessing import reductions

    if hasattr(reductions, "_reduce_tensor_original"):
        return
    reductions._reduce_tensor_original = reductions.reduce_tensor
    reductions._rebuild_cuda_tensor_original = reductions.rebuild_cuda_tensor
    reductions.reduce_tensor = reduce_tensor
    reductions.rebuild_cuda_tensor = rebuild_cuda_tensor
    reductions.init_reductions()


def serialize_named_tensors(named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(list, output_str=True)`: the list pickled
    with torch.multiprocessing's reductions (CUDA tensors become IPC handles, by GPU UUID
    once `patch_torch_reductions` ran), base64 text. Only for a trusted engine on the same
    node: SGLang unpickles what it receives."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers the tensor reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump([(name, tensor) for name, tensor in named_tensors])
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def build_tp_payloads(per_rank: Sequence[Sequence[Tuple[str, torch.Tensor]]],
                      devices: Optional[Sequence[torch.device]] = None,
                      serialize: Callable[[Sequence[Tuple[str, torch.Tensor]]], str] = serialize_named_tensors
                      ) -> List[str]:
    """`serialized_named_tensors` of one `/update_weights_from_tensor` request: one payload
    per engine TP rank, payload r built from `per_rank[r]` — the same names, dtypes and
    shapes on every rank, each rank's tensors on its own GPU (`devices[r]` when given).

    SGLang's TP rank r unpickles only `serialized_named_tensors[r]` (tp_worker
    `deserialize_own_rank`): a payload copied to every rank would hand each rank handles to
    another rank's GPU memory (and break the sender's IPC reference counting).
    """
    if not per_rank:
        raise ValueError("no engine TP rank to build a payload for")
    reference = [(n, t.dtype, tuple(t.shape)) for n, t in per_rank[0]]
    for r, items in enumerate(per_rank):
        got = [(n, t.dtype, tuple(t.shape)) for n, t in items]
        if got != reference:
            raise ValueError(f"engine TP rank {r} would get other tensors than rank 0: {got[:2]}... vs "
                             f"{reference[:2]}...")
        if devices is not None:
            wrong = [n for n, t in items if t.device != torch.device(devices[r])]
            if wrong:
                raise ValueError(f"engine TP rank {r} is on {devices[r]} but its tensors {wrong[:3]} are not")
    if devices is not None and len(set(str(torch.device(d)) for d in devices)) != len(devices):
        raise ValueError(f"engine TP ranks share a device: {list(devices)}")
    return [serialize(items) for items in per_rank]


def serialize_cuda_ipc(named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """One rank's payload: `serialize_named_tensors` with the reductions patched by UUID."""
    patch_torch_reductions()
    return serialize_named_tensors(named_tensors)
