"""HF ⇄ Megatron checkpoint conversion (the logic of convert_checkpoint.py; `verify` is weights/verify.py).

    import_hf_checkpoint(hf_path, megatron_path, tp, pp, dtype)      HF safetensors → Megatron
    export_megatron_checkpoint(megatron_path, hf_path, ...)          Megatron → HF safetensors
    export_learner_to_hf(model_chunks, info, layout, out_dir, ...)   live learner → HF dir
    export_hf_step(model_chunks, info, layout, run_dir, step, ...)   live learner → the run's
                                                                     hf/step_<N>/, atomically
                                                                     (trainer.hf_export_interval)

A converted Megatron checkpoint directory:

    <megatron_path>/model/               megatron.core.dist_checkpointing (torch_dist) of
                                         {"model": GPTModel.sharded_state_dict()}; loadable at
                                         any TP/PP (ShardedTensors keyed by global layer)
    <megatron_path>/dapo_mega_model.json ModelInfo, the HF config.json dict, source, dtype
    <megatron_path>/hf_config/           config.json, generation_config.json, tokenizer files

`export` also accepts a training checkpoint: a `step_<N>` directory, a run's
`checkpoints/` directory or `latest` file, or the run directory (its latest complete
checkpoint is used; only the model part of `model_optim/` is read).

Memory: each process holds its share of the model once, in the checkpoint's dtype, built
without random initialisation; tensors are read and written one at a time (peak RSS per
process ≈ the imports + model bytes / (tp·pp) + about one full copy of the largest HF
tensor; bench/bench_conversion_memory.py measures 1.49-1.52x a 929 MiB bf16 checkpoint at
TP 1, 0.42x of it the imports).

The top-level functions run the work in `tp·pp` spawned processes unless torch.distributed
is already initialised with that world size (torchrun / srun), in which case they run on the
calling ranks. Spawned ranks run on the CPU (gloo, megatron-core's local spec, no GPU
visible even on a GPU node) unless `device="cuda"`: then rank r runs on GPU r of the node
(`backends.placement.conversion_cuda_index`, which refuses more ranks than GPUs). Either
way the checkpoint is the same: a distributed checkpoint of the same tensors in the same
dtype, loadable by CPU and GPU runs alike.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from dapo_mega.backends.megatron.checkpoint import (
    CONVERTED_HF_CONFIG_SUBDIR,
    CONVERTED_MODEL_SUBDIR,
    load_model_from_dist_checkpoint,
    model_sharded_state_dict,
    resolve_megatron_source,
    save_dist_checkpoint,
)
from dapo_mega.backends.placement import CPU, conversion_cuda_index, conversion_world_size
from dapo_mega.run_files.checkpoints import MODEL_META_FILE
from dapo_mega.weights import mapping as M
from dapo_mega.weights.hf_io import (
    DEFAULT_MAX_SHARD_BYTES,
    HFCheckpointReader,
    ShardedSafetensorsWriter,
    dtype_from_name,
    write_index,
)

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor

    from dapo_mega.models.shape import HfConfigDict

T = TypeVar("T")
"""What a function run on every rank returns (`run_on_ranks`)."""

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json")
"""Files copied next to exported weights when a source directory is known."""


@dataclass
class ConversionSummary:
    """What a conversion did, for the tool's final report."""

    action: str
    source: str
    destination: str
    num_tensors: int = 0
    total_bytes: int = 0
    seconds: float = 0.0
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dtype: str = ""
    notes: List[str] = field(default_factory=list)
    max_abs_diff: Optional[float] = None
    """verify: max |Δlogit| (its other figures are in the notes)."""
    mean_abs_diff: Optional[float] = None
    passed: Optional[bool] = None
    """verify's verdict; None for import and export."""

    def lines(self) -> List[str]:
        out = [f"{self.action}: {self.source} -> {self.destination}",
               f"  tensors: {self.num_tensors}  size: {self.total_bytes / 1e6:.1f} MB  dtype: {self.dtype}  "
               f"TP={self.tp} PP={self.pp}{f' EP={self.ep}' if self.ep > 1 else ''}  time: {self.seconds:.1f} s"]
        out += [f"  note: {n}" for n in self.notes]
        if self.passed is not None:
            out.append(f"  -> {'PASS' if self.passed else 'FAIL'}")
        return out


