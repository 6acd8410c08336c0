"""DAPO policy loss (Eq. 8/10/12) against hand-worked values.

Conventions in the comments: r = exp(log_probs - old_log_probs), loss per token
ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)) (then min(ℓ, −A·c) for A<0 with dual clip),
D = the aggregation denominator. For an unclipped token ∂L/∂log_prob = −A·r/D.
"""

import math

import pytest
import torch

from dapo_mega.algo import compute_policy_loss, compute_tis_weights

F64 = torch.float64


def one_token(ratio: float, adv: float, **kw):
    """Loss and ∂loss/∂log_prob of a single response token with ratio r (old log-prob 0)."""
    lp = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=F64)
    loss, metrics = compute_policy_loss(lp, old, torch.tensor([adv], dtype=F64), torch.ones(1, 1, dtype=torch.bool), **kw)
    loss.backward()
    return loss.item(), lp.grad.item(), {k: float(v) for k, v in metrics.items()}


def test_single_unclipped_token():
    # r = 1.1 in [0.8, 1.28], A = 1: ℓ = -1.1, D = 1, grad = -A·r = -1.1
    loss, grad, m = one_token(1.1, 1.0)
    assert loss == pytest.approx(-1.1)
    assert grad == pytest.approx(-1.1)
    assert m["loss/clip_frac_high"] == 0 and m["loss/clip_frac_low"] == 0
    assert m["loss/ratio_mean"] == pytest.approx(1.1)
    # k3: r - 1 - log r = 0.1 - 0.0953101798 = 0.0046898202
    assert m["loss/approx_kl"] == pytest.approx(0.0046898202)
    assert m["loss/num_tokens"] == 1


def test_clip_high_for_positive_advantage():
    # r = 1.5 > 1.28, A = 1: max(-1.5, -1.28) = -1.28, constant in θ → grad 0
    loss, grad, m = one_token(1.5, 1.0)
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert m["loss/clip_frac_high"] == 1.0 and m["loss/clip_frac_low"] == 0.0


def test_clip_low_for_negative_advantage():
    # r = 0.5 < 0.8, A = -1: max(0.5, 0.8) = 0.8 → grad 0
    loss, grad, m = one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert m["loss/clip_frac_low"] == 1.0 and m["loss/clip_frac_high"] == 0.0


def test_decoupled_clip_is_one_sided():
    # A = +1, r = 0.5: max(-0.5, -0.8) = -0.5 unclipped, grad = -A·r = -0.5
    loss, grad, _ = one_token(0.5, 1.0)
    assert (loss, grad) == (pytest.approx(-0.5), pytest.approx(-0.5))
    # A = -1, r = 1.5 (no dual clip): max(1.5, 1.28) = 1.5, grad = -A·r = +1.5
    loss, grad, m = one_token(1.5, -1.0)
    assert (loss, grad) == (pytest.approx(1.5), pytest.approx(1.5))
    assert m["loss/clip_frac_high"] == 0.0
    # ε_high = 0.28 vs symmetric 0.2: r = 1.25 with A = +1 is clipped only by the symmetric clip
    _, grad_high, _ = one_token(1.25, 1.0, clip_ratio_high=0.28)
    _, grad_sym, _ = one_token(1.25, 1.0, clip_ratio_high=0.2)
    assert grad_high == pytest.approx(-1.25) and grad_sym == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ratios_exactly_at_the_bounds_are_not_clipped(dtype):
    eps_low, eps_high = 0.2, 0.28
    lp = torch.log(torch.tensor([[1.0 + eps_high, 1.0 - eps_low]], dtype=dtype)).requires_grad_(True)
    old = torch.zeros(1, 2, dtype=dtype)
    ratio = torch.exp(lp.detach() - old)
    # precondition: the ratios are exactly the bounds in this dtype
    assert ratio[0, 0] == torch.tensor(1.0 + eps_high, dtype=dtype)
    assert ratio[0, 1] == torch.tensor(1.0 - eps_low, dtype=dtype)
    # per-token advantages: +1 on the upper bound, -1 on the lower bound
    adv = torch.tensor([[1.0, -1.0]], dtype=dtype)
    loss, m = compute_policy_loss(lp, old, adv, torch.ones(1, 2), eps_low, eps_high)
    loss.backward()
    # ℓ = [-1.28, +0.8], D = 2 → loss = (-1.28 + 0.8)/2 = -0.24
    assert loss.item() == pytest.approx(-0.24, rel=1e-6)
    # at the bound the gradient still flows: [-A·r/D] = [-1.28/2, +0.8/2] = [-0.64, 0.4]
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.64, 0.4]], dtype=dtype))
    assert float(m["loss/clip_frac_high"]) == 0.0 and float(m["loss/clip_frac_low"]) == 0.0


