"""Model provider: a megatron-core GPTModel for Qwen2 / Qwen2.5 / Qwen3 / Llama from a HF config.

    build_model(hf_config, mcfg, layout) -> ([GPTModel chunk per virtual stage], ModelInfo)

The model's numbers come from the one shape record, `dapo_mega.models.shape.ModelShape`;
`ModelInfo` adds what this build decided (layer spec, dtype, FP8) and carries the shape
with Megatron's padded vocabulary.

Architecture mapping (HF -> megatron TransformerConfig / GPTModel):

    num_key_value_heads   -> num_query_groups (GQA)
    Qwen2: always QKV bias; Llama: attention_bias -> add_qkv_bias; no other linear bias
    head_dim              -> kv_channels (Qwen3's is not hidden / heads)
    Qwen3 q_norm / k_norm -> qk_layernorm=True (RMSNorm over head_dim per head, before RoPE;
                             the layer spec's q_layernorm / k_layernorm)
    rms_norm_eps          -> normalization="RMSNorm", layernorm_epsilon
    SwiGLU MLP            -> gated_linear_unit=True, activation_func=silu
    rope θ                -> position_embedding_type="rope", rotary_base; llama3 scaling ->
                             the rotary embedding's inv_freq rescaled by megatron's own
                             `_apply_scaling` with all four HF fields (`apply_rope_scaling`:
                             GPTModel's `rope_scaling=True` hard-codes low 1, high 4, 8192)
    tie_word_embeddings   -> share_embeddings_and_output_weights
    vocab_size            -> padded to a multiple of 128·TP (the shape keeps both, so
                             conversion can strip the padding rows)

Layer spec: Transformer Engine (`get_gpt_layer_with_transformer_engine_spec`) on a GPU
(`megatron.transformer_impl: auto` or `transformer_engine`), with FP8 settings from
`megatron.fp8`; on a GPU where `transformer_engine.pytorch` does not import, the build stops
with TE's own import error (logged as well) instead of falling back: the local spec would
fail later on `sequence_parallel` with a message that hides the cause. The local spec (`get_gpt_layer_local_spec(normalization="RMSNorm")`, its
core attention through torch's fused SDPA kernel: `attention.py`) on the CPU or when asked
for by name. `plan_transformer_config` is the pure config -> (TransformerConfig kwargs, spec)
function, unit-testable on the CPU without importing TE.

Dtype policy: on GPU bf16 parameters (`params_dtype=bf16`, `bf16=True`); the learner's
Megatron DDP keeps fp32 gradient buffers (`grad_reduce_in_fp32`) and the optimizer fp32
main params and Adam state (`OptimizerConfig(bf16=True)`). On the CPU everything is fp32.

Initialisation is deterministic and independent of the parallel layout: every parameter's
*full* (unsharded, unpadded) tensor is drawn from a generator seeded by `mcfg.seed` and
the parameter's global name, then this rank's shard is cut out exactly as megatron's
`_initialize_affine_weight_cpu` cuts it. TP=1 and TP=2 (or PP=2) builds are therefore the
same function. Real runs overwrite these weights from a HF or Megatron checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from dapo_mega import log
from dapo_mega.backends.megatron.layout import ParallelLayout
from dapo_mega.config import ConfigError, MegatronConfig
from dapo_mega.models.shape import HfConfigSource, ModelShape

VOCAB_PAD_MULTIPLE = 128
INIT_STD = 0.02
LOCAL_SPEC = "local"
TE_SPEC = "transformer_engine"

logger = log.get(__name__)

NO_GPU = "no CUDA GPU on this machine"
"""`transformer_engine_import_error()` without a GPU: TE is not tried there."""
TE_INSTALL_FIX = ("install the learner side as docs/cluster.md section 1 does (`pip install --no-build-isolation -c "
                  "constraints-gpu.txt -e '.[gpu]'`: Transformer Engine compiled against the pinned torch)")

_FP8_FORMATS = {"e4m3": "e4m3", "hybrid": "hybrid"}
_FP8_RECIPES = {"delayed": "delayed", "tensorwise": "tensorwise", "blockwise": "blockwise"}


@dataclass(frozen=True)
class ModelInfo:
    """A built model: its shape (with the padded vocabulary) and what the build decided."""

    shape: ModelShape
    """The architecture; `shape.padded_vocab_size` is Megatron's vocabulary (a multiple of
    128·TP); rows [vocab_size, padded_vocab_size) are padding."""
    layer_spec: str
    """"local" or "transformer_engine" (TE fuses the pre-norms into linear_qkv / linear_fc1:
    `...linear_qkv.layer_norm_weight` instead of `...input_layernorm.weight`)."""
    params_dtype: str
    """"float32" or "bfloat16" ("float16" only in a conversion's `params_dtype` build)."""
    fp8: Optional[str]
    """None, "e4m3" or "hybrid"."""

    def to_dict(self) -> Dict[str, object]:
        """Flat JSON form (the shape's fields, then the build's), as written to dapo_mega_model.json."""
        return {**self.shape.to_dict(), "layer_spec": self.layer_spec, "params_dtype": self.params_dtype,
                "fp8": self.fp8}


@dataclass
class TransformerPlan:
    """Output of `plan_transformer_config`: everything decided, nothing imported."""

    config_kwargs: Dict[str, Any]
    """Keyword arguments of megatron.core.transformer.TransformerConfig (activation_func
    is added by build_model: it is a function, not config)."""
    layer_spec: str
    """LOCAL_SPEC or TE_SPEC."""
    params_dtype: str
    """"float32" or "bfloat16"."""
    notes: List[str]
    """Decisions a user should see in the log (e.g. why bf16 edge layers were dropped)."""


def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """Round the vocabulary up to a multiple of 128·TP (Megatron's make-vocab-divisible)."""
    multiple = VOCAB_PAD_MULTIPLE * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def probe_transformer_engine(import_module: Callable[[str], object] = importlib.import_module) -> Optional[str]:
    """None when `transformer_engine.pytorch` imports, else its error as "Type: message",
    logged as a warning on every rank (each rank's log says why it has no TE).

    TE fails to import in many ways: ImportError (not installed), OSError (a cuDNN / CUDA
    library missing), RuntimeError or an undefined symbol (built against another torch).
    `import_module` is the importer (a test passes one that fails)."""
    try:
        import_module("transformer_engine.pytorch")
    except Exception as exc:  # noqa: BLE001 - every failure is reported, with its type
        error = f"{type(exc).__name__}: {exc}"
        logger.warning(f"[model] transformer_engine.pytorch does not import: {error}", extra=log.EVERY_RANK)
        return error
    return None


@functools.lru_cache(maxsize=1)
def transformer_engine_import_error() -> Optional[str]:
    """None when Transformer Engine imports on this machine, NO_GPU without a CUDA GPU (TE is
    not tried there: the CPU learner takes the local spec), else TE's import error. Tried
    (and logged) once per process."""
    if not torch.cuda.is_available():
        return NO_GPU
    return probe_transformer_engine()


def transformer_engine_available() -> bool:
    """True when a GPU is present and transformer_engine.pytorch imports."""
    return transformer_engine_import_error() is None


def choose_layer_spec(transformer_impl: str, has_gpu: bool, te_error: Optional[str]) -> str:
    """The layer spec of `megatron.transformer_impl` on this machine; `te_error` is None when
    Transformer Engine imports, else why not (`transformer_engine_import_error`).

    auto: local on the CPU; on a GPU, TE, and a ConfigError quoting `te_error` when TE does not
    import (a fallback to the local spec would hide it behind a later, unrelated failure)."""
    if transformer_impl == "local":
        return LOCAL_SPEC
    if transformer_impl not in ("auto", "transformer_engine"):
        raise ConfigError(f"megatron.transformer_impl: unknown {transformer_impl!r}. Fix: use auto, local or "
                          "transformer_engine")
    if not has_gpu:
        if transformer_impl == "auto":
            return LOCAL_SPEC
        raise ConfigError("megatron.transformer_impl: transformer_engine needs a GPU, and this machine has none. "
                          "Fix: use megatron.transformer_impl=auto or local on this machine")
    if te_error is not None:
        raise ConfigError(f"megatron.transformer_impl: {transformer_impl} on a GPU takes the Transformer Engine "
                          f"layer spec, but transformer_engine.pytorch does not import: {te_error}. Fix: "
                          f"{TE_INSTALL_FIX}; or set megatron.transformer_impl=local megatron.sequence_parallel=false "
                          "to train without it (unfused kernels, no FP8)")
    return TE_SPEC


def plan_transformer_config(arch: ModelShape, mcfg: MegatronConfig, layout: ParallelLayout, has_gpu: bool,
                            te_error: Optional[str], routing_replay: bool = False) -> TransformerPlan:
    """Pure mapping config -> TransformerConfig kwargs + layer spec + dtype (no imports of TE).

    `te_error`: None when Transformer Engine imports, else why not (`choose_layer_spec`).
    `routing_replay` (`algo.routing_replay`): a mixture's routers get megatron-core's
    RouterReplay (`backends/megatron/routing.py` feeds it); ConfigError for a dense model.

    FP8 (TE only): fp8 = format ("e4m3" | "hybrid"), fp8_recipe = recipe, amax history and
    algorithm for delayed scaling, and `first_last_layers_bf16` with the start/end counts.
    megatron-core rejects bf16 edge layers under *delayed* scaling ("Delayed scaling does not
    support first / last layer in BF16"), so there they are dropped with a note.
    """
    spec = choose_layer_spec(mcfg.transformer_impl, has_gpu, te_error)
    if mcfg.params_dtype == "auto":
        params_dtype = "bfloat16" if has_gpu else "float32"
    else:
        params_dtype = {"float32": "float32", "bf16": "bfloat16", "fp16": "float16"}[mcfg.params_dtype]
    if params_dtype == "float16":
        raise ConfigError("megatron.params_dtype: fp16 needs loss scaling, which this learner does not do. "
                          "Fix: use bf16")
    if params_dtype == "bfloat16" and not has_gpu:
        raise ConfigError("megatron.params_dtype: bf16 on the CPU is not supported by the learner. Fix: use "
                          "float32 or auto")
    notes: List[str] = []
    kwargs: Dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        add_bias_linear=arch.mlp_bias,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == "bfloat16",
        fp16=False,
        use_cpu_initialization=not has_gpu,
        # The learner's loss is already divided by the global token count; see learner.py.
        calculate_per_token_loss=True,
        # Fused kernels need apex/TE; the local spec on CPU runs the unfused paths.
        bias_activation_fusion=spec == TE_SPEC,
        masked_softmax_fusion=spec == TE_SPEC,
        bias_dropout_fusion=spec == TE_SPEC,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        recompute_granularity=mcfg.recompute_granularity,
        recompute_method=mcfg.recompute_method if mcfg.recompute_granularity == "full" else None,
        recompute_num_layers=mcfg.recompute_num_layers if mcfg.recompute_granularity == "full" else None,
    )
    refuse_unbuildable(arch, layout, spec, routing_replay)
    if arch.is_moe:
        kwargs.update(moe_config_kwargs(arch, layout.ep, spec), moe_enable_routing_replay=routing_replay)
    if mcfg.fp8.enabled:
        if spec != TE_SPEC:
            raise ConfigError("megatron.fp8.enabled: FP8 needs the Transformer Engine layer spec (GPU + TE). "
                              "Fix: set megatron.fp8.enabled=false")
        if mcfg.fp8.format not in _FP8_FORMATS:
            raise ConfigError(f"megatron.fp8.format: unknown {mcfg.fp8.format!r}. Fix: use e4m3 or hybrid")
        if mcfg.fp8.recipe not in _FP8_RECIPES:
            raise ConfigError(f"megatron.fp8.recipe: unknown {mcfg.fp8.recipe!r}. Fix: use delayed, tensorwise or "
                              "blockwise")
        if params_dtype != "bfloat16":
            raise ConfigError("megatron.params_dtype: FP8 training keeps bf16 master copies in the GEMMs. "
                              "Fix: set megatron.params_dtype=bf16 (or auto on GPU)")
        kwargs.update(fp8=_FP8_FORMATS[mcfg.fp8.format], fp8_recipe=_FP8_RECIPES[mcfg.fp8.recipe], fp8_margin=0,
                      fp8_amax_history_len=mcfg.fp8.amax_history_len,
                      fp8_amax_compute_algo=mcfg.fp8.amax_compute_algo)
        start, end = mcfg.fp8.num_layers_at_start_in_bf16, mcfg.fp8.num_layers_at_end_in_bf16
        if start or end:
            if mcfg.fp8.recipe == "delayed":
                notes.append(f"fp8 delayed scaling: megatron-core cannot keep first/last layers in bf16; "
                             f"num_layers_at_start/end_in_bf16 = {start}/{end} ignored (use tensorwise to keep them)")
            else:
                per_stage = arch.num_layers // layout.pp
                if start > per_stage or end > per_stage:
                    raise ConfigError(f"megatron.fp8.num_layers_at_start_in_bf16: {start}/{end} bf16 edge layers "
                                      f"exceed the {per_stage} layers of a pipeline stage. Fix: lower them or the PP size")
                kwargs.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=start,
                              num_layers_at_end_in_bf16=end)
    return TransformerPlan(config_kwargs=kwargs, layer_spec=spec, params_dtype=params_dtype, notes=notes)


