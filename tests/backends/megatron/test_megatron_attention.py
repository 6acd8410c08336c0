"""The local spec's core attention runs torch's fused SDPA (one call per forward, counted) and
equals two references it does not share code with: megatron-core's own `DotProductAttention`
(unfused QKᵀ, masked softmax, matmul with V) and a few lines of attention written here,
forward and backward, with grouped-query heads, for the causal (padded) layout and for the
packed layout's block-diagonal mask; and it hands back to megatron's path for what it does
not compute the same way (attention dropout while training)."""

from __future__ import annotations

import torch
from dist_helpers import run_distributed

HEADS, GROUPS, HEAD_DIM, SEQ, BATCH = 4, 2, 8, 12, 3


def _block_diagonal_mask() -> torch.Tensor:
    """Rows of 2-3 packed segments: True = masked, as batch.collate_packed_micro_batch builds it."""
    segments = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12, [0] * 3 + [1] * 9])
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return (~((segments.unsqueeze(2) == segments.unsqueeze(1)) & causal)).unsqueeze(1)


def _by_hand(q, k, v, mask):
    """softmax(q kᵀ / sqrt(d), masked) v over [s, b, heads, d] inputs, kv heads shared by groups."""
    repeat = q.size(2) // k.size(2)
    k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.size(-1) ** 0.5
    masked = torch.ones(q.size(0), k.size(0), dtype=torch.bool).triu(1) if mask is None else mask
    probs = scores.masked_fill(masked, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(q.size(0), q.size(1), -1)


def _compare(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from dapo_mega.backends.megatron.attention import SdpaDotProductAttention
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.config import MegatronConfig, ModelConfig
    from dapo_mega.models.tiny import tiny_hf_config

    ParallelLayout.from_config(MegatronConfig(), world, tiny_hf_config(ModelConfig())).initialize()
    model_parallel_cuda_manual_seed(1)  # megatron's reference forks its RNG tracker for dropout
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0)
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    reference, fused = DotProductAttention(**kwargs), SdpaDotProductAttention(**kwargs)
    out, sdpa_calls, sdpa = {}, [], torch.nn.functional.scaled_dot_product_attention

    def counted_sdpa(*args, **kwargs):
        sdpa_calls.append(1)
        return sdpa(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counted_sdpa
    for name, mask in (("causal", None), ("packed", _block_diagonal_mask())):
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen)
        k, v = (torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=gen) for _ in range(2))
        grad_out = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=gen)
        for module_name, module in (("reference", reference), ("fused", fused), ("by_hand", None)):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            sdpa_calls.clear()
            context = _by_hand(*inputs, mask) if module is None else module(*inputs, mask)
            context.backward(grad_out)
            out[(name, module_name)] = [context.detach()] + [t.grad for t in inputs]
            out[(name, module_name, "sdpa_calls")] = len(sdpa_calls)
    dropout = SdpaDotProductAttention(**{**kwargs, "config": TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, attention_dropout=0.1)})
    sample = torch.zeros(SEQ, BATCH, HEADS, HEAD_DIM)
    out["dropout_train"] = dropout.train()._sdpa_computes_the_same(sample, None, None)
    out["dropout_eval"] = dropout.eval()._sdpa_computes_the_same(sample, None, None)
    return out


def test_sdpa_core_attention_equals_megatrons_forward_and_backward():
    out = run_distributed(_compare, 1, timeout_s=180)[0]
    for layout in ("causal", "packed"):
        assert out[(layout, "fused", "sdpa_calls")] == 1 and out[(layout, "reference", "sdpa_calls")] == 0
        fused = out[(layout, "fused")]
        for reference in ("reference", "by_hand"):
            for what, a, b in zip(("context", "dq", "dk", "dv"), out[(layout, reference)], fused):
                assert a.shape == b.shape, (layout, reference, what)
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{layout} {reference} {what}")
    # the packed rows really are different from causal ones (the mask matters)
    assert not torch.allclose(out[("causal", "fused")][0], out[("packed", "fused")][0])
    assert out["dropout_train"] is False and out["dropout_eval"] is True


def test_the_local_layer_spec_uses_it():
    from dapo_mega.backends.megatron.attention import SdpaDotProductAttention
    from dapo_mega.backends.megatron.model import LOCAL_SPEC, _layer_spec

    assert _layer_spec(LOCAL_SPEC).submodules.self_attention.submodules.core_attention is SdpaDotProductAttention


def _bf16_errors(rank, world):
    """Each path's largest error in bf16 against the fp32 computation by hand (causal, packed)."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from dapo_mega.backends.megatron.attention import SdpaDotProductAttention
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.config import MegatronConfig, ModelConfig
    from dapo_mega.models.tiny import tiny_hf_config

    ParallelLayout.from_config(MegatronConfig(), world, tiny_hf_config(ModelConfig())).initialize()
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0, bf16=True,
                               params_dtype=torch.bfloat16)
    assert config.attention_softmax_in_fp32  # megatron's default: what sent the GPU run down the unfused path
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    reference, fused = DotProductAttention(**kwargs), SdpaDotProductAttention(**kwargs)
    sdpa_calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def counted_sdpa(*args, **kw):
        sdpa_calls.append(1)
        return sdpa(*args, **kw)

    torch.nn.functional.scaled_dot_product_attention = counted_sdpa
    errors = {}
    for name, mask in (("causal", None), ("packed", _block_diagonal_mask())):
        gen = torch.Generator().manual_seed(11)
        q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen) * 2
        k, v = (torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=gen) * 2 for _ in range(2))
        exact = _by_hand(q, k, v, mask)
        low = [t.bfloat16() for t in (q, k, v)]
        for module_name, module in (("megatron_fp32_softmax", reference), ("fused", fused)):
            sdpa_calls.clear()
            got = module(*low, mask).float()
            errors[(name, module_name)] = float((got - exact).abs().max())
            errors[(name, module_name, "sdpa_calls")] = len(sdpa_calls)
    return errors


def test_in_bf16_the_fused_kernel_runs_and_is_as_close_to_fp32_as_megatrons_fp32_softmax():
    """bf16 with megatron's attention_softmax_in_fp32 (its default): torch's fused kernels keep
    the softmax's running max and sum in fp32, so the fused call computes what the flag asks for.
    The first GPU run fell back to megatron's unfused path there and ran out of memory on the
    [b·heads, s, s] scores of a 16k-token packed micro-batch (bench/gpu_node.py, learner_bf16)."""
    errors = run_distributed(_bf16_errors, 1, timeout_s=180)[0]
    for layout in ("causal", "packed"):
        assert errors[(layout, "fused", "sdpa_calls")] == 1, errors
        reference = errors[(layout, "megatron_fp32_softmax")]
        assert errors[(layout, "fused")] <= 2 * reference + 1e-2, errors
