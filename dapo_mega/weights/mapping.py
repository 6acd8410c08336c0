"""The one Megatron ⇄ Hugging Face name/shape mapping (Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE and Llama).

Pure functions over tensors and the model's `ModelShape` (`dapo_mega/models/shape.py`,
with Megatron's padded vocabulary): no process groups here (the distributed streaming that uses
this table is in `dapo_mega/weights/stream.py`). Offline conversion
(`tools/convert_checkpoint.py`) and the live weight sync to the rollout engines both go
through this module, so a fused-tensor bug shows up in the conversion tests against
transformers rather than as gibberish after the first sync.

Names. A Megatron GPTModel parameter is named, per model chunk,
`decoder.layers.<local>.<suffix>` where `<local>` is the index inside this pipeline stage
(or virtual chunk); the global layer is `layer.layer_number - 1`. The local layer spec and
the Transformer Engine spec differ only in where the RMSNorm weights live:

    local spec                                   TE spec
    decoder.layers.N.input_layernorm.weight      decoder.layers.N.self_attention.linear_qkv.layer_norm_weight
    decoder.layers.N.pre_mlp_layernorm.weight    decoder.layers.N.mlp.linear_fc1.layer_norm_weight

Both are normalised to the local spelling (`canonical_megatron_name`) before the table
lookup. (Megatron's own `sharded_state_dict` maps the other way, so distributed checkpoints
carry the TE spelling and load into either spec.)

Fused tensors (full, TP-merged shapes; nh query heads, ng = num_query_groups KV heads,
d = head_dim, h = hidden, f = ffn hidden):

    linear_qkv.weight [ng·(nh/ng + 2)·d, h]: per query group g, the rows are
        q heads g·nh/ng … (g+1)·nh/ng − 1, then k head g, then v head g       (Eq. QKV)
        ⇄ q_proj [nh·d, h], k_proj [ng·d, h], v_proj [ng·d, h]   (biases: same, 1-D)
    linear_fc1.weight [2f, h] = [gate_proj; up_proj]                            (Eq. FC1)

Tensor parallelism (tp ranks, rank r holds slice r):

    column parallel (linear_qkv, linear_fc1): dim 0 split into tp contiguous slices of the
        fused tensor above; for linear_fc1 each rank holds [gate_r; up_r] (the gate and up
        halves are split separately, then concatenated), so merging TP shards of fc1 is
        not a plain concatenation.
    row parallel (linear_proj, linear_fc2): dim 1 split; their biases are replicated.
    vocab parallel (word_embeddings, output_layer): dim 0 split after padding the vocabulary
        to `padded_vocab_size` (divisible by tp·make_vocab_size_divisible_by); the padding
        rows are removed on export and added (as zeros) on import.
    replicated (norms): every rank holds the whole tensor. Qwen3's per-head q/k norms
        (`self_attention.q_layernorm.weight` ⇄ `self_attn.q_norm.weight`, k likewise,
        [head_dim]) are replicated too: every head on every rank shares one weight.

Mixture of experts (Qwen3-MoE). A sparse layer's router and experts (expert TP 1: each
expert whole on one expert-parallel rank; `megatron.expert_model_parallel_size` ranks hold
num_experts / EP experts each):

    mlp.router.weight [E, h]                          ⇄ mlp.gate.weight              (replicated)
    mlp.experts.local_experts.K.linear_fc1.weight     ⇄ mlp.experts.K.{gate,up}_proj.weight (Eq. FC1)
    mlp.experts.local_experts.K.linear_fc2.weight     ⇄ mlp.experts.K.down_proj.weight

where K in a *global* name is the global expert index (`local_expert_indices` of the rank's
layer; megatron-core's own checkpoints number them so too), and Transformer Engine's grouped
GEMM spelling `mlp.experts.linear_fc1.weightK` is read as the same name.

Tied embeddings (`tie_word_embeddings`): HF stores only `model.embed_tokens.weight`; the
Megatron output layer is skipped on export and, where a pipeline stage holds a separate
copy of it (PP > 1), it is filled from `lm_head.weight` when present, else the embedding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch

from dapo_mega.models.shape import HF_ARCHITECTURES, ModelShape

SUPPORTED_ARCHITECTURES = tuple(HF_ARCHITECTURES.values())
"""HF `config.architectures[0]` values this mapping knows. Anything else is refused."""


class UnsupportedArchitectureError(ValueError):
    """The HF architecture is not one this mapping supports."""


class WeightMappingError(ValueError):
    """A tensor is missing, has the wrong shape, or has no mapping. The message names it."""


# --------------------------------------------------------------------------- architectures


def check_architecture(hf_config) -> str:
    """The architecture name of an HF config (or a name), refusing unsupported ones."""
    if isinstance(hf_config, str):
        names = [hf_config]
    else:
        names = list(getattr(hf_config, "architectures", None) or [])
        if not names and isinstance(hf_config, dict):
            names = list(hf_config.get("architectures") or [])
    if not names or names[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {names[0] if names else '(none in config.json)'!r}: "
            f"dapo-mega converts only {', '.join(SUPPORTED_ARCHITECTURES)}")
    cfg = hf_config if not isinstance(hf_config, (str, dict)) else None
    if cfg is not None and (getattr(cfg, "mlp_bias", False) or
                            (names[0] in ("LlamaForCausalLM", "Qwen3ForCausalLM")
                             and getattr(cfg, "attention_bias", False))):
        raise UnsupportedArchitectureError(
            f"{names[0]} with attention_bias/mlp_bias is not supported (Megatron would need "
            "add_bias_linear on every linear layer)")
    return names[0]


# --------------------------------------------------------------------------- the table

REPLICATED, COLUMN, ROW, VOCAB = "replicated", "column", "row", "vocab"
"""How a Megatron tensor is split over tensor-parallel ranks."""

COPY, QKV, GATE_UP = "copy", "qkv", "gate_up"
"""How a Megatron tensor becomes HF tensors: one-to-one, split q/k/v, split gate/up."""


@dataclass(frozen=True)
class ParamSpec:
    """One row of the mapping: a Megatron tensor and the HF tensor(s) it holds."""

    hf_names: Tuple[str, ...]
    """HF names, `{layer}` filled with the global layer index."""
    tp_split: str
    """REPLICATED, COLUMN, ROW or VOCAB."""
    fuse: str = COPY
    """COPY, QKV or GATE_UP."""


_LAYER_TABLE: Dict[str, ParamSpec] = {
    "input_layernorm.weight": ParamSpec(("model.layers.{layer}.input_layernorm.weight",), REPLICATED),
    "self_attention.linear_qkv.weight": ParamSpec(
        tuple(f"model.layers.{{layer}}.self_attn.{p}_proj.weight" for p in "qkv"), COLUMN, QKV),
    "self_attention.linear_qkv.bias": ParamSpec(
        tuple(f"model.layers.{{layer}}.self_attn.{p}_proj.bias" for p in "qkv"), COLUMN, QKV),
    "self_attention.linear_proj.weight": ParamSpec(("model.layers.{layer}.self_attn.o_proj.weight",), ROW),
    "self_attention.q_layernorm.weight": ParamSpec(("model.layers.{layer}.self_attn.q_norm.weight",), REPLICATED),
    "self_attention.k_layernorm.weight": ParamSpec(("model.layers.{layer}.self_attn.k_norm.weight",), REPLICATED),
    "pre_mlp_layernorm.weight": ParamSpec(("model.layers.{layer}.post_attention_layernorm.weight",), REPLICATED),
    "mlp.linear_fc1.weight": ParamSpec(
        ("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"), COLUMN, GATE_UP),
    "mlp.linear_fc2.weight": ParamSpec(("model.layers.{layer}.mlp.down_proj.weight",), ROW),
    "mlp.router.weight": ParamSpec(("model.layers.{layer}.mlp.gate.weight",), REPLICATED),  # a mixture's
}

EXPERT = "expert"
"""How an expert tensor is split: not over TP (expert TP 1), whole on its EP rank."""
_EXPERT_TABLE: Dict[str, ParamSpec] = {
    "linear_fc1.weight": ParamSpec(("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
                                    "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"), EXPERT, GATE_UP),
    "linear_fc2.weight": ParamSpec(("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",), EXPERT),
}
_EXPERT_NAME = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT_NAME = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

_GLOBAL_TABLE: Dict[str, ParamSpec] = {
    "embedding.word_embeddings.weight": ParamSpec(("model.embed_tokens.weight",), VOCAB),
    "decoder.final_layernorm.weight": ParamSpec(("model.norm.weight",), REPLICATED),
    "output_layer.weight": ParamSpec(("lm_head.weight",), VOCAB),
}

_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EMBEDDING_NAME = "embedding.word_embeddings.weight"
OUTPUT_LAYER_NAME = "output_layer.weight"


def canonical_megatron_name(name: str) -> str:
    """Strip wrapper prefixes (`module.`) and map TE-spec norm names to local-spec names."""
    while name.startswith("module."):
        name = name[len("module."):]
    m = _LAYER_NAME.match(name)
    if m and m.group(2) in _TE_TO_LOCAL:
        return f"decoder.layers.{m.group(1)}.{_TE_TO_LOCAL[m.group(2)]}"
    grouped = _GROUPED_EXPERT_NAME.match(m.group(2)) if m else None
    if grouped:
        return f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    return name


def expert_of(name: str) -> Optional[Tuple[int, str]]:
    """(expert index, suffix after it) of an expert tensor's layer-relative or full name, else None."""
    m = _LAYER_NAME.match(canonical_megatron_name(name))
    expert = _EXPERT_NAME.match(m.group(2) if m else name)
    return (int(expert.group(1)), expert.group(2)) if expert else None