def refuse_unbuildable(arch: ModelShape, layout: ParallelLayout, spec: str, routing_replay: bool) -> None:
    """ConfigError for what megatron-core would refuse only once the model is built, on every rank."""
    if layout.sequence_parallel and spec != TE_SPEC:
        raise ConfigError("megatron.sequence_parallel: true, but the local layer spec's norms (torch's, megatron-core "
                          "WrappedTorchNorm, without NVIDIA apex) refuse sequence parallelism: the model would fail "
                          "as it is built. Fix: megatron.sequence_parallel=false on a CPU or with "
                          "megatron.transformer_impl=local (a mixture of experts then needs TP 1), or Transformer "
                          "Engine on GPUs")
    if routing_replay and not arch.is_moe:
        raise ConfigError(f"algo.routing_replay: true, but {arch.model_type} is a dense model: there is no routing "
                          "to replay. Fix: set algo.routing_replay=false")


def moe_config_kwargs(arch: ModelShape, ep: int, spec: str) -> Dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE (module docstring, Mixture of experts)."""
    from dapo_mega.backends.megatron.layout import EXPERT_TP

    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_layer_freq=[int(arch.is_sparse_layer(i)) for i in range(arch.num_layers)],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=arch.router_aux_loss_coef,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=spec == TE_SPEC,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=EXPERT_TP,
    )


def _moe_router_without_te() -> None:
    """megatron-core 0.16.1's `moe_utils` binds `te_general_gemm` only when Transformer Engine
    imports, yet its router's gating tests it against None: without TE (the CPU learner, the
    local spec) the first routing is a NameError. Bound to None there, as that test intends."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _block_spec(spec: str, config, vp_stage: Optional[int]):
    """The decoder's layer specs of a mixture of experts: dense and expert layers by
    `config.moe_layer_freq` (megatron-core's own block spec), the local spec's core attention
    through torch's SDPA as for dense models."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from dapo_mega.backends.megatron.attention import SdpaDotProductAttention

    _moe_router_without_te()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=spec == TE_SPEC, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    if spec != TE_SPEC:
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    return block


def _layer_spec(spec: str, qk_layernorm: bool = False):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from dapo_mega.backends.megatron.attention import SdpaDotProductAttention

    if spec == TE_SPEC:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    local = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    local.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    return local


@contextlib.contextmanager
def _block_norm_of(layer_spec, spec_name: str) -> Iterator[None]:
    """Build the decoder's final norm from the layer spec's own norm.

    megatron-core's TransformerBlock, handed a layer spec, takes its final norm from the
    module global `transformer_block.LayerNormImpl`: TE's TENorm whenever transformer_engine
    imports, whatever the spec. In a GPU cluster's learner environment (TE installed) a CPU
    build (conversion, verify, the CPU learner) would get a TE norm in an otherwise local
    model: CUDA-only kernels on the CPU, and an `_extra_state` no other local build has. With
    the local spec the global is the spec's `input_layernorm` while the model is built.
    """
    if spec_name == TE_SPEC:
        yield
        return
    from megatron.core.transformer import transformer_block

    saved = transformer_block.LayerNormImpl
    transformer_block.LayerNormImpl = layer_spec.submodules.input_layernorm
    try:
        yield
    finally:
        transformer_block.LayerNormImpl = saved


def _require_spec_norm(model: torch.nn.Module, spec_name: str) -> None:
    """A local-spec model's final norm is the kind its layers use (no Transformer Engine module)."""
    norm, layers = getattr(model.decoder, "final_layernorm", None), model.decoder.layers
    if spec_name == TE_SPEC or norm is None or not len(layers):
        return
    expected = type(layers[0].input_layernorm)
    if type(norm) is not expected:
        raise ConfigError(f"the local layer spec's decoder got final norm {type(norm).__module__}."
                          f"{type(norm).__name__}, not {expected.__name__} as its layers: this megatron-core "
                          "chooses it otherwise (transformer_block.LayerNormImpl, see "
                          "backends/megatron/model.py _block_norm_of)")


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> List[str]:
    """Every floating-point parameter of `model` in `dtype`; the names of those it cast.

    megatron-core's local layer spec builds its norms as torch.nn.RMSNorm without a dtype
    (WrappedTorchNorm), so a bf16 build holds fp32 norm weights beside bf16 matrices
    (megatron's own trainer casts the whole model through Float16Module). The distributed
    optimizer lists a param group's fp32 params before its bf16 ones, while its index of
    each model param's place keeps the buffer's order: with both kinds in the no-decay group
    a checkpoint save hands one param another's optimizer state and fails, and a load would
    put it back in the wrong place. Seen on the first GPU run (bench/gpu_node.py, check e).
    """
    cast = []
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            cast.append(name)
    return cast


