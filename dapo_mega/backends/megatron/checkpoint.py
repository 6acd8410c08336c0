"""Megatron's part of a training checkpoint: sharded model + optimizer state, RNG states,
save and load as collectives over the learner ranks.

The run-directory protocol (step directories, `latest`, fsync, atomic commit, keep-K) is
`dapo_mega/run_files/checkpoints.py`; this module fills a step directory:

    step_<N>/model_optim/         megatron.core.dist_checkpointing (torch_dist): model chunks
                                  ("model" or "model0", "model1", … with virtual PP),
                                  "optimizer", "opt_param_scheduler"; loadable at another
                                  TP/PP for the model (`convert_checkpoint.py export`)
    step_<N>/rng/rank_00000.pt    per-rank RNG states (python, numpy, torch, CUDA, megatron
                                  tracker) as tensors/ints, loaded with weights_only=True
    step_<N>/dapo_mega_model.json the model's shape and build + HF config (export rebuilds from it)

A save: rank 0 begins the tmp step directory; every rank writes its shards and RNG; the
ranks agree (all-reduce of a failure flag, on the device the group's backend needs) that
all succeeded; rank 0 commits (run_dir.commit_step_dir) and prunes. An error on any rank
(ENOSPC included) removes the tmp directory and raises CheckpointSaveError on every rank;
`latest` and older checkpoints are untouched.

A converted checkpoint (`convert_checkpoint.py import`) is laid out as
`<megatron_path>/model/` (the distributed checkpoint), `dapo_mega_model.json` and
`hf_config/` (config and tokenizer files); `resolve_megatron_source` finds the tensors of
either kind.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch

from dapo_mega import distributed as D
from dapo_mega.run_files.checkpoints import (
    FORMAT_VERSION,
    MODEL_META_FILE,
    MODEL_OPTIM_DIR,
    RNG_DIR,
    TRAINER_STATE_FILE,
    CheckpointSaveError,
    begin_step_dir,
    checkpoints_root,
    commit_step_dir,
    describe_save_error,
    encode_trainer_state,
    fsync_path,
    prune_checkpoints,
    read_trainer_state,
    resolve_checkpoint_dir,
    step_dir_name,
)

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict

    from dapo_mega.backends.megatron.layout import ParallelLayout

CONVERTED_MODEL_SUBDIR = "model"
"""The distributed checkpoint of a converted (`convert_checkpoint.py import`) checkpoint."""
EXTRA_STATE = "_extra_state"
"""How Transformer Engine modules' sharded extra state (FP8 metadata, no weights) is keyed."""
CONVERTED_HF_CONFIG_SUBDIR = "hf_config"
"""HF config and tokenizer files kept beside a converted checkpoint."""
DEFAULT_OPTIMIZER_SHARDING = "dp_reshardable"
"""DistributedOptimizer state format (megatron `distrib_optim_sharding_type`): dp_reshardable
saves each DP rank's buffers in parallel (resume at the same TP/PP, any DP);
fully_reshardable gathers them per model-parallel shard on DP rank 0 (resume at any
TP/PP, slower, more host memory). megatron-core 0.16.1 rejects its own default,
fully_sharded_model_space ("ShardedTensor.flattened_range is not supported")."""


# --------------------------------------------------------------------------- dist_checkpointing