def with_expert(name: str, expert: int) -> str:
    """`name` (an expert tensor's) with its expert index replaced by `expert`."""
    m = _LAYER_NAME.match(canonical_megatron_name(name))
    suffix = _EXPERT_NAME.sub(lambda e: f"mlp.experts.local_experts.{expert}.{e.group(2)}", m.group(2))
    return f"decoder.layers.{m.group(1)}.{suffix}"


def is_megatron_extra_state(name: str) -> bool:
    """TE/FP8 bookkeeping (`._extra_state`) and rotary buffers carry no HF weight."""
    return name.endswith("_extra_state") or "rotary_pos_emb" in name


def lookup(global_name: str) -> Tuple[ParamSpec, Optional[int]]:
    """(spec, global layer index or None) of a global Megatron name (local or TE spelling).

    Raises WeightMappingError naming the parameter when it has no mapping.
    """
    name = canonical_megatron_name(global_name)
    m = _LAYER_NAME.match(name)
    if m:
        spec = _LAYER_TABLE.get(m.group(2))
        expert = _EXPERT_NAME.match(m.group(2))
        if expert and expert.group(2) in _EXPERT_TABLE:
            row = _EXPERT_TABLE[expert.group(2)]
            spec = ParamSpec(tuple(n.replace("{expert}", expert.group(1)) for n in row.hf_names), row.tp_split,
                             row.fuse)
        if spec is not None:
            return spec, int(m.group(1))
    elif name in _GLOBAL_TABLE:
        return _GLOBAL_TABLE[name], None
    raise WeightMappingError(
        f"Megatron parameter {global_name!r} has no Hugging Face mapping (supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)})")


