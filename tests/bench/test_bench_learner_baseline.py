"""The learner benchmark's baseline computes what ours does, and its pure helpers.

The HF baseline trains on the learner's own packed rows (several samples side by side,
position_ids restarting per sample, a block-diagonal causal 4D mask). Here a packed row's
per-token log-probs are compared with each sample run alone through the same model: equal,
so the baseline is packing and not attention across samples; without the mask they differ
(the check would notice a mask that transformers dropped or re-combined wrongly).
No timing is asserted.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_learner  # noqa: E402
import timing  # noqa: E402

from dapo_mega.algo import TrainSample  # noqa: E402
from dapo_mega.backends.megatron.batch import (  # noqa: E402
    ATTENTION_MASK,
    collate_micro_batch,
    collate_packed_micro_batch,
)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def _samples():
    lengths = [(3, 5), (2, 1), (4, 6), (1, 3), (5, 2)]
    return [TrainSample(prompt_ids=[(7 * i + j) % 47 + 3 for j in range(p)],
                        response_ids=[(11 * i + j) % 47 + 3 for j in range(r)], advantage=1.0)
            for i, (p, r) in enumerate(lengths)]


def _alone(model, sample, temperature):
    """[R] log-probs of one sample's response tokens, the sample alone in its row."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    logits = model(input_ids=ids).logits.float() / temperature
    log_probs = torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[..., 0]
    return log_probs[len(sample.prompt_ids) - 1:]


def test_packed_row_equals_samples_run_alone(hf_model):
    samples = _samples()
    # two rows of several samples each, pad columns at the ends, as the learner packs them
    mb = collate_packed_micro_batch(samples, [[0, 1, 3], [2, 4]], seq_len=18, attention=ATTENTION_MASK)
    inputs = bench_learner.hf_packed_inputs(mb)
    assert inputs["attention_mask"].shape == (2, 1, 18, 18) and inputs["attention_mask"].dtype == torch.bool
    with torch.no_grad():
        packed = bench_learner.hf_token_log_probs(hf_model, mb, temperature=0.7)
        for p in mb.placements:
            got = packed[p.row, p.response_columns]
            torch.testing.assert_close(got, _alone(hf_model, samples[p.sample_index], 0.7), rtol=1e-5, atol=1e-5)
        # the same row with the causal mask only (samples see the ones before them): differs
        leaky = hf_model(input_ids=mb.tokens, position_ids=mb.position_ids).logits
        assert not torch.allclose(leaky, hf_model(**inputs).logits, atol=1e-3)


def test_same_rows_copies_the_learners_layout(hf_model):
    samples = _samples()
    learner_mb = collate_packed_micro_batch(samples, [[2, 4], [0, 1, 3]], seq_len=18, attention=ATTENTION_MASK)
    learner_mb.old_log_probs.fill_(-1.0)
    copy = bench_learner.same_rows(samples, learner_mb)
    for name in ("tokens", "position_ids", "labels", "response_mask", "advantages", "attention_mask"):
        assert torch.equal(getattr(copy, name), getattr(learner_mb, name)), name
    assert [(p.sample_index, p.row, p.start) for p in copy.placements] == \
           [(p.sample_index, p.row, p.start) for p in learner_mb.placements]
    assert not copy.old_log_probs.any()  # the baseline computes its own π_old


def test_padded_rows_need_only_ids(hf_model):
    samples = _samples()
    mb = collate_micro_batch(samples, [0, 2, 4])
    assert set(bench_learner.hf_packed_inputs(mb)) == {"input_ids"}
    with torch.no_grad():
        padded = bench_learner.hf_token_log_probs(hf_model, mb, temperature=1.0)
        for p in mb.placements:
            torch.testing.assert_close(padded[p.row, p.response_columns], _alone(hf_model, samples[p.sample_index], 1.0),
                                       rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ timing helpers
def test_spread_by_hand():
    assert timing.spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0}
    with pytest.raises(ValueError):
        timing.spread([])


def test_time_alternating_calls_the_sides_in_turn_reversing_every_other_round():
    calls = []
    seconds = timing.time_alternating({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3,
                                      sync=lambda: calls.append("sync"))
    assert [c for c in calls if c != "sync"] == ["a", "b", "b", "a", "a", "b"]
    assert calls.count("sync") == 12
    assert {k: len(v) for k, v in seconds.items()} == {"a": 3, "b": 3}


def test_throughput_figure_by_hand():
    row = timing.throughput_figure("x", "tokens/s", 100, [2.0, 1.0, 4.0], 100, [5.0, 2.0, 2.5], "base", "detail")
    # best rounds: 100 / 1 = 100 against 100 / 2 = 50; medians 100 / 2 = 50 against 100 / 2.5 = 40
    assert row["ours"] == 100 and row["baseline"] == 50 and row["ratio"] == 2.0
    assert row["ratio_median"] == pytest.approx(50 / 40)
    assert row["ours_spread"] == {"min": 25.0, "median": 50.0, "max": 100.0}
    assert row["baseline_spread"] == {"min": 20.0, "median": 40.0, "max": 50.0}
    assert row["repeats"] == 3 and row["higher_is_better"] and row["baseline_detail"] == "detail"


def test_summarize_dp_by_hand():
    def rank(compute, step, computed):
        layout = {"compute_s": compute, "step_s": step, "computed_tokens": computed, "samples": 2,
                  "useful_tokens": computed, "micro_batches": 1}
        return {"balanced": layout, "contiguous": dict(layout, compute_s=[c * 2 for c in compute],
                                                        computed_tokens=computed * 2)}
    ranks = [rank([1.0, 0.9], [1.5, 1.4], 100), rank([0.5, 0.6], [1.6, 1.3], 60)]
    out = bench_learner.summarize_dp(ranks, useful_tokens=140)
    bal = out["balanced"]
    # per round the slowest rank's whole update; the figure from the fastest such round
    assert bal["step_s"] == [1.6, 1.4] and bal["tokens_per_s"] == pytest.approx(100.0)
    # fastest compute per rank 0.9 and 0.5: 0.9 / 0.7
    assert bal["measured_imbalance"] == pytest.approx(0.9 / 0.7)
    assert bal["measured_imbalance_per_round"]["max"] == pytest.approx(1.0 / 0.75)
    assert bal["token_imbalance"] == pytest.approx(100 / 80)
    assert out["contiguous"]["measured_imbalance"] == pytest.approx(0.9 / 0.7)
