"""A mixture of experts on the learner (issue #38 item 6, backends/megatron/routing.py): the
learner's router agrees with transformers' (the embedded engine's router) on every token-expert
choice at the same weights, `moe/router_agreement` falls when the reports are wrong, and routing
replay makes the learner's forward use the reported experts: with transformers' own reports it
changes nothing, with wrong ones the log-probs and the entropy move (the same weights, lr 0).

Two gloo ranks at expert parallelism 2 (4 of the 8 experts each); the reports are computed with
transformers' Qwen3MoeForCausalLM on the same checkpoint, as the embedded engine computes them."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch
from dist_helpers import run_distributed

from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.backends.megatron.batch import collate_packed_micro_batch
from dapo_mega.backends.megatron.routing import decode_routed_experts, routing_targets
from dapo_mega.models.shape import ModelShape
from dapo_mega.models.tiny import build_tiny_model_dir
from dapo_mega.rollout.samples import compact_routed_experts


def _report(array: np.ndarray) -> str:
    return base64.b64encode(array.astype(np.int32).tobytes()).decode()


def test_reports_land_on_each_samples_columns_and_odd_sizes_are_no_report():
    shape = ModelShape(model_type="qwen3_moe", num_layers=3, hidden_size=8, ffn_hidden_size=8, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, tie_word_embeddings=False, qkv_bias=False,
                       vocab_size=50, num_experts=4, num_experts_per_tok=2,
                       moe_ffn_hidden_size=4, mlp_only_layers=(0,))
    a = TrainSample(prompt_ids=[3, 4, 5], response_ids=[6, 7])          # 4 positions reported
    b = TrainSample(prompt_ids=[8], response_ids=[9, 10])              # 2 positions
    report_a = np.arange(4 * 3 * 2).reshape(4, 3, 2) % 4
    a.routed_experts = _report(report_a)
    b.routed_experts = _report(np.zeros((5, 3, 2)))                    # the wrong number of positions
    assert decode_routed_experts(b.routed_experts, 2, 3, 2) is None
    wide = np.arange(300, dtype=np.int32).reshape(50, 3, 2)  # more than 256 experts: two bytes a choice
    assert compact_routed_experts(_report(wide)).startswith("u16:")
    assert (decode_routed_experts(compact_routed_experts(_report(wide)), 50, 3, 2) == wide).all()
    assert (decode_routed_experts(compact_routed_experts(_report(report_a)), 4, 3, 2) == report_a).all()
    mb = collate_packed_micro_batch([a, b], [[0, 1]], seq_len=10)
    a.age, b.age = 2, 0
    experts, known, missing, ages = routing_targets(mb, [a, b], shape, layers=[1, 2])
    assert missing == 1 and known[0].tolist() == [True] * 4 + [False] * 6
    assert ages[0, :4].tolist() == [2] * 4 and ages[0, 5:7].tolist() == [0, 0]  # each column's sample's age
    assert torch.equal(experts[0, :4], torch.from_numpy(report_a[:, 1:, :]).long())
    assert (experts[0, 4:] == -1).all()


def _transformers_reports(hf_dir, samples):
    """Each sample's experts as transformers' router picks them (the embedded engine's `Routing`)."""
    from transformers import AutoModelForCausalLM

    from dapo_mega.engines.embedded.model_runner import Routing

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    routing = Routing.of(model)
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            model(input_ids=ids)
            out.append(routing.experts(1, ids.shape[1])[0, :-1].numpy())  # the last token is never fed
    return out


EVEN_LENGTH = 9


def _samples(n=8, even=False):
    rng = np.random.default_rng(0)
    return [TrainSample(prompt_ids=rng.integers(3, 90, 4 if even else int(rng.integers(3, 7))).tolist(),
                        response_ids=rng.integers(3, 90, EVEN_LENGTH - 4 if even else int(rng.integers(2, 8))).tolist(),
                        advantage=1.0 if i % 2 else -1.0) for i in range(n)]


def _learner(cfg, hf_dir, world, replay):
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.weights.hf_io import HFCheckpointReader
    from dapo_mega.weights.stream import load_hf_into_megatron

    cfg.algo.routing_replay = replay
    layout = ParallelLayout.from_config(cfg.megatron, world, str(hf_dir)).initialize()
    learner = MegatronLearner(cfg, str(hf_dir), layout, initialize=False)
    load_hf_into_megatron(learner.model_chunks, learner.info, layout, HFCheckpointReader(hf_dir))
    learner.optimizer.reload_model_params()
    return learner


def _agreement_and_replay(rank, world, hf_dir):
    import dataclasses

    from dist_helpers import make_config

    cfg = make_config(micro_batch_tokens=64, train_batch_size=2, mini_batch_size=2, n=4, lr=0.0)
    cfg.megatron.expert_model_parallel_size = world
    samples = _samples()
    reports = _transformers_reports(hf_dir, samples)
    shape = ModelShape.from_hf_config(str(hf_dir))
    out = {}
    own = _learner(cfg, hf_dir, world, replay=False)
    # the engine's log-probs: the learner's own without replay, so the mismatch metric shows
    # by how much a replayed forward's log-probs move
    own_lp = own.compute_log_probs(samples)
    samples = [dataclasses.replace(s, engine_log_probs=lp.tolist()) for s, lp in zip(samples, own_lp)]
    right = [dataclasses.replace(s, routed_experts=_report(r)) for s, r in zip(samples, reports)]
    rotated = [dataclasses.replace(s, routed_experts=_report((r + 1) % shape.num_experts)) for s, r in zip(samples, reports)]
    out["own_right"] = own.train_step(right, step=1)
    out["own_rotated"] = own.train_step(rotated, step=1)
    replay = _learner(cfg, hf_dir, world, replay=True)
    out["replay_right"] = replay.train_step(right, step=1)
    out["replay_rotated"] = replay.train_step(rotated, step=1)
    try:
        replay.train_step(samples, step=1)  # no reports at all: replay would do nothing
    except RuntimeError as exc:
        out["no_reports"] = str(exc)
    return out


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("moe"), seed=4, architecture="qwen3_moe")