def hf_names_of(global_name: str) -> Tuple[str, ...]:
    """HF names held by one global Megatron tensor."""
    spec, layer = lookup(global_name)
    return tuple(n.format(layer=layer) for n in spec.hf_names)


# --------------------------------------------------------------------------- fused tensors


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_attention_heads: int,
             num_query_groups: int, head_dim: int) -> torch.Tensor:
    """HF q/k/v → Megatron's per-query-group interleaved linear_qkv (Eq. QKV above).

    q: [nh·d, *rest], k, v: [ng·d, *rest] (rest = [h] for weights, [] for biases)
    → [ng·(nh/ng + 2)·d, *rest]
    """
    ng, per_group = num_query_groups, num_attention_heads // num_query_groups
    rest = q.shape[1:]
    qg = q.reshape(ng, per_group * head_dim, *rest)
    kg = k.reshape(ng, head_dim, *rest)
    vg = v.reshape(ng, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (per_group + 2) * head_dim, *rest)


def split_qkv(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int,
              head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: [ng·(nh/ng + 2)·d, *rest] → q [nh·d, *rest], k, v [ng·d, *rest]."""
    ng, per_group = num_query_groups, num_attention_heads // num_query_groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(num_attention_heads * head_dim, *rest).contiguous(),
            k.reshape(ng * head_dim, *rest).contiguous(),
            v.reshape(ng * head_dim, *rest).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[f, h], [f, h] → linear_fc1 [2f, h] = [gate; up] (Eq. FC1)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """linear_fc1 [2f, h] → gate [f, h], up [f, h]."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


# --------------------------------------------------------------------------- vocab padding


def pad_vocab(t: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """[vocab, h] → [padded_vocab, h] with zero rows appended (Megatron's padded vocab)."""
    extra = padded_vocab_size - t.shape[0]
    if extra < 0:
        raise WeightMappingError(f"vocabulary {t.shape[0]} larger than padded size {padded_vocab_size}")
    if extra == 0:
        return t
    return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))], dim=0)