def ensure_dist_checkpoint_writer() -> None:
    """Let megatron's torch_dist writer run without psutil.

    megatron-core 0.16.1's `FileSystemWriterAsync.write_preloaded_data` calls
    `_process_memory()` (psutil RSS) only for a debug log line, and raises when psutil is
    not installed, which makes every `dist_checkpointing.save` fail. psutil is not a
    declared dependency of megatron-core; when it is absent we answer 0 for that log line.
    Idempotent; does nothing when psutil is importable.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        filesystem_async._process_memory = lambda: 0


def save_dist_checkpoint(state: ShardedStateDict, ckpt_dir: Path | str) -> None:
    """`dist_checkpointing.save(state, ckpt_dir)` (torch_dist backend; the dir must exist)."""
    from megatron.core import dist_checkpointing

    ensure_dist_checkpoint_writer()
    dist_checkpointing.save(state, str(ckpt_dir))


# --------------------------------------------------------------------------- model state


def model_sharded_state_dict(model_chunks: List[torch.nn.Module]) -> ShardedStateDict:
    """{"model": sd} (one chunk) or {"model0": sd0, …} (virtual PP), as Megatron-LM nests them.

    ShardedTensor keys carry global layer numbers, so the file layout does not depend on
    TP/PP/VPP; only the nesting key differs, which dist_checkpointing ignores for tensors.
    """
    from dapo_mega.backends.megatron.model import unwrap_chunk

    models = [unwrap_chunk(c) for c in model_chunks]
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def load_model_state(model_chunks: List[torch.nn.Module], loaded: StateDict) -> None:
    """Copy a loaded {"model"…} dict into the chunks (strict: every parameter present)."""
    from dapo_mega.backends.megatron.model import unwrap_chunk

    models = [unwrap_chunk(c) for c in model_chunks]
    keys = ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]
    for key, model in zip(keys, models):
        model.load_state_dict(loaded[key], strict=False)


def load_model_from_dist_checkpoint(model_chunks: List[torch.nn.Module], ckpt_dir: Path | str) -> None:
    """Load only the model part of a distributed checkpoint (converted or training one).

    ckpt_dir: the dist-checkpoint directory itself, a converted checkpoint root
    (`<megatron_path>` of `convert_checkpoint.py import`), a `step_<N>` directory or a run
    directory. Fp32 main parameters of a bf16 optimizer are NOT refreshed here: call
    `optimizer.reload_model_params()` afterwards when an optimizer already exists.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if not (Path(ckpt_dir) / "metadata.json").is_file():
        ckpt_dir = Path(resolve_megatron_source(ckpt_dir)["ckpt_dir"])
    verify_checkpoint_files(ckpt_dir)
    state = model_sharded_state_dict(model_chunks)
    verify_checkpoint_fits(state, ckpt_dir)
    merge_factories_in_place(state)
    # RETURN_UNEXPECTED: what this model asks for and the checkpoint lacks is left out of the
    # load and returned. Tensors were checked above; of the objects only Transformer Engine's
    # `_extra_state` (FP8 scaling metadata, no weights) may be absent: a checkpoint written
    # with the local spec (conversion on the CPU) has none, and a TE learner starts it afresh.
    loaded, _, absent = dist_checkpointing.load(state, str(ckpt_dir), strict=StrictHandling.RETURN_UNEXPECTED)
    refused = sorted(k for k in absent if not k.endswith(EXTRA_STATE))
    if refused:
        raise CheckpointCorruptError(f"{ckpt_dir} lacks {len(refused)} object(s) the model needs, e.g. "
                                     f"{', '.join(refused[:3])} (a checkpoint of another architecture?)")
    load_model_state(model_chunks, loaded)