def test_router_agreement_and_replay_at_ep2(moe_dir):
    runs = run_distributed(_agreement_and_replay, 2, args=(str(moe_dir),), timeout_s=300)
    r = runs[0]
    keys = ("moe/router_agreement", "moe/router_choices_compared", "actor/entropy", "mismatch/logp_abs_max")
    assert r["own_right"]["moe/router_agreement"] == pytest.approx(1.0, abs=0.01), {k: r["own_right"][k] for k in keys}
    assert r["own_right"]["moe/router_choices_compared"] > 0 and r["own_right"]["moe/unreported_samples"] == 0
    assert r["own_right"]["moe/age_0/router_agreement"] == r["own_right"]["moe/router_agreement"]  # every sample age 0
    assert math.isnan(r["own_right"]["moe/age_1/router_agreement"])
    assert r["own_rotated"]["moe/router_agreement"] < 0.5
    # replay of transformers' own choices: the forward routes as it would alone
    assert r["replay_right"]["actor/entropy"] == pytest.approx(r["own_right"]["actor/entropy"], abs=1e-5)
    # replay of other experts: the learner's forward uses them (the agreement is its own router's)
    assert abs(r["replay_rotated"]["actor/entropy"] - r["own_right"]["actor/entropy"]) > 1e-4
    assert r["replay_rotated"]["moe/router_agreement"] < 0.5 and r["replay_rotated"]["moe/routing_replay"] == 1.0
    # the log-probs the loss is made of move with the replayed experts (the loss's value at ratio 1
    # is the advantages' alone): against the learner's own, 0 with the right reports, not with wrong ones
    assert r["own_right"]["mismatch/logp_abs_max"] < 1e-5 and r["replay_right"]["mismatch/logp_abs_max"] < 1e-5
    assert r["replay_rotated"]["mismatch/logp_abs_max"] > 1e-4
    assert r["replay_right"]["actor/grad_norm"] == pytest.approx(r["own_right"]["actor/grad_norm"], rel=1e-4)
    assert "reported no routed experts for any of the step's 8 samples" in r["no_reports"]


def _router_loss_grad_norms(rank, world, hf_dir):
    """Gradient norms of an update whose only loss is the router's load-balancing loss (every
    advantage 0, weight 0.5): per token of the mini-batch (the learner's), and as megatron-core
    leaves it (the weight as given); the batch's tokens."""
    import dataclasses

    from dist_helpers import make_config

    # one sample a micro-batch, no padding: the load-balancing loss of each is its sample's
    cfg = make_config(micro_batch_tokens=EVEN_LENGTH, train_batch_size=2, mini_batch_size=2, n=4, lr=0.0)
    learner = _learner(cfg, hf_dir, world, replay=False)
    batch = [dataclasses.replace(s, advantage=0.0) for s in _samples(even=True)]
    learner._router_loss_coeff = 0.5
    metrics = learner.train_step(batch, step=1)
    per_token, balance = metrics["actor/grad_norm"], metrics["moe/load_balancing_loss"]
    learner._router_loss_coeff = 0.0  # megatron-core's own scaling
    learner.config.moe_aux_loss_coeff = 0.5
    as_given = learner.train_step(batch, step=1)["actor/grad_norm"]
    learner.config.moe_aux_loss_coeff = 0.0
    none = learner.train_step(batch, step=1)["actor/grad_norm"]
    return per_token, as_given, none, sum(s.length for s in batch), balance, _transformers_balance(hf_dir, batch)


def _transformers_balance(hf_dir, samples):
    """transformers' `load_balancing_loss_func` over each sparse layer's router logits of each
    sample alone, divided by top-k (megatron-core's per-layer loss: module docstring of
    `take_load_balancing_loss`), averaged over samples and layers."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    losses = []
    with torch.no_grad():
        for s in samples:
            out = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids]), output_router_logits=True)
            losses += [float(load_balancing_loss_func((logits,), experts, k)) / k
                       for logits in out.router_logits if logits is not None]
    return sum(losses) / len(losses)


def test_the_router_loss_is_per_token_as_the_policy_loss(moe_dir):
    """megatron-core multiplies each micro-batch's load-balancing loss by its tokens under
    calculate_per_token_loss and leaves the division to finalize_model_grads, which this learner
    does not run (its loss is per token already): the learner divides the weight by the
    mini-batch's tokens. Without that division the gradient is the tokens' count times larger
    (at 32B: millions), and it would swamp the policy gradient."""
    per_token, as_given, none, tokens, balance, reference = run_distributed(
        _router_loss_grad_norms, 1, args=(str(moe_dir),), timeout_s=300)[0]
    # the metric, before its weight: transformers' loss of the same tokens, layer by layer
    assert balance == pytest.approx(reference, rel=1e-4) and balance > 1.0, (balance, reference)
    assert none == 0.0 < per_token  # with every advantage 0 the router loss is the only gradient
    assert as_given / per_token == pytest.approx(tokens, rel=1e-4), (per_token, as_given, tokens)