def test_dual_clip_for_negative_advantage():
    # A = -2, r = 12: unclipped ℓ = 24, clip ℓ = 2·1.28 = 2.56, max = 24;
    # dual bound −A·c = 2·10 = 20 → min(24, 20) = 20, constant → grad 0
    loss, grad, m = one_token(12.0, -2.0, clip_ratio_c=10.0)
    assert loss == pytest.approx(20.0) and grad == 0.0
    assert m["loss/dual_clip_frac"] == 1.0
    # without dual clip: ℓ = 24, grad = -A·r = 24
    loss, grad, m = one_token(12.0, -2.0, clip_ratio_c=None)
    assert loss == pytest.approx(24.0) and grad == pytest.approx(24.0)
    assert m["loss/dual_clip_frac"] == 0.0
    # below c the dual clip does nothing: r = 3, A = -2 → ℓ = 6, grad = 6
    loss, grad, m = one_token(3.0, -2.0, clip_ratio_c=10.0)
    assert loss == pytest.approx(6.0) and grad == pytest.approx(6.0)
    # dual clip never touches positive advantages: r = 12, A = +1 → clip high → -1.28
    loss, grad, _ = one_token(12.0, 1.0, clip_ratio_c=10.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    with pytest.raises(ValueError):
        one_token(1.0, 1.0, clip_ratio_c=1.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_empty_mask_gives_zero_without_nan(mode):
    lp = torch.full((2, 3), float("nan"), dtype=F64, requires_grad=True)
    old = torch.full((2, 3), -float("inf"), dtype=F64)
    loss, m = compute_policy_loss(lp, old, torch.tensor([1.0, -1.0]), torch.zeros(2, 3), loss_agg_mode=mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros(2, 3, dtype=F64))
    assert all(math.isfinite(float(v)) for v in m.values())
    assert float(m["loss/num_tokens"]) == 0.0
    # a global denominator of 0 (the whole batch masked, e.g. by overlong filtering) is fine
    loss0, _ = compute_policy_loss(lp.detach(), old, torch.tensor([1.0, -1.0]), torch.zeros(2, 3),
                                   loss_agg_mode=mode, global_num_tokens=0, global_num_seqs=0)
    assert loss0.item() == 0.0


def test_padding_garbage_is_ignored():
    # one real token (r = 1.1, A = 1) followed by padding holding NaN / inf log-probs
    lp = torch.tensor([[math.log(1.1), float("nan"), float("inf")]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, -float("inf")]], dtype=F64)
    mask = torch.tensor([[1, 0, 0]])
    loss, m = compute_policy_loss(lp, old, torch.tensor([1.0], dtype=F64), mask)
    loss.backward()
    assert loss.item() == pytest.approx(-1.1)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.1, 0.0, 0.0]], dtype=F64))
    assert float(m["loss/ratio_mean"]) == pytest.approx(1.1)


def mixed_lengths(mode):
    # response 0: 4 tokens, A = +1; response 1: 1 token (then 3 padding), A = -1; all r = 1
    lp = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    loss, _ = compute_policy_loss(lp, torch.zeros(2, 4, dtype=F64), torch.tensor([1.0, -1.0], dtype=F64), mask,
                                  loss_agg_mode=mode)
    loss.backward()
    return loss.item(), lp.grad