def build_model(hf_config: HfConfigSource, mcfg: MegatronConfig, layout: ParallelLayout,
                device: Optional[torch.device] = None, initialize: bool = True,
                params_dtype: Optional[torch.dtype] = None,
                routing_replay: bool = False) -> Tuple[List[torch.nn.Module], ModelInfo]:
    """Build this rank's GPTModel chunks (one per virtual pipeline stage) and the ModelInfo.

    `initialize=False` when weights are loaded next (conversion, every training start): the
    parameters are allocated and left as they are, with neither megatron's initialisation
    (on a CPU it draws each TP-split weight whole, then shards it) nor `initialize_weights`
    (one full tensor per parameter): at 32B those were two random copies of the model per
    rank, minutes of drawing and most of a conversion's host memory.

    `params_dtype` overrides `mcfg.params_dtype` for builds that only hold weights and never
    train (conversion): any of fp32 / bf16 / fp16, on the CPU too, so a bf16 checkpoint is
    held in bf16 (half the bytes of the fp32 the CPU learner needs).

    `layout.initialize()` must have run. The chunks are bare GPTModels (no DDP wrapper), so
    their parameter names are the megatron-core ones (`embedding.word_embeddings.weight`,
    `decoder.layers.{i}.self_attention.linear_qkv.weight`, ..., with *local* layer indices
    per chunk; `layer.layer_number` is the 1-based global index).
    """
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    arch = ModelShape.from_hf_config(hf_config)
    has_gpu = torch.cuda.is_available()
    plan = plan_transformer_config(arch, mcfg, layout, has_gpu, transformer_engine_import_error(), routing_replay)
    kwargs = dict(plan.config_kwargs)
    if params_dtype is not None:
        kwargs.update(params_dtype=_dtype_str(params_dtype), pipeline_dtype=_dtype_str(params_dtype),
                      bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16)
    kwargs["params_dtype"] = getattr(torch, kwargs["params_dtype"])
    kwargs["pipeline_dtype"] = getattr(torch, kwargs["pipeline_dtype"])
    kwargs["perform_initialization"] = initialize
    config = TransformerConfig(activation_func=F.silu, **kwargs)
    padded_vocab = pad_vocab_size(arch.vocab_size, layout.tp)

    # Seeds the megatron RNG tracker (dropout forks; CPU-substituted on CPU machines).
    model_parallel_cuda_manual_seed(mcfg.seed)
    layer_spec = _layer_spec(plan.layer_spec, arch.qk_layernorm)
    num_chunks = layout.vpp or 1
    chunks: List[torch.nn.Module] = []
    for vp_stage in range(num_chunks):
        vp = vp_stage if layout.vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        chunk_spec = _block_spec(plan.layer_spec, config, vp) if arch.is_moe else layer_spec
        with _block_norm_of(layer_spec, plan.layer_spec):
            model = GPTModel(
                config=config, transformer_layer_spec=chunk_spec, vocab_size=padded_vocab,
                max_sequence_length=arch.max_position_embeddings, pre_process=pre, post_process=post,
                parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                position_embedding_type="rope", rotary_base=arch.rope_theta, vp_stage=vp)
        _require_spec_norm(model, plan.layer_spec)
        cast_parameters(model, kwargs["params_dtype"])
        apply_rope_scaling(model, arch)
        if has_gpu:
            model = model.to(device or torch.device("cuda", torch.cuda.current_device()))
        elif device is not None:
            model = model.to(device)
        chunks.append(model)
    if initialize:
        initialize_weights(chunks, arch, layout.tp, padded_vocab, seed=mcfg.seed)
    info = ModelInfo(shape=arch.with_padded_vocab(padded_vocab), layer_spec=plan.layer_spec,
                     params_dtype=_dtype_str(kwargs["params_dtype"]), fp8=kwargs.get("fp8"))
    return chunks, info


