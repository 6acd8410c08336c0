"""`dapo-mega train` on the tiny Qwen3-MoE (issue #38) with 2 learner processes at expert
parallelism 2 (each holds 4 of the 8 experts of its sparse layer) with routing replay, the
embedded engine colocated: 3 steps whose every weight sync reaches the engine exactly (all 47 tensors'
checksums equal the learner's, experts gathered from both EP ranks), and whose engine
log-probs equal the learner's (the mismatch metric, fp32 on both sides: transformers' fused
experts on the engine, megatron-core's MoE layer with its all-to-all dispatcher on the learner),
and whose learner router picks the experts the engine reported (`moe/router_agreement`).
"""

from __future__ import annotations

import base64
import math

import pytest
from helpers.training import RUN_NAME, check_records_of_run, read_rows, run_train

from dapo_mega.backends.megatron.routing import decode_routed_experts
from dapo_mega.models.shape import ModelShape
from dapo_mega.models.tiny import build_tiny_model_dir
from dapo_mega.records.ledger import read_records
from dapo_mega.weights.hf_io import HFCheckpointReader


@pytest.mark.slow  # ~90 s on 2 cores
def test_moe_trains_three_steps_at_ep2_and_every_expert_reaches_the_engine(tmp_path):
    model = build_tiny_model_dir(tmp_path / "moe", seed=5, architecture="qwen3_moe")
    tensors = len(HFCheckpointReader(model).keys())
    run_train(tmp_path, f"model.hf_path={model}", "model.name=tiny-qwen3-moe", "trainer.sft_warmup_steps=0",
              "cluster.num_learner_processes=2", "megatron.expert_model_parallel_size=2", "algo.routing_replay=true",
              "trainer.ledger_routed_experts=true", timeout_s=420)
    run_dir = tmp_path / RUN_NAME
    (run_dir / "base_model").symlink_to(model)  # where the records check finds the synced bytes
    check_records_of_run(run_dir, total_steps=3, max_staleness=0)
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert (r["checksum/tensors"], r["checksum/errors"]) == (tensors, 0), r
        assert r["mismatch/logp_abs_max"] < 1e-4 and math.isfinite(r["actor/grad_norm"]), r
        # the engines report every sample's experts (the fleet passes --enable-return-routed-experts for
        # a mixture), and the learner's router chooses as transformers' does at the same weights
        assert r["moe/unreported_samples"] == 0 and r["moe/router_choices_compared"] > 0, r
        assert r["moe/router_agreement"] > 0.99 and r["moe/routing_replay"] == 1.0, r
        assert 0.5 < r["moe/load_balancing_loss"] < 8, r  # 1.0 when the 8 experts share the tokens evenly
    # the ledger keeps each sample's experts: every position of its prompt and response but the
    # last, every layer (zeros in the dense ones), top-k of the 8 experts
    shape = ModelShape.from_hf_config(str(model))
    ledger = read_records(run_dir)
    assert ledger and all(row.routed_experts for row in ledger)
    for row in ledger:
        choices = shape.num_layers * shape.num_experts_per_tok
        positions = len(base64.b64decode(row.routed_experts.partition(":")[2])) // choices
        experts = decode_routed_experts(row.routed_experts, positions, shape.num_layers, shape.num_experts_per_tok)
        assert experts is not None and positions > row.response_length, row
        sparse = [i for i in range(shape.num_layers) if shape.is_sparse_layer(i)]
        assert (experts[:, [i for i in range(shape.num_layers) if i not in sparse]] == 0).all()
        assert all(len(set(tok)) == shape.num_experts_per_tok for tok in experts[:, sparse].reshape(-1, shape.num_experts_per_tok).tolist())