def test_token_mean_weights_long_answers_more():
    # ℓ = -1 on each of the 4 long tokens, +1 on the short one
    # token-mean:          (-4 + 1)/5 = -0.6 ; long token grad -1/5 = -0.2, short +1/5 = 0.2
    # seq-mean-token-mean: (-4/4 + 1/1)/2 = 0 ; long token grad -1/(4·2) = -0.125, short +1/2 = 0.5
    # seq-mean-token-sum:  (-4 + 1)/2 = -1.5 ; long token grad -1/2, short +1/2
    loss_tok, g_tok = mixed_lengths("token-mean")
    loss_seq, g_seq = mixed_lengths("seq-mean-token-mean")
    loss_sum, g_sum = mixed_lengths("seq-mean-token-sum")
    assert loss_tok == pytest.approx(-0.6) and loss_seq == pytest.approx(0.0) and loss_sum == pytest.approx(-1.5)
    torch.testing.assert_close(g_tok, torch.tensor([[-0.2] * 4, [0.2, 0, 0, 0]], dtype=F64))
    torch.testing.assert_close(g_seq, torch.tensor([[-0.125] * 4, [0.5, 0, 0, 0]], dtype=F64))
    torch.testing.assert_close(g_sum, torch.tensor([[-0.5] * 4, [0.5, 0, 0, 0]], dtype=F64))
    # the long answer's total gradient weight: token-mean 4/5 = 0.8 > seq-mean-token-mean 4/8 = 0.5
    assert g_tok[0].abs().sum() == pytest.approx(0.8) and g_seq[0].abs().sum() == pytest.approx(0.5)
    assert g_tok[0].abs().sum() > g_seq[0].abs().sum()


def random_batch(seed=0, b=6, t=7):
    gen = torch.Generator().manual_seed(seed)
    lp = (torch.randn(b, t, generator=gen, dtype=F64) * 0.3 - 1.0)
    old = lp + torch.randn(b, t, generator=gen, dtype=F64) * 0.4  # ratios spread over clip bounds
    adv = torch.randn(b, generator=gen, dtype=F64)
    lengths = torch.tensor([7, 1, 4, 0, 6, 3])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return lp, old, adv, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_sum_equals_whole_batch(mode):
    lp, old, adv, mask = random_batch()
    global_tokens = mask.sum()  # 21
    global_seqs = (mask.sum(-1) > 0).sum()  # 5 (row 3 is empty)
    kw = dict(clip_ratio_c=3.0, loss_agg_mode=mode, global_num_tokens=global_tokens, global_num_seqs=global_seqs)
    whole_lp = lp.clone().requires_grad_(True)
    whole, whole_metrics = compute_policy_loss(whole_lp, old, adv, mask, **kw)
    whole.backward()
    # the clip bounds are really exercised by this batch
    assert float(whole_metrics["loss/clip_frac_high"]) + float(whole_metrics["loss/clip_frac_low"]) > 0

    split_lp = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    parts = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part_loss, part_metrics = compute_policy_loss(split_lp[rows], old[rows], adv[rows], mask[rows], **kw)
        total = total + part_loss
        parts.append(part_metrics)
    total.backward()
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_lp.grad, whole_lp.grad, rtol=1e-12, atol=1e-12)
    # each metric is a token mean over its part: the token-weighted mean of the parts (what
    # the learner all-reduces as value·n and n) is the whole batch's value
    n = [float(p["loss/num_tokens"]) for p in parts]
    assert sum(n) == float(whole_metrics["loss/num_tokens"])
    for key, value in whole_metrics.items():
        if key != "loss/num_tokens":
            merged = sum(float(p[key]) * k for p, k in zip(parts, n)) / sum(n)
            assert merged == pytest.approx(float(value), abs=1e-12), key