def unpad_vocab(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[padded_vocab, h] → [vocab, h]: the padding rows never reach HF."""
    return t[:vocab_size].contiguous()


# --------------------------------------------------------------------------- tensor parallel


def split_for_tp(full: torch.Tensor, spec: ParamSpec, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's slice of a full Megatron tensor (vocab already padded).

    COLUMN: dim 0 in tp slices; for GATE_UP the gate and up halves are sliced separately
    and concatenated, [gate_r; up_r]. ROW: dim 1 in tp slices. VOCAB: dim 0.
    """
    if tp_size == 1 or spec.tp_split in (REPLICATED, EXPERT):
        return full
    if spec.tp_split == COLUMN and spec.fuse == GATE_UP:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, dim=0)[tp_rank],
                          torch.chunk(up, tp_size, dim=0)[tp_rank]], dim=0).contiguous()
    dim = 1 if spec.tp_split == ROW else 0
    if full.shape[dim] % tp_size:
        raise WeightMappingError(f"dim {dim} of size {full.shape[dim]} not divisible by TP {tp_size}")
    return torch.chunk(full, tp_size, dim=dim)[tp_rank].contiguous()


def merge_tp_shards(shards: Sequence[torch.Tensor], spec: ParamSpec) -> torch.Tensor:
    """Inverse of `split_for_tp`: the per-rank slices (rank order) → the full tensor."""
    if len(shards) == 1 or spec.tp_split in (REPLICATED, EXPERT):
        return shards[0]
    if spec.tp_split == COLUMN and spec.fuse == GATE_UP:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=1 if spec.tp_split == ROW else 0)


# --------------------------------------------------------------------------- full tensors


def megatron_to_hf_tensors(global_name: str, full: torch.Tensor,
                           shape: ModelShape) -> Iterator[Tuple[str, torch.Tensor]]:
    """One full (TP-merged) Megatron tensor → its (hf_name, tensor) pairs.

    Vocab-parallel tensors lose their padding rows here.
    """
    spec, layer = lookup(global_name)
    names = [n.format(layer=layer) for n in spec.hf_names]
    if spec.fuse == QKV:
        yield from zip(names, split_qkv(full, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim))
    elif spec.fuse == GATE_UP:
        yield from zip(names, split_gate_up(full))
    elif spec.tp_split == VOCAB:
        yield names[0], unpad_vocab(full, shape.vocab_size)
    else:
        yield names[0], full


