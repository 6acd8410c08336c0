"""CPU support for megatron-core 0.16.1: the CUDA calls it makes unconditionally, redirected.

megatron-core assumes a GPU in a handful of places even when every tensor lives on the
CPU (`use_cpu_initialization=True`, the local layer spec, the gloo backend). This module
is the one place where the learner substitutes them, so that the *same* megatron-core
code paths (GPTModel, tensor-parallel layers, pipeline schedules, DDP, the distributed
optimizer, grad clipping) run in CPU tests and in the embedded CPU default. It is applied
only when no GPU is present (`enable_cpu_support()` does nothing on a CUDA machine) and it
is idempotent.

The substitutions, process-wide:

1. `torch.cuda.current_device()` answers "cpu" (rotary embeddings and others place
   tensors with it).
2. CUDA RNG state -> CPU generator: `torch.cuda.{get_rng_state,set_rng_state,manual_seed}` and megatron's `tensor_parallel.random._get_cuda_rng_state` /
   `_set_cuda_rng_state`, which the model-parallel RNG tracker forks around attention even
   with dropout 0.
3. A `torch.overrides.TorchFunctionMode` (`CudaToCpuMode`) that rewrites any CUDA device
   argument (`device="cuda"`, `device=0`, `torch.device("cuda", i)`) of torch functions to
   the CPU and makes `Tensor.cuda()` / `.to("cuda")` stay on the CPU: pipeline schedules
   and the default causal mask build `device="cuda"` tensors.
4. `torch.cuda.synchronize()` (p2p communication): a no-op.
5. `Tensor.type()` reports CPU float tensors under their CUDA names
   ("torch.cuda.FloatTensor", ...), because the optimizer and grad clipping compare these
   strings and raise otherwise.
6. The default causal mask (`transformer.utils.get_default_causal_mask`, imported by the
   fused-softmax fallback) is built on the CPU, so that a micro-batch's forward, loss and
   backward make no CUDA call of their own: the pipeline schedules' per-micro-batch
   `forward_step` and `backward_step` run outside the function mode
   (`without_function_mode`), which saves its per-op cost. The schedule skeletons (their
   `device="cuda"` token counters), p2p, DDP's grad sync and the optimizer stay under it.

8. CUDA streams and events (the MoE all-to-all token dispatcher copies its split sizes to
   the host on a side stream): `torch.cuda.Stream()` and `torch.cuda.current_stream()` are
   one null stream, so the dispatcher sees no side stream; `torch.cuda.stream(s)` is a no-op
   context and the stream's events are complete when recorded (CPU work is synchronous).

9. The MoE all-to-all's split sizes become host lists (`moe_utils.maybe_move_tensor_to_cpu`
   with `as_numpy`, in the token dispatcher): megatron-core converts only tensors on a GPU,
   so on the CPU they stayed tensors, which `all_to_all_single` refuses as split sizes.

7. megatron-core's fusions stay eager: its `jit_fuser` (`torch.compile` since torch 2.2)
   wraps 38 functions as megatron-core is imported, which costs ~1.7 s of a core per process
   (it imports torch's inductor) and would compile nothing a CPU run uses. The package's
   `__init__` installs `keep_fusions_eager()`, which calls megatron's own
   `disable_jit_fuser()` the moment `megatron.core.jit` has loaded, before any fusion is
   decorated. Unlike 1-6 it is in place before megatron-core is imported.

Any other CUDA call megatron-core makes fails loudly (torch raises "Torch not compiled
with CUDA enabled"): that is deliberate, so a new code path is noticed, not skipped.
The function mode costs Python overhead per torch call; it is a test/CPU path, the GPU
path never installs it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from torch.types import Device

_ENABLED = False
_LOCK = threading.Lock()
_MODE: Optional["CudaToCpuMode"] = None

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int device index means a CUDA ordinal to torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


def _to_cpu_device(value: object) -> object:
    return _CPU if _is_cuda_device(value) else value


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch function call.

    Handles `device=` keywords (factory functions, `Tensor.to`, `Tensor.new_*`), positional
    device arguments of `Tensor.to`, `Tensor.cuda()` (returns the tensor itself) and
    `Tensor.type()` without arguments (CUDA type names, see the module docstring).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            non_blocking = kwargs.get("non_blocking", False)
            del non_blocking  # a CPU tensor "moved" to the CPU is itself
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]) and not isinstance(args[1], int):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


def _cpu_get_rng_state(device: Device = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: Device = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """megatron's `get_default_causal_mask` (True above the diagonal = masked), on the CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@contextlib.contextmanager
def without_function_mode() -> Iterator[None]:
    """Run the block without `CudaToCpuMode` (a no-op unless the CPU support is enabled).

    For code that makes no CUDA call of its own once the substitutions 1, 2 and 6 are in
    place: a micro-batch's forward, loss and backward on the local spec. A CUDA call inside
    still fails loudly.
    """
    if not _ENABLED:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


