"""Streaming Megatron ⇄ HF weights over the parallel layout, one tensor at a time.

`iter_megatron_to_hf` is THE function that turns a live (possibly TP/PP/VPP sharded)
Megatron model into Hugging Face tensors. The offline export of `convert_checkpoint.py`
and the live weight sync to the rollout engines (`dapo_mega/weights/sync.py`) both call
exactly it, so what the engines receive is what the conversion tests check against
transformers.

Contract of `iter_megatron_to_hf(model_chunks, info, layout)`:

* Who calls it: every rank of a pipeline stage's tensor-parallel group, in lockstep (each
  tensor-parallel parameter is all-gathered over the TP group, one parameter at a time).
  Only data/context-parallel rank 0 needs the weights; other DP/CP replicas may skip the
  call (their TP groups are separate, so skipping deadlocks nothing). With expert
  parallelism (EP > 1) every rank of the stage calls it (`ParallelLayout.drains_weights`):
  each expert tensor is all-gathered over the expert-parallel group, which spans DP ranks,
  so that every rank yields every expert. Different pipeline
  stages yield different tensors (each stage yields the layers it holds, with global
  layer numbers); the caller broadcasts/writes per stage.
* What it yields: `(hf_name, tensor)` with the HF name (`model.layers.17.self_attn.q_proj
  .weight`), the full unsharded HF shape, the parameter dtype, on the parameter's device,
  vocabulary padding removed, q/k/v and gate/up split. Every TP rank of the stage yields
  the same tensors; `layout.is_weight_source`-style logic (TP rank 0) decides who sends.
* Memory: one gathered parameter at a time (plus its HF pieces); the model is never
  copied whole. A consumer that buckets tensors bounds the rest.
* Tied embeddings: `lm_head.weight` is never yielded (HF ties it to the embedding).

`load_hf_into_megatron(model_chunks, info, layout, get_hf_tensor)` is the inverse: every
rank builds each full Megatron tensor from lazily fetched HF tensors and copies its own
TP slice into its parameter. Call it before the optimizer copies model parameters into
fp32 main parameters, or call `optimizer.reload_model_params()` afterwards.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Set, Tuple

import torch

from dapo_mega.backends.megatron.model import ModelInfo, unwrap_chunk
from dapo_mega.weights import mapping as M


def global_param_name(model: torch.nn.Module, local_name: str) -> str:
    """`decoder.layers.<local>.x` → `decoder.layers.<global>.x` using `layer.layer_number`.

    Megatron numbers layers from 1 globally (PP stage and virtual-chunk offsets included),
    so `layer_number - 1` is the HF layer index whatever the pipeline layout.
    """
    name = M.canonical_megatron_name(local_name)
    m = M._LAYER_NAME.match(name)
    if not m:
        return name
    layer = model.decoder.layers[int(m.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"
    expert = M.expert_of(name)
    if expert is not None:  # a local expert's index on this EP rank -> the model's
        name = M.with_expert(name, layer.mlp.local_expert_indices[expert[0]])
    return name


def _ep_group_size_rank(layout) -> Tuple[Optional[object], int, int]:
    """The expert-parallel process group, its size and this rank's index (1 and 0 at EP 1)."""
    if getattr(layout, "ep", 1) == 1:
        return None, 1, 0
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    return group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _tp_group_size_rank(layout) -> Tuple[Optional[object], int, int]:
    """The TP process group, its size and this rank's index (megatron's parallel_state)."""
    from megatron.core import parallel_state as ps

    group = getattr(layout, "tp_group", None) or ps.get_tensor_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    return group, size, rank


def _named_weights(chunk: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module, torch.Tensor]]:
    """(global Megatron name, unwrapped model, parameter) of one chunk, in module order."""
    model = unwrap_chunk(chunk)
    for local_name, param in model.named_parameters():
        if M.is_megatron_extra_state(local_name):
            continue
        yield global_param_name(model, local_name), model, param