def merge_factories_in_place(state: ShardedStateDict) -> None:
    """Make each ShardedTensorFactory's merge write into its own tensor and return it.

    dist_checkpointing loads the pieces a factory builds (SwiGLU's fc1 as gate and up
    halves) into views of the parameter, then merges them into new tensors (torch.cat) and
    returns all merged tensors at once: ~half a model more host memory at the peak. Copied
    into the parameter as each is made, the merge holds one parameter's temporary at a time.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for factory in nested_values(state):
        if isinstance(factory, ShardedTensorFactory) and isinstance(factory.data, torch.Tensor):
            factory.merge_fn = _merge_into(factory.merge_fn, factory.data)


def _merge_into(merge_fn, target: torch.Tensor):
    def merge(sub_state_dict):
        merged = merge_fn(sub_state_dict)
        if isinstance(merged, torch.Tensor) and merged is not target and merged.shape == target.shape:
            with torch.no_grad():
                target.copy_(merged)
            return target
        return merged

    return merge


def resolve_megatron_source(megatron_path: Path | str) -> Dict[str, Any]:
    """Where the model tensors and metadata of a converted or training checkpoint are.

    Returns {"ckpt_dir": dist checkpoint dir, "meta": dapo_mega_model.json dict or {},
    "side_dir": directory with config/tokenizer files or None, "kind": "converted"|"training"}.
    """
    path = Path(megatron_path)
    if (path / CONVERTED_MODEL_SUBDIR / "metadata.json").is_file():
        meta = json.loads((path / MODEL_META_FILE).read_text()) if (path / MODEL_META_FILE).is_file() else {}
        side = path / CONVERTED_HF_CONFIG_SUBDIR
        return {"ckpt_dir": path / CONVERTED_MODEL_SUBDIR, "meta": meta, "side_dir": side if side.is_dir() else None,
                "kind": "converted"}
    step_dir = resolve_checkpoint_dir(path)
    meta = json.loads((step_dir / MODEL_META_FILE).read_text()) if (step_dir / MODEL_META_FILE).is_file() else {}
    run_dir = step_dir.parent.parent
    side = Path(meta["hf_source_dir"]) if meta.get("hf_source_dir") else run_dir / "base_model"
    return {"ckpt_dir": step_dir / MODEL_OPTIM_DIR, "meta": meta, "side_dir": side if side.is_dir() else None,
            "kind": "training", "step_dir": str(step_dir)}


# --------------------------------------------------------------------------- RNG


def capture_rng_state() -> Dict[str, object]:
    """This rank's RNG states as tensors/ints/tuples (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state: Dict[str, object] = {
        "python": random.getstate(),
        "numpy": {"kind": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core import tensor_parallel

        state["megatron_tracker"] = {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    except Exception:  # tracker not initialised (no model built): nothing to save
        pass
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    random.setstate(_tuplify(state["python"]))
    nps = state["numpy"]
    np.random.set_state((nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron_tracker" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _tuplify(x: object) -> object:
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# --------------------------------------------------------------------------- save / load


def _full_state(learner, is_loading: bool, optimizer_sharding: str, chain_prefix: bool = False) -> ShardedStateDict:
    state = model_sharded_state_dict(learner.model_chunks)
    optimizer = getattr(learner, "optimizer", None)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_optimizer_metadata(optimizer_sharding, chain_prefix))
    scheduler = getattr(learner, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "state_dict"):
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def _prepare_optimizer_for_loading(optimizer) -> None:
    """Give a fresh torch Adam the state entries megatron's load path reads.

    Without Apex/TE, megatron-core 0.16.1's DistributedOptimizer.state_dict() (called by
    `sharded_state_dict(is_loading=True)`) reads `state[p]["step"]` of every parameter and
    asserts they agree, but a never-stepped torch Adam has no state, and megatron's own
    `init_state_fn` sets only the moments. Zero moments and step 0 are what Adam's first
    step would create; the load then overwrites all three.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                    inner.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    inner.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def _restore_adam_step(optimizer, loaded_optimizer_state: Union[StateDict, List[StateDict]]) -> None:
    """Put the saved Adam step count back after a DistributedOptimizer load (no Apex/TE).

    megatron-core 0.16.1 stores the step of a torch Adam in the param groups of the common
    state and writes it into the inner state in `load_state_dict`, but the per-parameter
    copy that follows (`_set_main_param_and_optimizer_states`) copies "step" too, from the
    parameter-state template built before loading (step 0). The bias correction of the
    next update would then restart. The param-group value is the saved one; reapply it.
    Each parameter gets its own tensor: megatron's load puts one *shared* step tensor into
    every parameter's state, and torch AdamW increments it in place once per parameter,
    so a shared one would advance by the number of parameters per update.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) == 1:
        states = [loaded_optimizer_state]
    elif isinstance(loaded_optimizer_state, dict):
        states = [v for _, v in sorted(loaded_optimizer_state.items())]
    else:
        states = list(loaded_optimizer_state)
    for opt, state in zip(chained, states):
        inner = getattr(opt, "optimizer", None)
        groups = (state.get("optimizer") or {}).get("param_groups", []) if isinstance(state, dict) else []
        steps = {g["step"] for g in groups if g.get("step") is not None}
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or len(steps) != 1:
            continue
        step = float(steps.pop())
        for param_state in inner.state.values():
            if "step" in param_state:
                param_state["step"] = torch.tensor(step, dtype=torch.float32)


def _model_meta(learner) -> Dict[str, object]:
    info = getattr(learner, "info", None)
    meta: Dict[str, object] = {"format_version": FORMAT_VERSION,
                            "model_info": info.to_dict() if hasattr(info, "to_dict") else None}
    hf_config = getattr(learner, "hf_config", None)
    hf_path = getattr(getattr(getattr(learner, "cfg", None), "model", None), "hf_path", "") or ""
    if hf_path and Path(hf_path, "config.json").is_file():
        meta["hf_source_dir"] = str(Path(hf_path).resolve())  # tokenizer files for `export`
        if hf_config is None:
            hf_config = Path(hf_path)
    if hf_config is not None:
        from dapo_mega.models.shape import hf_config_to_dict

        meta["hf_config"] = hf_config_to_dict(hf_config)
    return meta


def save_checkpoint(learner, run_dir: Path | str, step: int, trainer_state: Mapping[str, object],
                    keep_last_k: int = 2, optimizer_sharding: Optional[str] = None, keep_every: int = 0) -> Path:
    """Save model, optimizer, scheduler, RNG and `trainer_state` as `step_<N>` (collective).

    Every learner rank calls it. `trainer_state` must be JSON-serialisable (checked before
    anything is written); "step" is set to `step`; the optimizer's sharding (default: the
    learner's `megatron.optimizer_sharding`) and the learner's layout are recorded beside it,
    so a resume at another layout is checked before anything is read. Returns the final
    checkpoint directory. Raises CheckpointSaveError (ENOSPC named) after removing the
    partial tmp directory.
    """
    optimizer_sharding = optimizer_sharding or _configured_sharding(learner)
    state_json = encode_trainer_state(trainer_state, step, optimizer_sharding=optimizer_sharding,
                                      learner_layout=_layout_record(learner))
    root = checkpoints_root(run_dir)
    final = root / step_dir_name(step)
    rank0 = D.rank() == 0
    tmp = Path(D.broadcast_object(str(begin_step_dir(root, step, (MODEL_OPTIM_DIR, RNG_DIR))) if rank0 else None,
                                  src=0))
    error: Optional[BaseException] = None
    try:
        save_dist_checkpoint(_full_state(learner, False, optimizer_sharding), tmp / MODEL_OPTIM_DIR)
        rng_path = tmp / RNG_DIR / f"rank_{D.rank():05d}.pt"
        torch.save(capture_rng_state(), rng_path)
        fsync_path(rng_path)
    except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement below
        error = exc
    failed = D.any_rank_true(error is not None)
    if not failed and rank0:
        try:
            commit_step_dir(tmp, {MODEL_META_FILE: json.dumps(_model_meta(learner), indent=2),
                                  TRAINER_STATE_FILE: state_json})
        except BaseException as exc:  # noqa: BLE001
            error = exc
    failed = D.any_rank_true(error is not None)
    if failed:
        free_bytes = shutil.disk_usage(tmp if tmp.exists() else root).free  # before the cleanup frees space
        if rank0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        D.barrier()
        if error is None:
            raise CheckpointSaveError(f"checkpoint step {step} failed on another rank; {tmp} removed, "
                                      "the previous checkpoint is intact")
        why = describe_save_error(error, free_bytes)
        raise CheckpointSaveError(f"could not save checkpoint step {step} to {final}: {why}; the partial "
                                  f"directory was removed and the previous checkpoint and 'latest' are intact") from error
    if rank0 and keep_last_k > 0:
        prune_checkpoints(root, keep_last_k, keep_every)
    D.barrier()
    return final


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's shard files do not match its index; nothing was loaded."""


class CheckpointLayoutError(RuntimeError):
    """A checkpoint's optimizer state cannot be loaded at this parallel layout; nothing was loaded."""


LAYOUT_KEYS = ("tp", "pp", "vpp", "dp", "ep")
"""What `learner_layout` records of the saving learner's ParallelLayout."""


def _configured_sharding(learner) -> str:
    mcfg = getattr(getattr(learner, "cfg", None), "megatron", None)
    return getattr(mcfg, "optimizer_sharding", None) or DEFAULT_OPTIMIZER_SHARDING


def _layout_record(learner) -> Optional[Dict[str, Optional[int]]]:
    layout = getattr(learner, "layout", None)
    return None if layout is None else layout_record(layout)


def layout_record(layout: ParallelLayout) -> Dict[str, Optional[int]]:
    """What a checkpoint records of a ParallelLayout (trainer_state.json `learner_layout`)."""
    return {k: getattr(layout, k) for k in LAYOUT_KEYS}


def _describe_layout(layout: Mapping[str, object], dp: bool = True) -> str:
    vpp = f" / VPP {layout['vpp']}" if layout.get("vpp") else ""
    ep = f" / EP {layout['ep']}" if int(layout.get("ep") or 1) > 1 else ""
    return f"TP {layout['tp']} / PP {layout['pp']}{vpp}{ep}" + (f" / DP {layout['dp']}" if dp else "")


def resume_layout_problem(trainer_state: Dict[str, Any], here: Mapping[str, Optional[int]], ckpt: Path | str
                          ) -> Optional[str]:
    """Why the optimizer state of the checkpoint `ckpt` (its `trainer_state`) cannot load at
    the layout `here` (a `layout_record`), or None when it can. dp_reshardable state keeps each
    DP rank's flat buffer shard, which lines up only at the TP, PP, VPP and EP it was saved with
    (megatron's own error is a shape mismatch deep in its loader; at another EP a mixture's
    experts sit in other buffers); fully_reshardable state, and the model weights alone, load
    at any layout. Pure: `dapo-mega train`'s preflight asks it before anything is built,
    `load_checkpoint` before anything is read."""
    saved = trainer_state.get("learner_layout")
    if trainer_state.get("optimizer_sharding", DEFAULT_OPTIMIZER_SHARDING) != "dp_reshardable" or not saved:
        return None
    if all(saved.get(k) == here.get(k) for k in ("tp", "pp", "vpp")) and \
            int(saved.get("ep") or 1) == int(here.get("ep") or 1):  # before EP was recorded: 1
        return None
    return (f"{ckpt} was saved at {_describe_layout(saved)} with megatron.optimizer_sharding=dp_reshardable, whose "
            f"optimizer state loads only at the same TP, PP, VPP and EP; this run is {_describe_layout(here)}. Resume "
            f"at {_describe_layout(saved, dp=False)} (any DP), or export the weights alone "
            "(tools/convert_checkpoint.py export) and start a new run from them. Runs that may change layout on "
            "resume: megatron.optimizer_sharding=fully_reshardable. Nothing was loaded")


def _optimizer_metadata(sharding: str, chain_prefix: bool = False) -> Dict[str, object]:
    """What megatron's `sharded_state_dict` is told. fully_reshardable state is keyed by the
    parameters' own names, with no `chained_<i>.` prefix for the dense and expert optimizers a
    mixture has at EP > 1 (megatron's `chained_optim_avoid_prefix`), so the same key names
    the same parameter at every EP. `chain_prefix`: a checkpoint saved before that."""
    return {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": not chain_prefix}


def _saved_with_chain_prefix(model_optim_dir: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(model_optim_dir)).read_metadata().state_dict_metadata
    return any(k.startswith("chained_0.optimizer.state.") for k in keys)


def _regroup_optimizer_state(loaded: StateDict, live_commons: List[StateDict]) -> StateDict:
    """The loaded optimizer state in the live optimizer's shape when the checkpoint's had
    another number of sub-optimizers (a mixture saved at EP > 1, with dense and expert
    optimizers, resumed at EP 1, with one, or the reverse), else `loaded` as it is.

    dist_checkpointing fills the live structure's tensors by key (the parameter state:
    moments and fp32 main params, keyed by parameter) and puts the saved common state (each
    saved sub-optimizer's param groups) beside them. Each live sub-optimizer keeps its own
    param groups with the saved step (one per run: megatron synchronizes it across the chain);
    the learning rate comes from the restored scheduler."""
    live_chain = len(live_commons)
    if (live_chain == 1) == ("optimizer" in loaded):
        return loaded
    saved_parts = [loaded] if "optimizer" in loaded else [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))]
    steps = {g["step"] for part in saved_parts for g in (part.get("optimizer") or {}).get("param_groups", [])
             if g.get("step") is not None}
    if len(steps) != 1:
        raise CheckpointLayoutError(f"the checkpoint's sub-optimizers are at steps {sorted(steps)}, not one step; "
                                    "nothing of the optimizer was loaded")
    step = steps.pop()
    parts = []
    for i, common in enumerate(live_commons):
        part = dict(common)
        part["optimizer"] = dict(common["optimizer"], param_groups=[
            dict(g, step=step) for g in common["optimizer"]["param_groups"]])
        part["param_state"] = (loaded if live_chain == 1 else loaded[i])["param_state"]
        part["param_state_sharding_type"] = saved_parts[0]["param_state_sharding_type"]
        parts.append(part)
    return parts[0] if live_chain == 1 else dict(enumerate(parts))


def _load_fully_reshardable_with_torch_adam(optimizer, state: StateDict) -> None:
    """`optimizer.load_state_dict(state)` for fully_reshardable state and a torch Adam.

    megatron-core 0.16.1's `load_parameter_state_from_fully_reshardable` leaves "step" out
    of the tensors it hands to `_set_main_param_and_optimizer_states`, which then copies
    every key of the live state, "step" included (torch Adam keeps it per parameter;
    Apex/TE's fused Adam keeps it in the param groups): KeyError 'step'. The step is taken
    out of the live state for each copy and put back after it (`_restore_adam_step` then
    sets the saved value)."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        setter = getattr(opt, "_set_main_param_and_optimizer_states", None)
        index = getattr(opt, "model_param_group_index_map", None)
        if setter is None or index is None:
            continue

        def set_without_step(model_param, tensors, opt=opt, setter=setter, index=index):
            group, order = index[model_param]
            live = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
            step = live.pop("step", None) if "step" not in tensors else None
            try:
                setter(model_param, tensors)
            finally:
                if step is not None:
                    live["step"] = step

        opt._set_main_param_and_optimizer_states = set_without_step
        patched.append(opt)
    try:
        optimizer.load_state_dict(state)
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def verify_checkpoint_files(model_optim_dir: Path | str) -> None:
    """Every shard file named by a distributed checkpoint's index exists and is long enough.

    dist_checkpointing loads straight into the live parameters, so a shard found missing
    half-way would leave a half-loaded model; this check runs before anything is read and
    raises CheckpointCorruptError naming the file and a tensor stored in it.
    """
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(model_optim_dir)).read_metadata().storage_data or {}
    needed: Dict[str, Tuple[int, str]] = {}
    for index, info in storage.items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (0, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for rel, (end, tensor) in sorted(needed.items()):
        path = Path(model_optim_dir) / rel
        size = path.stat().st_size if path.is_file() else None
        if size is None or size < end:
            found = "is missing" if size is None else f"has {size} bytes, the index needs {end}"
            raise CheckpointCorruptError(f"{path} {found}; it holds tensor {tensor!r} (and maybe others). Nothing "
                                         "was loaded: the model and optimizer are unchanged")


def verify_checkpoint_fits(state: ShardedStateDict, model_optim_dir: Path | str) -> None:
    """Every tensor of `state` (a sharded state dict about to be loaded) is in the checkpoint
    with the same global shape; else raise CheckpointCorruptError naming the tensor, before
    anything is read (a checkpoint of another size or architecture is refused whole)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(model_optim_dir)).read_metadata().state_dict_metadata
    for sh in nested_values(state):
        # optimizer buffers are laid out by megatron for the DP size it resumes at: not checked
        if not isinstance(sh, ShardedTensor) or sh.allow_shape_mismatch or sh.key.startswith("optimizer."):
            continue
        if sh.key not in saved:
            raise CheckpointCorruptError(f"tensor {sh.key!r} of the model is not in {model_optim_dir} (a checkpoint "
                                         "of another architecture?). Nothing was loaded")
        size = tuple(getattr(saved[sh.key], "size", ()))
        if size != tuple(sh.global_shape):
            raise CheckpointCorruptError(f"tensor {sh.key!r}: checkpoint shape {list(size)} != model shape "
                                         f"{list(sh.global_shape)} in {model_optim_dir} (another model size or "
                                         "architecture?). Nothing was loaded")


