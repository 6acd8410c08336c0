"""Run state: eval / save schedule, ledger rows read off ScoredSamples, pruning on resume."""

import json
from dataclasses import fields

from helpers_driver import group

from dapo_mega.config import TrainerConfig
from dapo_mega.driver.run_state import RunState, TrainerState, prune_records_after, write_ledger
from dapo_mega.records.ledger import LedgerRecord, LedgerText, read_records


def test_schedule():
    run = RunState("/nonexistent", TrainerConfig(total_steps=10, eval_interval=4, save_interval=3))
    assert [s for s in range(1, 11) if run.should_eval(s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if run.should_save(s)] == [3, 6, 9, 10]
    never = RunState("/nonexistent", TrainerConfig(total_steps=5, eval_interval=0, save_interval=0))
    assert not any(never.should_eval(s) for s in range(1, 6))
    assert [s for s in range(1, 6) if never.should_save(s)] == [5]  # the end is always saved
    assert run.state == TrainerState() and not run.resumed


def test_ledger_rows_keep_the_samples_names(tmp_path):
    g = group("p1", [1.0, -1.0], version=2)
    samples = g.stamp(step=3, learner_version=4)
    samples[1].reject_reason = "stale"
    write_ledger(tmp_path, "run", 3, samples)
    rows = read_records(tmp_path)
    assert len(rows) == 2
    for row, s in zip(rows, samples):
        for name in ("prompt_id", "sample_index", "seed", "engine_id", "queue_delay_s", "generation_latency_s",
                     "response_length", "truncated", "reward", "correct", "reject_reason", "response_text",
                     "policy_version_min", "policy_version_max", "learner_version", "age", "step", "gen_round"):
            assert getattr(row, name) == getattr(s, name), name
    assert rows[0].seed == 7 and rows[0].age == 2 and rows[0].run_id == "run"
    assert json.loads(rows[0].reward_components) == {"correctness": 0.0, "overlong_penalty": 0.0}
    assert (rows[0].response_text_chars, rows[0].response_text_elided) == (len(samples[0].response_text), False)
    # every ledger column is the sample's field of the same name, except the run's id and name, the
    # reward's parts and verdict, which the sample holds in its typed `score`, what the ledger kept
    # of the texts (trainer.ledger_text), and the run's prompt encoder
    assert {f.name for f in fields(LedgerRecord) if not hasattr(samples[0], f.name)} == {
        "run_id", "run_name", "reward_components", "verifier", "verifier_version", "response_text_chars",
        "response_text_elided", "prompt_text_chars", "prompt_text_elided", "extracted_answer", "answer_found",
        "verifier_error", "encoder"}


def test_ledger_rows_record_what_was_kept(tmp_path):
    samples = group("p1", [1.0, -1.0]).stamp(step=2, learner_version=1)
    samples[0].response_text = "Let me think. " * 100 + "Answer: 46"
    samples[0].prompt_text = "Q? " * 10
    write_ledger(tmp_path, "run", 2, samples, text=LedgerText("head_tail", 64))
    long, short = read_records(tmp_path)
    assert long.response_text_elided and long.response_text_chars == 1410
    assert long.response_text.startswith("Let me think.") and long.response_text.endswith("Answer: 46")
    assert (short.response_text, short.response_text_elided, short.response_text_chars) == (" 46\n", False, 4)
    assert (long.prompt_text, long.prompt_text_elided, long.prompt_text_chars) == ("Q? " * 10, False, 30)
    write_ledger(tmp_path, "run", 2, samples, text=LedgerText("none"))
    rows = read_records(tmp_path)
    assert [(r.response_text, r.response_text_elided, r.response_text_chars) for r in rows] == [("", True, 1410),
                                                                                               ("", True, 4)]
    assert rows[0].prompt_text == "" and rows[0].prompt_text_elided and rows[0].prompt_text_chars == 30


def test_prune_records_after(tmp_path):
    for step in (1, 2, 3):
        write_ledger(tmp_path, "run", step, group("p", [1.0]).stamp(step, step - 1))
    (tmp_path / "eval").mkdir()
    for step in (0, 2, 3):
        (tmp_path / "eval" / f"step_{step:06d}.json").write_text("{}")
    prune_records_after(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "ledger").iterdir()) == ["step_00000001.parquet",
                                                                       "step_00000002.parquet"]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["step_000000.json", "step_000002.json"]
