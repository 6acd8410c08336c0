"""The ledger at scale: what it keeps of the texts, compressed shards, and its size estimate
checked against shards written here (math-like synthetic text: a DAPO step in miniature)."""

import dataclasses
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_mega.config import ConfigError, TrainerConfig, load_config
from dapo_mega.records import ledger
from dapo_mega.records.ledger import (
    LedgerRecord,
    LedgerText,
    elision_marker,
    ledger_bytes_per_step,
    ledger_bytes_per_step_of,
    ledger_responses_per_step,
    read_records,
    shard_path,
    write_step,
)

_WORDS = ("we", "so", "the", "sum", "of", "is", "then", "let", "since", "therefore", "which", "gives", "equals",
          "and", "factor", "divide", "both", "sides", "by", "square", "root", "term", "each", "value", "check",
          "case", "first", "second", "now", "substitute", "into", "equation", "solve", "for", "wait", "again")


def reasoning_text(rng: random.Random, chars: int) -> str:
    """About `chars` characters of math-reasoning-like text (words, products, LaTeX), then an answer line."""
    parts, n = [], 0
    while n < chars:
        kind = rng.random()
        if kind < 0.55:
            piece = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9))) + ". "
        elif kind < 0.85:
            a, b = rng.randint(2, 999), rng.randint(2, 99)
            piece = f"$${a} \\times {b} = {a * b}$$ "
        else:
            piece = f"\\frac{{{rng.randint(1, 99)}}}{{{rng.randint(2, 99)}}} + x_{rng.randint(1, 9)}^2 "
        parts.append(piece)
        n += len(piece)
    return "".join(parts)[:chars] + f"\nAnswer: {rng.randint(0, 999)}"


def synthetic_step(step: int, prompts: int, group_size: int, response_chars: float, prompt_chars: int,
                   text: LedgerText, seed: int = 0):
    """The rows of one step: `prompts` groups of `group_size` responses of log-normal length
    (mean `response_chars`), the texts kept as `text` keeps them."""
    rng = random.Random(seed + step)
    rows = []
    for p in range(prompts):
        prompt = "Solve the following math problem step by step. " + reasoning_text(rng, prompt_chars)
        for k in range(group_size):
            chars = max(1, int(rng.lognormvariate(0, 0.5) * response_chars / 1.133))  # E[lognorm(0, .5)] = 1.133
            response = reasoning_text(rng, chars)
            correct = rng.random() < 0.4
            (response_text, response_elided), (prompt_text, prompt_elided) = text.keep(response), text.keep(prompt)
            rows.append(LedgerRecord(
                run_id="synthetic", step=step, prompt_id=f"dapo-{p:05d}", dataset_revision="abc123", sample_index=k,
                seed=1000 + k, policy_version_min=step - 1, policy_version_max=step - 1, learner_version=step - 1,
                age=0, engine_id=f"http://10.0.0.{p % 32}:30000", queue_delay_s=rng.random(),
                generation_latency_s=rng.random() * 300, response_length=max(1, int(len(response) / 3.7)),
                truncated=rng.random() < 0.05, reward=1.0 if correct else -1.0, correct=correct,
                reward_components=json.dumps({"correctness": 1.0 if correct else -1.0, "overlong_penalty": 0.0}),
                verifier="dapo", verifier_version="dapo-1.0+abc", reject_reason="kept",
                response_text=response_text, prompt_text=prompt_text, gen_round=0,
                response_text_chars=len(response), response_text_elided=response_elided,
                prompt_text_chars=len(prompt), prompt_text_elided=prompt_elided))
    return rows


def test_text_keeps_head_and_tail_and_says_so():
    text = "H" * 600 + "m" * 1000 + "T" * 400 + "Answer: 42"
    kept, elided = LedgerText("head_tail", 100).keep(text)
    assert elided and kept == "H" * 50 + elision_marker(len(text) - 100) + "T" * 40 + "Answer: 42"
    assert "1910 chars elided" in kept
    assert LedgerText("head_tail", 100).keep("short") == ("short", False)
    assert LedgerText("head_tail", 100).keep("x" * 100) == ("x" * 100, False)   # at the bound: whole
    assert LedgerText("full", 100).keep(text) == (text, False)
    assert LedgerText("none").keep(text) == ("", True) and LedgerText("none").keep("") == ("", False)
    with pytest.raises(ValueError):
        LedgerText("truncate")


def test_shards_are_zstd_in_bounded_row_groups_and_old_shards_still_read(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "ROW_GROUP_ROWS", 10)
    rows = synthetic_step(1, 5, 5, 200, 50, LedgerText("full"))
    path = write_step(tmp_path, 1, rows)
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [10, 10, 5]
    assert {meta.row_group(0).column(c).compression for c in range(meta.num_columns)} == {"ZSTD"}
    assert read_records(tmp_path) == rows
    # a shard written before the text columns (uncompressed, no *_chars / *_elided) reads as whole texts
    old = {name: [getattr(r, name) for r in rows] for name in ledger.SCHEMA.names if "_text_" not in name}
    pq.write_table(pa.table(old), shard_path(tmp_path, 2), compression="none")
    first = read_records(tmp_path, steps=[2])[0]
    assert first.response_text == rows[0].response_text and not first.response_text_elided
    assert first.response_text_chars == len(rows[0].response_text)