def load_checkpoint(learner, ckpt_dir: Path | str, load_optimizer: bool = True,
                    load_rng: bool = True) -> Dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG from `ckpt_dir`; return the trainer state.

    ckpt_dir: a `step_<N>` directory, or a run / checkpoints directory (its latest complete
    checkpoint). Collective: every learner rank calls it. The model may be loaded at a
    different TP/PP than it was saved with; the optimizer state too when it was saved
    fully_reshardable (dp_reshardable state at another TP/PP/VPP raises CheckpointLayoutError
    before anything is read). RNG states are per rank: restored only when this rank's file
    exists (a new layout draws fresh dropout streams on the ranks that had none).
    """
    from megatron.core import dist_checkpointing

    ckpt = resolve_checkpoint_dir(ckpt_dir)
    trainer_state = read_trainer_state(ckpt)
    sharding = trainer_state.get("optimizer_sharding", DEFAULT_OPTIMIZER_SHARDING)
    here = _layout_record(learner)
    problem = resume_layout_problem(trainer_state, here, ckpt) if load_optimizer and here else None
    if problem:
        raise CheckpointLayoutError(problem)
    live_commons: List[StateDict] = []
    if load_optimizer:
        optimizer = getattr(learner, "optimizer", None)
        chain_prefix = optimizer is not None and _saved_with_chain_prefix(ckpt / MODEL_OPTIM_DIR)
        if optimizer is not None:
            _prepare_optimizer_for_loading(optimizer)
            live_commons = [opt.state_dict() for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
            if chain_prefix and len(live_commons) == 1:
                raise CheckpointLayoutError(
                    f"{ckpt} keeps its expert optimizer's state under megatron's chained_<i>. prefix (saved before "
                    "this trainer dropped it), which loads only at the expert parallelism it was saved at, "
                    f"{_describe_layout(trainer_state.get('learner_layout') or {}, dp=False)}. Resume there once "
                    "(the next checkpoint loads at any EP). Nothing was loaded")
        state = _full_state(learner, True, sharding, chain_prefix)
    else:
        state = model_sharded_state_dict(learner.model_chunks)
    verify_checkpoint_files(ckpt / MODEL_OPTIM_DIR)
    verify_checkpoint_fits(state, ckpt / MODEL_OPTIM_DIR)
    loaded = dist_checkpointing.load(state, str(ckpt / MODEL_OPTIM_DIR))
    load_model_state(learner.model_chunks, loaded)
    if load_optimizer and getattr(learner, "optimizer", None) is not None:
        loaded["optimizer"] = _regroup_optimizer_state(loaded["optimizer"], live_commons)
        with torch.no_grad():  # copies into fp32 main params, which require grad
            if sharding == "fully_reshardable":
                _load_fully_reshardable_with_torch_adam(learner.optimizer, loaded["optimizer"])
            else:
                learner.optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_step(learner.optimizer, loaded["optimizer"])
        scheduler = getattr(learner, "scheduler", None)
        if scheduler is not None and "opt_param_scheduler" in loaded and hasattr(scheduler, "load_state_dict"):
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
    elif getattr(learner, "optimizer", None) is not None:
        learner.optimizer.reload_model_params()
    rng_path = ckpt / RNG_DIR / f"rank_{D.rank():05d}.pt"
    if load_rng and rng_path.is_file():
        restore_rng_state(torch.load(rng_path, weights_only=True))
    D.barrier()
    trainer_state["checkpoint_dir"] = str(ckpt)
    return trainer_state