# --------------------------------------------------------------------------- helpers


def read_hf_config_dict(hf_dir: Path | str) -> HfConfigDict:
    """config.json of an HF directory, with the architecture checked."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise M.WeightMappingError(f"{hf_dir}: no config.json")
    cfg = json.loads(path.read_text())
    M.check_architecture(cfg)
    return cfg


def copy_hf_side_files(src: Path | str, dst: Path | str, include_config: bool = True) -> List[str]:
    """Copy config / generation config / tokenizer files that exist in `src` to `dst`."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        if (src / name).is_file() and (include_config or name != "config.json"):
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def _target_dtype(name: Optional[str], hf_cfg: HfConfigDict) -> torch.dtype:
    """--dtype, else the HF config's dtype (torch_dtype / dtype), else float32."""
    explicit = dtype_from_name(name)
    if explicit is not None:
        return explicit
    from_cfg = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")
    return dtype_from_name(from_cfg) if from_cfg in ("bfloat16", "float32", "float16") else torch.float32


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _build(hf_cfg: HfConfigDict, tp: int, pp: int, world_size: int, dtype: torch.dtype, rank: int = 0,
           device: str = CPU, ep: int = 1):
    """Initialise the layout on this rank and build the model chunks in `dtype`, uninitialised.

    `device`: cpu, or cuda for rank `rank` on its own GPU of the node by the device rule
    (when this function starts torch.distributed; ranks of a launcher keep their device).

    `dtype` is the checkpoint's (bf16 for a bf16 checkpoint, on the CPU too): the model is
    held once, in the bytes it is stored in. Every tensor is loaded next, so nothing is
    drawn (`initialize=False`) and the pages stay untouched until the load writes them.
    """
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import build_model
    from dapo_mega.config import MegatronConfig

    # The local spec on a GPU too: the checkpoint is the same for both specs (megatron-core maps
    # the norms to TE's fused names), a TE learner loads it, and a node without Transformer
    # Engine converts (the first GPU run: `auto` refused the import there).
    mcfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=ep, transformer_impl="local",
                          params_dtype="float32" if not torch.cuda.is_available() else "auto")
    cuda_device = None if torch.distributed.is_initialized() else \
        conversion_cuda_index(rank, world_size, device, torch.cuda.device_count() if device != CPU else 0)
    layout = ParallelLayout.from_config(mcfg, world_size, hf_cfg).initialize(cuda_device=cuda_device)
    chunks, info = build_model(hf_cfg, mcfg, layout, initialize=False, params_dtype=dtype)
    for chunk in chunks:
        chunk.eval()
    return layout, chunks, info


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _progress(iterable, total: Optional[int], desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="tensor")


_ERROR_TYPES = {cls.__name__: cls for cls in (M.WeightMappingError, M.MissingHFTensorError,
                                                M.UnsupportedArchitectureError, FileNotFoundError)}


def run_on_ranks(fn: Callable[..., T], world_size: int, args: Sequence[object], device: str = CPU) -> List[T]:
    """Run `fn(rank, world_size, *args)` on the current ranks (already distributed) or spawned ones.

    Spawned ranks run on `device` (cpu: the GPUs hidden; cuda: one GPU each, checked against
    the node's GPUs here before any rank starts: DeviceRuleError, one line). Errors of spawned ranks are re-raised with their original type when it is one of the
    conversion errors, so callers and tests see e.g. MissingHFTensorError naming the tensor.
    """
    if torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != world_size:
            raise ValueError(f"torch.distributed has {torch.distributed.get_world_size()} ranks, conversion "
                             f"needs {world_size} (tp*pp, times EP's data-parallel copies)")
        return [fn(torch.distributed.get_rank(), world_size, *args)]
    from dapo_mega.weights.spawn import SpawnedRankError, spawn_ranks

    if device != CPU:  # refused here, in one line, before a rank starts
        conversion_cuda_index(0, world_size, device, torch.cuda.device_count())
    try:
        return spawn_ranks(fn, world_size, args, device=device)
    except SpawnedRankError as exc:
        cls = _ERROR_TYPES.get(exc.exc_type)
        if cls is None and exc.exc_type == "ConfigError":
            from dapo_mega.config import ConfigError as cls  # noqa: N813
        if cls is not None:
            raise cls(exc.message) from exc
        raise