def apply_rope_scaling(model: torch.nn.Module, arch: ModelShape) -> None:
    """Llama-3 RoPE scaling of a freshly built GPTModel (before its first forward: the
    rotary embedding caches its output per sequence length).

    megatron-core's `RotaryEmbedding._apply_scaling` is transformers' `_compute_llama3_parameters`
    with the factor, low/high frequency factors and original context as arguments; GPTModel's
    own `rope_scaling=True` passes only the factor.
    """
    if arch.rope_scaling_factor is None:
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq, factor=arch.rope_scaling_factor, low_freq_factor=arch.rope_scaling_low_freq_factor,
        high_freq_factor=arch.rope_scaling_high_freq_factor,
        original_max_position_embeddings=arch.rope_scaling_original_max_position_embeddings)


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (whatever has `.decoder`)."""
    module = chunk
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return module


_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def global_param_names(chunk: torch.nn.Module) -> Dict[str, str]:
    """Local parameter name -> name with the *global* layer index (same on every PP rank)."""
    names: Dict[str, str] = {}
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    for name, _ in chunk.named_parameters():
        match = _LAYER_PREFIX.match(name)
        if match:
            global_index = local_to_global[int(match.group(1))]
            names[name] = f"decoder.layers.{global_index}." + name[match.end():]
        else:
            names[name] = name
    return names


@torch.no_grad()
def initialize_weights(chunks: List[torch.nn.Module], arch: ModelShape, tp: int, padded_vocab: int, seed: int) -> None:
    """Layout-independent init: full tensor from (seed, global name), then this rank's shard.

    Norm weights are 1; every other tensor (weights and QKV biases) is N(0, INIT_STD²).
    Vocabulary-row tensors are drawn at the HF vocab size and zero-padded to `padded_vocab`;
    a tied output layer on the last stage gets the embedding's tensor. The shard of a
    tensor-parallel parameter follows megatron's `_initialize_affine_weight_cpu`: split the
    partition dimension into pieces of (local size / stride) and take pieces rank::tp
    (stride 2 for SwiGLU's fc1, which interleaves [gate; up] per rank).
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    for chunk in chunks:
        names = global_param_names(chunk)
        for local_name, param in chunk.named_parameters():
            name = names[local_name]
            if name == "output_layer.weight" and arch.tie_word_embeddings:
                name = "embedding.word_embeddings.weight"
            if name.endswith("layernorm.weight") or name.endswith("layer_norm_weight"):
                param.fill_(1.0)
                continue
            is_tp = getattr(param, "tensor_model_parallel", False) and tp > 1
            dim = getattr(param, "partition_dim", 0) if is_tp else 0
            stride = getattr(param, "partition_stride", 1) if is_tp else 1
            full_shape = list(param.shape)
            if is_tp:
                full_shape[dim] *= tp
            generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            if name in _VOCAB_PARAMS:
                full = torch.zeros(full_shape, dtype=torch.float32)
                full[: arch.vocab_size] = torch.randn([arch.vocab_size] + full_shape[1:], generator=generator) * INIT_STD
            else:
                full = torch.randn(full_shape, generator=generator) * INIT_STD
            if is_tp:
                piece = param.shape[dim] // stride
                pieces = torch.split(full, piece, dim=dim)[tp_rank::tp]
                full = torch.cat(pieces, dim=dim)
            param.copy_(full.to(param.dtype))