def test_ledger_text_config_rules():
    TrainerConfig().validate()
    assert TrainerConfig().ledger_text == "head_tail"          # bounded unless asked otherwise
    with pytest.raises(ConfigError, match=r"^trainer.ledger_text: unknown 'truncate'. Fix: use full, head_tail, none"):
        TrainerConfig(ledger_text="truncate").validate()
    with pytest.raises(ConfigError, match=r"^trainer.ledger_text_max_chars: 10 < 64 .*Fix: use 2048"):
        TrainerConfig(ledger_text_max_chars=10).validate()
    TrainerConfig(ledger_text="none", ledger_text_max_chars=0).validate()   # unused without head_tail
    cfg = load_config(["+experiment=dapo_qwen2.5_7b"])                      # composed from the 32B recipe
    assert LedgerText.of(cfg.trainer) == LedgerText("head_tail", 2048)


@pytest.mark.parametrize("mode", ["full", "head_tail", "none"])
def test_bytes_per_step_estimate_matches_written_shards(tmp_path, mode):
    """A step of 32 prompts x 16 responses of ~600 tokens (~2,220 chars) and 150-token prompts:
    the estimate is within a factor of 1.5 of the shard's bytes (measured: 0.96-1.11)."""
    text = LedgerText(mode, 512)
    rows = synthetic_step(1, 32, 16, 600 * 3.7, int(150 * 3.7), text)
    size = write_step(tmp_path, 1, rows).stat().st_size
    estimate = ledger_bytes_per_step(len(rows), 600, text=mode, text_max_chars=512, group_size=16, prompt_tokens=150)
    assert size / 1.5 < estimate < size * 1.5, (mode, size, estimate)


def test_routed_experts_in_the_ledger_and_their_bytes(tmp_path):
    """A mixture's routed experts, kept (trainer.ledger_routed_experts), read back as the sample
    carried them and decode to its [positions, layers, top_k]; the estimate counts them within
    1.5x of the written shard (expert indices barely compress); the 30B-A3B recipe's plan counts
    them only when asked, for the share of samples reported."""
    import base64

    import numpy as np

    from dapo_mega.backends.megatron.routing import decode_routed_experts
    from dapo_mega.models.shape import ModelShape
    from dapo_mega.rollout.samples import compact_routed_experts

    rng = np.random.default_rng(0)
    layers, k, experts, positions = 48, 8, 128, 750  # Qwen3-30B-A3B's routing, 150 + 600 tokens
    rows = synthetic_step(1, 8, 16, 600 * 3.7, int(150 * 3.7), LedgerText("none", 512, routed_experts=True))
    reports = [rng.integers(0, experts, (positions, layers, k)) for _ in rows]
    rows = [dataclasses.replace(r, routed_experts=compact_routed_experts(base64.b64encode(
        e.astype(np.int32).tobytes()).decode())) for r, e in zip(rows, reports)]
    size = write_step(tmp_path, 1, rows).stat().st_size
    back = read_records(tmp_path, steps=[1])
    assert (decode_routed_experts(back[3].routed_experts, positions, layers, k) == reports[3]).all()
    per_token = ledger.routed_experts_bytes_per_token(layers, k, experts, 1.0)
    assert per_token == pytest.approx(512.0)
    estimate = ledger_bytes_per_step(len(rows), 600, text="none", group_size=16, prompt_tokens=150,
                                     routed_bytes_per_token=per_token)
    assert size / 1.5 < estimate < size * 1.5, (size, estimate)

    cfg = load_config(["+experiment=dapo_qwen3_30b_a3b"])
    shape = ModelShape(model_type="qwen3_moe", num_layers=layers, hidden_size=2048, ffn_hidden_size=6144,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                       qkv_bias=False, vocab_size=151936, num_experts=experts, num_experts_per_tok=k,
                       moe_ffn_hidden_size=768)
    plain = ledger_bytes_per_step_of(cfg, 4000, shape=shape)
    assert plain == ledger_bytes_per_step_of(cfg, 4000)  # not kept unless asked
    cfg.trainer.ledger_routed_experts = True
    every = cfg.checks.router_agreement_every
    kept = ledger_bytes_per_step_of(cfg, 4000, shape=shape)
    assert kept - plain == pytest.approx(ledger_responses_per_step(cfg.algo) * per_token / every * (4000 + 150))
    cfg.algo.routing_replay = True  # every sample reported
    assert ledger_bytes_per_step_of(cfg, 4000, shape=shape) - plain == pytest.approx((kept - plain) * every)


def test_bytes_per_step_of_the_32b_recipe():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b"])
    algo = cfg.algo
    rows = ledger_responses_per_step(algo)
    assert rows == 1536 * 16 and ledger_responses_per_step(algo, rounds=algo.max_num_gen_batches) == 10 * rows
    full = ledger_bytes_per_step(rows, 4000, text="full")
    bounded = ledger_bytes_per_step(rows, 4000, text="head_tail", text_max_chars=2048)
    # 24,576 x (40 + 14,800 chars / 3) + 1,536 prompts x 555 / 3 ~ 122 MB; head_tail ~ 18 MB
    assert 110e6 < full < 130e6 and 15e6 < bounded < 20e6
    assert ledger_bytes_per_step_of(cfg, 4000) == bounded          # the recipe's setting: head_tail, 2048
    assert ledger_bytes_per_step_of(cfg, 4000, rounds=3) == pytest.approx(3 * bounded)
    assert ledger_bytes_per_step(rows, 4000, text="none") == pytest.approx(rows * ledger.ROW_BYTES)
    assert ledger_bytes_per_step(rows, 100, text="head_tail") == ledger_bytes_per_step(rows, 100, text="full")
    with pytest.raises(ValueError):
        ledger_bytes_per_step(rows, 4000, text="truncate")


def test_rows_round_trip_unchanged_by_text_fields():
    row = synthetic_step(1, 1, 1, 50, 20, LedgerText("full"))[0]
    bare = dataclasses.replace(row, response_text_chars=None, prompt_text_chars=None)
    assert bare == row        # built without the counts, a row counts its own texts