class MissingHFTensorError(WeightMappingError, KeyError):
    """An HF tensor the model needs is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def hf_to_megatron_tensor(global_name: str, get_hf_tensor, shape: ModelShape) -> torch.Tensor:
    """The full Megatron tensor `global_name` built from HF tensors (vocab padded).

    get_hf_tensor(hf_name) -> torch.Tensor returns the full HF tensor (e.g. lazily from
    safetensors) and raises KeyError when it is absent.
    """
    spec, layer = lookup(global_name)
    names = [n.format(layer=layer) for n in spec.hf_names]
    if canonical_megatron_name(global_name) == OUTPUT_LAYER_NAME and shape.tie_word_embeddings:
        # A pipeline stage that holds its own copy of a tied output layer.
        names = ["lm_head.weight"] if _has(get_hf_tensor, "lm_head.weight") else ["model.embed_tokens.weight"]
    tensors = [_fetch(get_hf_tensor, n) for n in names]
    for n, t in zip(names, tensors):
        _check_hf_shape(n, t, shape)
    if spec.fuse == QKV:
        return fuse_qkv(*tensors, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim)
    if spec.fuse == GATE_UP:
        return fuse_gate_up(*tensors)
    if spec.tp_split == VOCAB:
        return pad_vocab(tensors[0], shape.padded_vocab_size)
    return tensors[0]


def expected_hf_shape(hf_name: str, shape: ModelShape) -> Optional[Tuple[int, ...]]:
    """The shape an HF tensor must have for this model shape (None for names not in the table)."""
    h, d = shape.hidden_size, shape.head_dim
    leaf = hf_name.split(".")[-2] + "." + hf_name.split(".")[-1]
    if ".mlp.experts." in hf_name:
        f = shape.moe_ffn_hidden_size
        return {"gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)}.get(leaf)
    if hf_name.endswith(".mlp.gate.weight"):
        return (shape.num_experts, h)
    shapes = {
        "embed_tokens.weight": (shape.vocab_size, h), "lm_head.weight": (shape.vocab_size, h),
        "norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (shape.num_attention_heads * d, h), "q_proj.bias": (shape.num_attention_heads * d,),
        "k_proj.weight": (shape.num_key_value_heads * d, h), "k_proj.bias": (shape.num_key_value_heads * d,),
        "v_proj.weight": (shape.num_key_value_heads * d, h), "v_proj.bias": (shape.num_key_value_heads * d,),
        "o_proj.weight": (h, shape.num_attention_heads * d),
        "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (shape.ffn_hidden_size, h), "up_proj.weight": (shape.ffn_hidden_size, h),
        "down_proj.weight": (h, shape.ffn_hidden_size),
    }
    return shapes.get(leaf)


def _check_hf_shape(hf_name: str, t: torch.Tensor, shape: ModelShape) -> None:
    want = expected_hf_shape(hf_name, shape)
    if want is not None and tuple(t.shape) != want:
        raise WeightMappingError(
            f"shape mismatch for {hf_name}: checkpoint has {tuple(t.shape)}, the model config "
            f"expects {want}")


def _fetch(get_hf_tensor, hf_name: str) -> torch.Tensor:
    try:
        return get_hf_tensor(hf_name)
    except KeyError as exc:
        if isinstance(exc, MissingHFTensorError):
            raise
        raise MissingHFTensorError(f"tensor {hf_name} is missing from the Hugging Face checkpoint") from exc


def _has(get_hf_tensor, hf_name: str) -> bool:
    contains = getattr(get_hf_tensor, "__contains__", None)
    if contains is not None:
        return contains(hf_name)
    try:
        get_hf_tensor(hf_name)
        return True
    except KeyError:
        return False