def test_local_denominator_default_and_bad_global():
    lp, old, adv, mask = random_batch()
    loss_default, _ = compute_policy_loss(lp, old, adv, mask)
    loss_global, _ = compute_policy_loss(lp, old, adv, mask, global_num_tokens=int(mask.sum()))
    torch.testing.assert_close(loss_default, loss_global)
    # doubling the global denominator halves the loss (the micro-batch is half the batch)
    loss_half, _ = compute_policy_loss(lp, old, adv, mask, global_num_tokens=2 * int(mask.sum()))
    torch.testing.assert_close(loss_half, loss_default / 2)
    with pytest.raises(ValueError, match="whole batch"):
        compute_policy_loss(lp, old, adv, mask, global_num_tokens=0)
    with pytest.raises(ValueError, match="whole batch"):
        compute_policy_loss(lp, old, adv, mask, global_num_tokens=int(mask.sum()) - 1)
    # a tensor denominator works the same (not checked: no host sync on GPU)
    loss_t, _ = compute_policy_loss(lp, old, adv, mask, global_num_tokens=torch.tensor(2.0 * int(mask.sum())))
    torch.testing.assert_close(loss_t, loss_default / 2)
    with pytest.raises(ValueError):
        compute_policy_loss(lp, old, adv, mask, loss_agg_mode="sum")


def test_gradient_clipped_token_zero_unclipped_token_formula():
    # 3 tokens of one response, A = 0.5, D = global 10 tokens:
    # r = [1.0, 2.0 (clipped high), 0.5 (A>0: unclipped)]
    ratios = [1.0, 2.0, 0.5]
    lp = torch.log(torch.tensor([ratios], dtype=F64)).requires_grad_(True)
    loss, m = compute_policy_loss(lp, torch.zeros(1, 3, dtype=F64), torch.tensor([0.5], dtype=F64),
                                  torch.ones(1, 3), global_num_tokens=10)
    loss.backward()
    # loss = (-0.5·1 - 0.5·1.28 - 0.5·0.5)/10 = (-0.5 - 0.64 - 0.25)/10 = -0.139
    assert loss.item() == pytest.approx(-0.139)
    # grads: -A·r/D = [-0.05, 0 (clipped), -0.025]
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.05, 0.0, -0.025]], dtype=F64))
    assert float(m["loss/clip_frac_high"]) == pytest.approx(1 / 3)


def test_per_token_advantages_match_broadcast():
    lp, old, adv, mask = random_batch(seed=3)
    a, _ = compute_policy_loss(lp, old, adv, mask)
    b, _ = compute_policy_loss(lp, old, adv[:, None].expand(-1, lp.shape[1]), mask)
    torch.testing.assert_close(a, b)


def test_tis_weights_and_their_use():
    # train/engine probs: 0.5/0.25 → 2 capped at 1.5; 0.25/0.5 → 0.5; padding → 1
    train = torch.log(torch.tensor([[0.5, 0.25, 0.3]], dtype=F64))
    engine = torch.log(torch.tensor([[0.25, 0.5, 1e-30]], dtype=F64))
    w = compute_tis_weights(train, engine, cap=1.5, response_mask=torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 1.0]], dtype=F64))
    assert not w.requires_grad
    # huge mismatch does not overflow: exp(1000) capped to 2
    big = compute_tis_weights(torch.tensor([[0.0]]), torch.tensor([[-1000.0]]), cap=2.0)
    assert big.item() == pytest.approx(2.0)
    # loss with weights: r = 1 on both tokens, A = 1 → ℓ = [-1, -1]·w = [-1.5, -0.5], D = 2 → -1.0
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    loss, _ = compute_policy_loss(lp, torch.zeros(1, 2, dtype=F64), torch.tensor([1.0], dtype=F64),
                                  torch.ones(1, 2), tis_weights=w[:, :2])
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.75, -0.25]], dtype=F64))
