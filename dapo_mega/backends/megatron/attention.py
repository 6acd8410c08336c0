"""Core attention of the local layer spec through torch's fused `scaled_dot_product_attention`.

megatron-core's `DotProductAttention` (the local spec's) computes attention in four
unfused steps: QKᵀ into a buffer, a masked softmax, dropout, a batched matmul with V, each
materialising a [b·heads, s, s] tensor forward and backward. On the CPU learner (tests, the
embedded default, the benchmarks) that was most of a layer's non-matmul time. This subclass
computes the same function with one `torch.nn.functional.scaled_dot_product_attention` call
(torch's fused CPU and CUDA kernels), and takes Megatron's tensors and mask as they come:

    query [sq, b, heads, d], key / value [sk, b, groups, d]  ->  context [sq, b, heads·d]
    attention_mask None with a causal mask type  -> is_causal
    attention_mask bool [b or 1, 1, sq, sk], True = masked (Megatron's convention, the
      packed layout's block-diagonal mask)              -> attn_mask = ~attention_mask

Anything it does not compute the same way falls back to the parent's forward: attention
dropout while training (Megatron forks its RNG tracker for it), a softmax offset, sliding
windows, query-key layer scaling, attention bias, packed THD parameters (those are Transformer
Engine's). bf16 inputs under `attention_softmax_in_fp32` (megatron's default) stay here: torch's
fused kernels keep the softmax's running max and sum in fp32 (tested against megatron's fp32
softmax); megatron's unfused path ran a 16k-token packed micro-batch out of an H200's memory.
GPU runs use Transformer Engine's spec where it imports; this class serves the local spec.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention


class SdpaDotProductAttention(DotProductAttention):
    """`DotProductAttention` with the fused SDPA kernel where it computes the same thing."""

    def _sdpa_computes_the_same(self, query: torch.Tensor, attention_bias, packed_seq_params) -> bool:
        c = self.config
        dropout = self.attention_dropout.p if self.training else 0.0
        return (attention_bias is None and packed_seq_params is None and dropout == 0.0
                and self.softmax_offset is None and not c.apply_query_key_layer_scaling
                and not is_layer_window_attention(c.window_size, c.window_attn_skip_freq, self.layer_number))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if not self._sdpa_computes_the_same(query, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_mask is None and mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"attention mask type {mask_type} needs an attention_mask")
        is_causal = attention_mask is None and mask_type == AttnMaskType.causal and query.size(0) > 1
        attn_mask = None if attention_mask is None else ~attention_mask
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                                   scale=self.softmax_scale)
        sq, b = query.size(0), query.size(1)
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