# --------------------------------------------------------------------------- import


def import_hf_checkpoint(hf_path: Path | str, megatron_path: Path | str, tp: int = 1, pp: int = 1,
                         dtype: Optional[str] = None, progress: bool = True, device: str = CPU,
                         ep: int = 1) -> ConversionSummary:
    """HF safetensors directory → Megatron distributed checkpoint (see the module docstring);
    `device`: cpu (the default) or cuda, where the ranks run."""
    start = time.time()
    read_hf_config_dict(hf_path)  # fail fast on a missing or unreadable config.json
    HFCheckpointReader(hf_path)  # fail fast, in this process, on a missing shard
    out = Path(megatron_path)
    (out / CONVERTED_MODEL_SUBDIR).mkdir(parents=True, exist_ok=True)
    results = run_on_ranks(_import_worker, conversion_world_size(tp, pp, ep),
                           (str(hf_path), str(out), tp, pp, dtype, progress, device, ep), device)
    summary = results[0]
    summary.seconds = time.time() - start
    return summary


def _import_worker(rank: int, world_size: int, hf_path: str, out: str, tp: int, pp: int,
                   dtype_name: Optional[str], progress: bool, device: str, ep: int = 1) -> Optional[ConversionSummary]:
    from dapo_mega.weights.stream import load_hf_into_megatron

    hf_cfg = read_hf_config_dict(hf_path)
    dtype = _target_dtype(dtype_name, hf_cfg)
    layout, chunks, info = _build(hf_cfg, tp, pp, world_size, dtype, rank, device, ep)
    reader = HFCheckpointReader(hf_path)
    used = load_hf_into_megatron(chunks, info, layout, reader)
    all_used = [None] * world_size
    torch.distributed.all_gather_object(all_used, sorted(used))
    save_dist_checkpoint(_consume_into_save_state(chunks), Path(out) / CONVERTED_MODEL_SUBDIR)
    if rank != 0:
        return None
    used_all = set().union(*map(set, all_used))
    unused = sorted(set(reader.keys()) - used_all)
    info_dict = info.to_dict()
    info_dict["params_dtype"] = _dtype_str(dtype)
    meta = {"format_version": 1, "model_info": info_dict, "hf_config": hf_cfg, "source": str(hf_path),
            "saved_with": {"tp": tp, "pp": pp, "ep": ep}, "dtype": _dtype_str(dtype)}
    (Path(out) / MODEL_META_FILE).write_text(json.dumps(meta, indent=2))
    copy_hf_side_files(hf_path, Path(out) / CONVERTED_HF_CONFIG_SUBDIR)
    notes = [f"HF tensors not used: {', '.join(unused)}"] if unused else []
    return ConversionSummary(action="import", source=hf_path, destination=out, num_tensors=len(used_all),
                             total_bytes=_bytes_of(reader, used_all, dtype),
                             tp=tp, pp=pp, ep=ep, dtype=_dtype_str(dtype), notes=notes)