def _outside_function_mode(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with without_function_mode():
            return func(*args, **kwargs)

    return wrapper


class _NullEvent:
    """A CUDA event of the null stream: the CPU work it marks has already happened."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _NullStream:
    """The one stream of a CPU process (substitution 8)."""

    def __new__(cls, *args, **kwargs):
        global _NULL_STREAM
        if _NULL_STREAM is None:
            _NULL_STREAM = super().__new__(cls)
        return _NULL_STREAM

    def wait_stream(self, stream: object) -> None:
        return None

    def wait_event(self, event: object) -> None:
        return None

    def record_event(self, event: object = None) -> _NullEvent:
        return _NullEvent()

    def synchronize(self) -> None:
        return None


_NULL_STREAM: Optional[_NullStream] = None


def _host_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's `maybe_move_tensor_to_cpu` for tensors already on the CPU (substitution 9)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def enable_cpu_support(force: bool = False) -> bool:
    """Install the CPU substitutions for megatron-core. Idempotent.

    Does nothing when CUDA is available (unless `force`, for tests of this module only).
    Returns True when the substitutions are active after the call.
    """
    global _ENABLED, _MODE
    if torch.cuda.is_available() and not force:
        return False
    with _LOCK:
        if _ENABLED:
            return True
        import megatron.core.tensor_parallel.random as mp_random

        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        torch.cuda.Stream = _NullStream  # type: ignore[assignment,misc]
        torch.cuda.current_stream = lambda device=None: _NullStream()  # type: ignore[assignment]
        torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
        torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)  # type: ignore
        # Not torch.manual_seed: it calls torch.cuda.manual_seed_all (a lazy no-op without
        # CUDA, left alone) and would recurse if that were redirected too.
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore
        mp_random._get_cuda_rng_state = _cpu_get_rng_state
        mp_random._set_cuda_rng_state = _cpu_set_rng_state
        import megatron.core.fusions.fused_softmax as fused_softmax
        import megatron.core.pipeline_parallel.schedules as schedules
        import megatron.core.transformer.moe.moe_utils as moe_utils
        import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
        import megatron.core.transformer.utils as transformer_utils

        moe_utils.maybe_move_tensor_to_cpu = _host_splits
        token_dispatcher.maybe_move_tensor_to_cpu = _host_splits
        transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
        fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
        schedules.forward_step = _outside_function_mode(schedules.forward_step)
        schedules.backward_step = _outside_function_mode(schedules.backward_step)

        _MODE = CudaToCpuMode()
        _MODE.__enter__()  # stays on the (thread-local) function-mode stack for good
        _ENABLED = True
    return True


JIT_MODULE = "megatron.core.jit"
"""megatron-core's module that picks the decorator of its fusions (`jit_fuser`)."""


class _EagerFusionsFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` as the normal path finder does, and has its loader call the
    module's `disable_jit_fuser()` right after running it (substitution 7)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once: the module is being imported now
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_then_disable(module) -> None:
            run_module(module)
            disable = getattr(module, "disable_jit_fuser", None)
            if disable is not None:  # a megatron-core without it compiles its fusions, as before
                disable()

        spec.loader.exec_module = run_then_disable  # this spec's loader object only
        return spec


def keep_fusions_eager() -> bool:
    """Install substitution 7 before megatron-core is imported, on a machine without a GPU.
    Idempotent. Returns True when `megatron.core.jit` will load with its fusions eager."""
    if torch.cuda.is_available() or JIT_MODULE in sys.modules:
        return False
    if not any(isinstance(finder, _EagerFusionsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EagerFusionsFinder())
    return True
