"""Chunked vocab-parallel log-probs and entropy against torch's full-vocabulary softmax and
megatron's vocab_parallel_cross_entropy: values and gradients, at TP 1 and TP 2, with the
padded vocabulary rows masked and chunks that do not divide the tokens."""

from __future__ import annotations

import torch
from dist_helpers import run_distributed

B, S, VOCAB, PADDED = 3, 7, 45, 48   # 21 positions, chunks of 4 (the last one short)
TEMPERATURE = 0.7


def _inputs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, S, PADDED, generator=g) * 3
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    grad_out = torch.randn(B, S, generator=g)
    return logits, labels, grad_out


def _reference(logits, labels, grad_out):
    """torch on the whole (unpadded) vocabulary: log p, entropy, d(sum grad_out * log p)/d logits."""
    z = logits.clone().requires_grad_(True)
    logp_all = torch.log_softmax(z[..., :VOCAB] / TEMPERATURE, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp * grad_out).sum().backward()
    return logp.detach(), entropy.detach(), z.grad


def _slice_result(rank, world, group):
    from dapo_mega.backends.megatron.logprobs import chunked_log_probs_and_entropy

    logits, labels, grad_out = _inputs()
    local = PADDED // world
    z = logits[..., rank * local:(rank + 1) * local].clone().requires_grad_(True)
    logp, entropy = chunked_log_probs_and_entropy(z, labels, TEMPERATURE, VOCAB, group, rank, world, chunk_tokens=4)
    (logp * grad_out).sum().backward()
    return logp.detach(), entropy, z.grad


def test_tp1_equals_torch_and_megatron():
    from unittest import mock

    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, labels, grad_out = _inputs()
    logp, entropy, grad = _slice_result(0, 1, None)
    ref_logp, ref_entropy, ref_grad = _reference(logits, labels, grad_out)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert grad[..., VOCAB:].abs().max() == 0                      # padding rows get no gradient
    # megatron's kernel (what the learner used before) on the same masked, scaled logits
    z = logits.clone().requires_grad_(True)
    scaled = (z / TEMPERATURE).masked_fill(torch.arange(PADDED) >= VOCAB, -1.0e9)
    ce = "megatron.core.tensor_parallel.cross_entropy"
    with mock.patch(f"{ce}.get_tensor_model_parallel_rank", return_value=0), \
            mock.patch(f"{ce}.get_tensor_model_parallel_world_size", return_value=1), \
            mock.patch(f"{ce}.get_tensor_model_parallel_group", return_value=None), \
            mock.patch("torch.distributed.all_reduce", lambda *a, **k: None):  # one rank: a reduce is the identity
        mlogp = -vocab_parallel_cross_entropy(scaled, labels)
    (mlogp * grad_out).sum().backward()
    torch.testing.assert_close(logp, mlogp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, z.grad, rtol=1e-5, atol=1e-6)


def test_bf16_logits_get_bf16_gradients_close_to_fp32():
    from dapo_mega.backends.megatron.logprobs import chunked_log_probs_and_entropy

    logits, labels, grad_out = _inputs()
    z = logits.to(torch.bfloat16).requires_grad_(True)
    logp, _ = chunked_log_probs_and_entropy(z, labels, TEMPERATURE, VOCAB, chunk_tokens=5, with_entropy=False)
    (logp * grad_out).sum().backward()
    assert logp.dtype == torch.float32 and z.grad.dtype == torch.bfloat16
    ref_logp, _, ref_grad = _reference(logits.to(torch.bfloat16).float(), labels, grad_out)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(z.grad.float(), ref_grad, rtol=2e-2, atol=2e-3)


def _tp2(rank, world_size):
    torch.distributed.init_process_group("gloo")
    try:
        logp, entropy, grad = _slice_result(rank, world_size, torch.distributed.group.WORLD)
        return {"logp": logp, "entropy": entropy, "grad": grad}
    finally:
        torch.distributed.destroy_process_group()


def test_tp2_slices_equal_the_full_vocabulary():
    results = run_distributed(_tp2, world_size=2, timeout_s=120)
    logits, labels, grad_out = _inputs()
    ref_logp, ref_entropy, ref_grad = _reference(logits, labels, grad_out)
    for r in results:  # every rank holds the full [B, S] values
        torch.testing.assert_close(r["logp"], ref_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["entropy"], ref_entropy, rtol=1e-5, atol=1e-5)
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
