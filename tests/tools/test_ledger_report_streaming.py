"""The streamed ledger report (shard by shard, row group by row group, by step range)
equals the report of the same rows read into memory at once."""

import json
import random
import tracemalloc

import pyarrow.parquet as pq
import pytest

from dapo_mega.records import ledger
from dapo_mega.records.ledger import REJECT_REASONS, LedgerRecord, LedgerText, read_records, write_step
from dapo_mega.records.ledger_report import build_report, main, parse_steps, render_markdown, report_from_records
from dapo_mega.records.metrics import read_metrics

COPIED = "I am confident the result is right, trust me on this one"


def synthetic_run(run_dir, steps=40, prompts=6, group_size=8, text=LedgerText("head_tail", 64), long_chars=200,
                  seed=0):
    """`steps` shards of `prompts` x `group_size` rows, some in a second generation round:
    every flag occurs (near-empty answers, one text copied across prompts, answers that
    restate the prompt), texts over the head_tail bound are elided, rewards carry an
    overlong penalty (floats that are not small integers), ages 0-4, every reject reason."""
    rng = random.Random(seed)
    metrics = []
    for step in range(1, steps + 1):
        rows = []
        for p in range(prompts):
            prompt = f"Q{step}.{p}: what is {p} + {step}?\nAnswer:"
            gen_round = int(rng.random() < 0.3)
            for k in range(group_size):
                correct = rng.random() < 0.45
                kind = rng.random()
                response = (COPIED if kind < 0.08 else "\\boxed{}" if kind < 0.12 else prompt + " yes" if kind < 0.16
                            else "step " * rng.randint(1, long_chars // 5) + f"Answer: {p + step + k}")
                kept, elided = text.keep(response)
                penalty = -round(rng.random() * 0.7, 3) if rng.random() < 0.2 else 0.0
                rows.append(LedgerRecord(
                    run_id="synthetic", step=step, prompt_id=f"p{step % 7}-{p}", dataset_revision="r1",
                    sample_index=k, seed=k, policy_version_min=step - 1 - (age := rng.randint(0, 4)),
                    policy_version_max=step - 1, learner_version=step - 1, age=age, engine_id="e0",
                    queue_delay_s=0.0, generation_latency_s=rng.random(), response_length=rng.randint(1, 300),
                    truncated=rng.random() < 0.1, reward=(1.0 if correct else -1.0) + penalty, correct=correct,
                    reward_components=json.dumps({"overlong_penalty": penalty}), verifier="dapo",
                    verifier_version="v1", reject_reason=rng.choice(REJECT_REASONS), response_text=kept,
                    prompt_text=prompt, gen_round=gen_round, response_text_chars=len(response),
                    response_text_elided=elided))
        write_step(run_dir, step, rows)
        if step % 3 == 0:
            metrics.append({"step": step, "verifier/num_errors": float(step % 4)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run_dir


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "ROW_GROUP_ROWS", 16)          # 48 rows a shard: three row groups each
    return synthetic_run(tmp_path / "run")


def in_memory(run_dir, steps=None, step_range="all", **kwargs):
    """The report as before streaming: every row of the steps as a Python object at once."""
    return report_from_records(read_records(run_dir, steps), read_metrics(run_dir), run_dir=str(run_dir),
                               step_range=step_range, **kwargs)


def no_whole_reads(monkeypatch):
    """The streamed report must not read a ledger or a shard whole."""
    def refuse(*args, **kwargs):
        raise AssertionError("read the whole ledger or a whole shard")

    for module, name in ((ledger, "read_ledger"), (ledger, "read_records"), (pq, "read_table")):
        monkeypatch.setattr(module, name, refuse)


def test_streamed_report_equals_the_in_memory_one(run_dir, monkeypatch):
    expected = in_memory(run_dir, per_stratum=3)
    assert expected.num_records == 40 * 48 and len(expected.steps) == 40
    assert set(expected.flag_counts) == {"near_empty", "copied", "repeats_prompt"} and expected.elided_responses > 0
    assert len(expected.sample) > 9 and len(expected.ages) == 4
    capped = in_memory(run_dir)
    with monkeypatch.context() as m:
        no_whole_reads(m)
        assert build_report(run_dir, per_stratum=3) == expected
        two = build_report(run_dir, max_flagged=2)          # the list is capped, the counts are not
    assert two.suspicious == capped.suspicious[:2] and two.flag_counts == capped.flag_counts
    assert two.sample == capped.sample
    assert render_markdown(build_report(run_dir, per_stratum=3)) == render_markdown(expected)


def test_step_range(run_dir, capsys):
    assert parse_steps("10:19") == (10, 19) and parse_steps("35:") == (35, None) and parse_steps(":3") == (None, 3)
    assert parse_steps("7") == (7, 7) and parse_steps(None) == (None, None)
    with pytest.raises(ValueError, match="expected A:B"):
        parse_steps("ten")
    middle = build_report(run_dir, steps=(10, 19))
    assert [s.step for s in middle.steps] == list(range(10, 20)) and middle.num_records == 10 * 48
    assert middle == in_memory(run_dir, steps=range(10, 20), step_range="10:19")
    assert [s.step for s in build_report(run_dir, steps=(35, None)).steps] == [35, 36, 37, 38, 39, 40]

    assert main([str(run_dir), "--steps", "10:19", "--out", str(run_dir / "r")]) == 0
    assert "480 ledger rows, 10 steps (steps 10:19)" in capsys.readouterr().out
    assert (run_dir / "r" / "ledger_report.md").read_text() == render_markdown(middle)
    assert main([str(run_dir), "--steps", "100:200"]) == 2
    assert "no ledger shards of steps 100:200" in capsys.readouterr().out
    assert main([str(run_dir), "--steps", "x:y"]) == 2


def test_streamed_memory_does_not_grow_with_the_ledger(tmp_path):
    """Whole texts of 40 x 48 responses (~4 MB): the in-memory report holds them all, the
    streamed one a shard's numbers and a row group of text."""
    run_dir = synthetic_run(tmp_path / "big", text=LedgerText("full"), long_chars=4000)

    def peak(build):
        tracemalloc.start()
        report = build()
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return report, peak_bytes

    expected, in_memory_peak = peak(lambda: in_memory(run_dir))
    streamed, streamed_peak = peak(lambda: build_report(run_dir))
    assert streamed == expected
    assert streamed_peak * 4 < in_memory_peak, (streamed_peak, in_memory_peak)