@torch.no_grad()
def iter_megatron_to_hf(model_chunks: List[torch.nn.Module], info: ModelInfo,
                        layout) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every weight this pipeline stage holds.

    See the module docstring for who calls it and what it guarantees. TP shards are
    all-gathered per parameter over the TP group (gloo on CPU, NCCL on GPU).
    """
    shape = info.shape
    group, tp_size, _ = _tp_group_size_rank(layout)
    ep_group, ep_size, _ = _ep_group_size_rank(layout)
    for chunk in model_chunks:
        for name, _, param in _named_weights(chunk):
            if name == M.OUTPUT_LAYER_NAME and shape.tie_word_embeddings:
                continue  # HF ties lm_head to embed_tokens
            spec, _ = M.lookup(name)
            local = param.detach()
            if spec.tp_split == M.EXPERT and ep_size > 1:
                yield from _gathered_experts(name, local, ep_group, ep_size, shape)
                continue
            if tp_size > 1 and spec.tp_split not in (M.REPLICATED, M.EXPERT):
                local = local.contiguous()
                shards = [torch.empty_like(local) for _ in range(tp_size)]
                torch.distributed.all_gather(shards, local, group=group)
                full = M.merge_tp_shards(shards, spec)
                del shards
            else:
                full = local
            yield from M.megatron_to_hf_tensors(name, full, shape)


def _gathered_experts(name: str, local: torch.Tensor, group, ep_size: int, shape) -> Iterator[Tuple[str, torch.Tensor]]:
    """The HF tensors of one local expert tensor on every EP rank (all-gathered over the EP
    group: rank r's local expert K is the model's expert `local_expert_indices` of rank r)."""
    index, _ = M.expert_of(name)
    per_rank = shape.num_experts // ep_size
    local_k = index % per_rank
    shards = [torch.empty_like(local.contiguous()) for _ in range(ep_size)]
    torch.distributed.all_gather(shards, local.contiguous(), group=group)
    for rank, shard in enumerate(shards):
        yield from M.megatron_to_hf_tensors(M.with_expert(name, rank * per_rank + local_k), shard, shape)


@torch.no_grad()
def load_hf_into_megatron(model_chunks: List[torch.nn.Module], info: ModelInfo, layout,
                          get_hf_tensor: Callable[[str], torch.Tensor]) -> Set[str]:
    """Copy HF weights into this rank's Megatron parameters; returns the HF names used.

    get_hf_tensor(name) returns the full HF tensor (any dtype; cast to the parameter's)
    and raises KeyError when absent (→ MissingHFTensorError naming it). A TP slice whose
    shape differs from the parameter raises WeightMappingError naming both names.
    """
    shape = info.shape
    _, tp_size, tp_rank = _tp_group_size_rank(layout)
    used: Set[str] = set()

    def fetch(hf_name: str) -> torch.Tensor:
        used.add(hf_name)
        return get_hf_tensor(hf_name)

    getter = _Getter(fetch, getattr(get_hf_tensor, "__contains__", None))
    for chunk in model_chunks:
        for name, _, param in _named_weights(chunk):
            spec, _ = M.lookup(name)
            full = M.hf_to_megatron_tensor(name, getter, shape)
            shard = M.split_for_tp(full, spec, tp_size, tp_rank)
            if tuple(shard.shape) != tuple(param.shape):
                raise M.WeightMappingError(
                    f"shape mismatch for Megatron {name} (from {', '.join(M.hf_names_of(name))}): "
                    f"TP slice {tuple(shard.shape)} vs parameter {tuple(param.shape)}")
            param.data.copy_(shard.to(dtype=param.dtype, device=param.device))
    return used


class _Getter:
    """A callable with an optional `in` test, recording the names it served."""

    def __init__(self, fetch: Callable[[str], torch.Tensor], contains: Optional[Callable[[str], bool]]):
        self._fetch, self._contains = fetch, contains

    def __call__(self, name: str) -> torch.Tensor:
        return self._fetch(name)

    def __contains__(self, name: str) -> bool:
        if self._contains is not None:
            return self._contains(name)
        try:
            self._fetch(name)
            return True
        except KeyError:
            return False