def _consume_into_save_state(chunks) -> ShardedStateDict:
    """The chunks' sharded state dict, with no tensor a view; the chunks are left empty.

    megatron's torch_dist writer clones every CPU tensor that is a view of a larger storage
    (SwiGLU's fc1 is saved as its gate and up halves, views of one parameter), all before it
    writes anything: ~half a model more at once. Here each such parameter is replaced by
    copies of its views one parameter at a time and then freed, so the save adds one
    parameter, not the views of all of them. The model is unusable afterwards.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model_sharded_state_dict(chunks)
    apply_factories(state)
    params = {p.untyped_storage().data_ptr(): p for c in chunks for p in c.parameters()}
    views: Dict[int, List[ShardedTensor]] = {}
    for sh in nested_values(state):
        if isinstance(sh, ShardedTensor) and isinstance(sh.data, torch.Tensor) and sh.data.device.type == "cpu":
            storage = sh.data.untyped_storage()
            if storage.nbytes() != sh.data.numel() * sh.data.element_size():
                views.setdefault(storage.data_ptr(), []).append(sh)
    for ptr, shards in views.items():
        for sh in shards:
            sh.data = sh.data.clone()
        if ptr in params:
            params[ptr].data = torch.empty(0, dtype=params[ptr].dtype)
    return state


def _bytes_of(reader: HFCheckpointReader, names, dtype: torch.dtype) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(reader.shape(n)) * item for n in names)


# --------------------------------------------------------------------------- export


def export_megatron_checkpoint(megatron_path: Path | str, hf_path: Path | str,
                               hf_config_from: Optional[Path | str] = None, tp: int = 1, pp: int = 1,
                               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: Optional[str] = None,
                               progress: bool = True, device: str = CPU, ep: int = 1) -> ConversionSummary:
    """Megatron (converted or training) checkpoint → HF directory loadable by from_pretrained;
    `device`: cpu (the default) or cuda, where the ranks run."""
    start = time.time()
    src = resolve_megatron_source(megatron_path)
    hf_cfg = (read_hf_config_dict(hf_config_from) if hf_config_from else src["meta"].get("hf_config"))
    if hf_cfg is None and src["side_dir"] is not None and (Path(src["side_dir"]) / "config.json").is_file():
        hf_cfg = read_hf_config_dict(src["side_dir"])
    if hf_cfg is None:
        raise M.WeightMappingError(f"{megatron_path}: no HF config recorded with this checkpoint; pass "
                                   "--hf-config-from DIR (the HF directory the run started from)")
    M.check_architecture(hf_cfg)
    side_dir = Path(hf_config_from) if hf_config_from else src["side_dir"]
    stored = _stored_dtype(src["meta"])
    out = Path(hf_path)
    out.mkdir(parents=True, exist_ok=True)
    results = run_on_ranks(_export_worker, conversion_world_size(tp, pp, ep),
                           (str(src["ckpt_dir"]), str(out), hf_cfg, tp, pp, max_shard_bytes,
                            dtype or (stored and _dtype_str(stored)), stored, progress, device, ep), device)
    summary: ConversionSummary = results[0]
    copied = copy_hf_side_files(side_dir, out, include_config=False) if side_dir else []
    _write_hf_config(out, hf_cfg, summary.dtype)
    if not (out / "generation_config.json").is_file():
        _write_generation_config(out, hf_cfg)
    summary.source = str(megatron_path) + (f" ({src['step_dir']})" if "step_dir" in src else "")
    summary.notes.append(f"copied from {side_dir}: {', '.join(copied)}" if copied else
                         "no tokenizer source given (--hf-config-from): tokenizer files not copied")
    summary.seconds = time.time() - start
    return summary


def _write_hf_config(out: Path, hf_cfg: HfConfigDict, dtype: str) -> None:
    cfg = dict(hf_cfg)
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_generation_config(out: Path, hf_cfg: HfConfigDict) -> None:
    gen = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_cfg.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _export_worker(rank: int, world_size: int, ckpt_dir: str, out: str, hf_cfg: HfConfigDict, tp: int, pp: int,
                   max_shard_bytes: int, dtype_name: Optional[str], stored_dtype: Optional[torch.dtype],
                   progress: bool, device: str, ep: int = 1) -> Optional[ConversionSummary]:
    """Build in the dtype the checkpoint stores (so the load casts nothing), write `dtype_name`."""
    dtype = dtype_from_name(dtype_name) or torch.float32
    layout, chunks, info = _build(hf_cfg, tp, pp, world_size, stored_dtype or dtype, rank, device, ep)
    load_model_from_dist_checkpoint(chunks, ckpt_dir)
    summary = export_learner_to_hf(chunks, info, layout, out, max_shard_bytes=max_shard_bytes, dtype=dtype,
                                   progress=progress)
    if rank != 0:
        return None
    summary.tp, summary.pp, summary.ep = tp, pp, ep
    return summary


def export_learner_to_hf(model_chunks, info, layout, out_dir: Path | str,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: Optional[torch.dtype] = None,
                         progress: bool = False, hf_side_dir: Optional[Path | str] = None,
                         hf_config: Optional[HfConfigDict] = None) -> Optional[ConversionSummary]:
    """Write the live model's weights as HF safetensors shards + index into `out_dir`.

    Collective over all learner ranks (each pipeline stage streams its layers through
    `iter_megatron_to_hf`; the TP-0/DP-0/CP-0 rank of each stage writes them). Rank 0
    then renames the shards and writes the index; with `hf_config` (dict) it also writes
    config.json / generation_config.json, and copies tokenizer files from `hf_side_dir`.
    A rank whose writes fail (disk full) keeps draining the stream, so its stage's other
    ranks are not left inside a TP gather; the ranks then agree, and every rank raises
    HFExportError (the failing one from its error), with `out_dir` left as it is.
    Used by `convert_checkpoint.py export` and the trainer's exports (`export_hf_step`).
    Returns the summary on rank 0, None elsewhere.
    """
    from megatron.core import parallel_state as ps

    from dapo_mega.weights.stream import iter_megatron_to_hf

    out = Path(out_dir)
    if _is_rank0():
        out.mkdir(parents=True, exist_ok=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    writes = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
              and ps.get_context_parallel_rank() == 0)
    writer = ShardedSafetensorsWriter(out, max_shard_bytes, prefix=f"stage{pp_rank:03d}") if writes else None
    error: Optional[BaseException] = None
    stream = iter_megatron_to_hf(model_chunks, info, layout)
    for name, tensor in _progress(stream, None, f"export stage {pp_rank}", progress and writes and pp_rank == 0):
        if writer is not None and error is None:
            try:
                writer.add(name, tensor.to(dtype) if dtype is not None else tensor)
            except Exception as exc:  # noqa: BLE001 - drained on, raised after the ranks agree
                error = exc
    part = None
    if writer is not None and error is None:
        try:
            part = (pp_rank, writer.finalize())
        except Exception as exc:  # noqa: BLE001
            error = exc
    _agree_on_export(error, out)
    parts = [part]
    if torch.distributed.is_initialized():
        parts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, part)
    summary = None
    if _is_rank0():
        try:
            summary = _write_export_index(out, parts, dtype, hf_config, hf_side_dir)
        except Exception as exc:  # noqa: BLE001
            error = exc
    _agree_on_export(error, out)
    return summary


def _agree_on_export(error: Optional[BaseException], out: Path) -> None:
    """Collective: raise HFExportError on every rank when any rank has an error."""
    from dapo_mega import distributed as D
    from dapo_mega.run_files.checkpoints import HFExportError

    if not D.any_rank_true(error is not None):
        return
    if error is None:
        raise HFExportError(f"HF export to {out} failed on another learner rank")
    raise HFExportError(f"HF export to {out} failed on rank {D.rank()}: {error!r}") from error


def _write_export_index(out: Path, parts: List[Optional[Tuple[int, Tuple[Dict[str, str], List[str], int]]]],
                        dtype: Optional[torch.dtype], hf_config: Optional[HfConfigDict],
                        hf_side_dir: Optional[Path | str]) -> ConversionSummary:
    """Rank 0: the shards renamed in stage order, the index, and the side files."""
    ordered = [p for _, p in sorted((p for p in parts if p is not None), key=lambda x: x[0])]
    weight_map = write_index(out, ordered)
    if hf_config is not None:
        _write_hf_config(out, hf_config, _dtype_str(dtype or torch.float32))
        if hf_side_dir:
            copy_hf_side_files(hf_side_dir, out, include_config=False)
        if not (out / "generation_config.json").is_file():
            _write_generation_config(out, hf_config)
    return ConversionSummary(action="export", source="megatron", destination=str(out), num_tensors=len(weight_map),
                             total_bytes=sum(b for _, _, b in ordered), dtype=_dtype_str(dtype or torch.float32))


@dataclass
class HFExportRecord:
    """One HF export of the running learner (`export_hf_step`), as rank 0 saw it."""

    step: int
    path: Path
    """The complete `<run_dir>/hf/step_<N>/`."""
    seconds: float
    """Wall time of the whole export on rank 0: stream, writes, index, fsync, rename, prune."""
    bytes: int
    """Bytes of every file in the directory (shards, index, config, tokenizer files)."""
    pruned: List[Path] = field(default_factory=list)
    """Older exports deleted by keep-K."""

    def metrics(self) -> Dict[str, float]:
        return {"hf_export/seconds": self.seconds, "hf_export/bytes": float(self.bytes)}


def export_hf_step(model_chunks, info, layout, run_dir: Path | str, step: int, hf_config: HfConfigDict,
                   hf_side_dir: Optional[Path | str], dtype: torch.dtype, keep: int) -> Optional[HFExportRecord]:
    """The running learner's weights as `<run_dir>/hf/step_<N>/`, atomically (collective).

    Rank 0 creates `hf/step_<N>.tmp-<pid>/`; every rank streams its part into it
    (`export_learner_to_hf`: no rank gathers more than one tensor); rank 0 fsyncs it, renames
    it to `step_<N>/` and deletes all but the newest `keep` complete exports. A failure on any
    rank removes the tmp directory and raises HFExportError on every rank; an export killed
    mid-way leaves only a `.tmp-` directory, which is never complete and the next prune removes.
    Returns the record on rank 0, None elsewhere.
    """
    from dapo_mega import distributed as D
    from dapo_mega.run_files.checkpoints import (
        HFExportError,
        begin_hf_export_dir,
        commit_hf_export_dir,
        directory_bytes,
        prune_hf_exports,
    )

    start = time.perf_counter()
    rank0 = D.rank() == 0
    tmp = Path(D.broadcast_object(str(begin_hf_export_dir(run_dir, step)) if rank0 else None, src=0))
    error: Optional[BaseException] = None
    try:
        export_learner_to_hf(model_chunks, info, layout, tmp, dtype=dtype, hf_side_dir=hf_side_dir,
                             hf_config=hf_config)
        final = commit_hf_export_dir(tmp) if rank0 else None
    except BaseException as exc:  # noqa: BLE001 - rank 0 cleans up; every rank raises below
        error = exc
    failed = D.any_rank_true(error is not None)
    if failed:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        why = str(error) if isinstance(error, HFExportError) else repr(error) if error else "on another learner rank"
        raise HFExportError(f"HF export of step {step} failed ({why}); {tmp} was removed, the earlier exports "
                            f"in {tmp.parent} and the checkpoints are intact") from error
    if not rank0:
        return None
    pruned = prune_hf_exports(run_dir, keep)
    return HFExportRecord(step=step, path=final, seconds=time.perf_counter() - start, bytes=directory_bytes(final),
                          pruned=pruned)


# --------------------------------------------------------------------------- shared with verify


def _stored_dtype(meta: Dict[str, Any]) -> Optional[torch.dtype]:
    """The dtype a converted or training checkpoint's model tensors are stored in, if recorded."""
    return dtype_from_name(meta.get("dtype") or (meta.get("model_info") or {}).get("params_dtype"))


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc's malloc_trim).

    Tensors under glibc's mmap threshold (which grows to 32 MiB as large tensors are freed)
    live on the heap, whose freed pages stay resident until trimmed; without the trim the
    freed Megatron model's smaller tensors would still count while the HF model is read.
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
