"""Bad training data given to `dapo-mega train`, end to end (the readers' own cases, file by
file and row by row, are in test_data_readers.py).

The command must stop with a non-zero exit code and an error that names the file, the row
and the field, and leave an existing run directory's records as they were. With
data.on_bad_row=skip the same file trains, and the skipped rows are counted.
"""

from __future__ import annotations

import json

from helpers.training import run_cli
from test_faults_common import TINY_OVERRIDES


def _train(tmp_path, *overrides, timeout_s=300):
    return run_cli("train", f"trainer.output_dir={tmp_path}", "trainer.run_name=run", *TINY_OVERRIDES,
                   "trainer.total_steps=1", "trainer.save_interval=0", *overrides, timeout_s=timeout_s)


def _snapshot(run_dir):
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != "config.yaml"}


def test_bad_rows_stop_the_cli_naming_file_row_field_and_keep_the_run_dir(tmp_path):
    rows = [{"id": f"q{i}", "prompt": f"What is {i}+{i}?\nAnswer:", "answer": str(2 * i)} for i in range(12)]
    rows[5] = {"id": "q5", "prompt": "What is 5+5?\nAnswer:", "answer": 10}  # a number, not a string
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Records of an earlier run in the same directory (its checkpoint incomplete, so ignored).
    run_dir = tmp_path / "run"
    (run_dir / "ledger").mkdir(parents=True)
    (run_dir / "ledger" / "step_00000001.parquet").write_bytes(b"earlier ledger shard")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "policy_version": 1}\n')
    (run_dir / "checkpoints" / "step_000001.tmp-7").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000001.tmp-7" / "trainer_state.json").write_text("{}")
    before = _snapshot(run_dir)

    bad = _train(tmp_path, f"data.train_path={data}")
    assert bad.returncode != 0
    err = bad.stderr.strip().splitlines()[-1]
    assert err.startswith("dapo-mega: data error:") and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert str(data) in err and "row 5" in err and "answer" in err and "string" in err, bad.stderr[-2000:]
    after = _snapshot(run_dir)
    assert {k: after.get(k) for k in before} == before, "the failed start changed an existing run's records"

    missing = _train(tmp_path, f"data.train_path={tmp_path / 'nope.parquet'}")
    assert missing.returncode != 0 and "nope.parquet" in missing.stderr.strip().splitlines()[-1]
    after = _snapshot(run_dir)
    assert {k: after.get(k) for k in before} == before

    skipped = _train(tmp_path, f"data.train_path={data}", "data.on_bad_row=skip", "trainer.run_name=skip")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    line = next(ln for ln in skipped.stdout.splitlines() if ln.startswith("[data]"))
    assert "11 train" in line and "'train': \"1 {'answer: must be a string" in line, line


# --------------------------------------------------------------------------- config errors
def _cli_train(tmp_path, *overrides, timeout_s=120):
    return run_cli("train", f"trainer.output_dir={tmp_path}", "trainer.run_name=run", *overrides, timeout_s=timeout_s)


def _assert_config_error_line(proc, *needles):
    """Exit code 2, exactly one stderr line `dapo-mega: config error: <field>: ... Fix: ...`, no traceback."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("dapo-mega: config error: "), lines
    assert "Fix:" in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_tp_that_does_not_divide_the_learners_is_one_line_naming_num_learner_processes(tmp_path):
    proc = _cli_train(tmp_path, "megatron.tensor_model_parallel_size=3")
    _assert_config_error_line(proc, "config error: megatron.tensor_model_parallel_size:", "world size 1",
                              "cluster.num_learner_processes=3")
    assert not (tmp_path / "run").exists(), "the failed start built or wrote something"
    # Three learners fit TP 3, but the (tiny) model's 4 heads do not split over 3 ranks: also
    # found before the model is built, from the model's config alone.
    proc = _cli_train(tmp_path, "megatron.tensor_model_parallel_size=3", "cluster.num_learner_processes=3")
    _assert_config_error_line(proc, "megatron.tensor_model_parallel_size:", "num_attention_heads 4")
    assert not (tmp_path / "run").exists()


def test_missing_data_file_is_reported_before_any_model_is_built(tmp_path):
    missing = tmp_path / "nope" / "train.parquet"
    proc = _cli_train(tmp_path, f"data.train_path={missing}")
    _assert_config_error_line(proc, "config error: data.train_path:", str(missing))
    assert not (tmp_path / "run").exists(), "the base model (or anything) was built before the data check"
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"id": "q", "prompt": "What is 1+1?\nAnswer:", "answer": "2"}) + "\n")
    proc = _cli_train(tmp_path, f"data.train_path={train}", f"data.eval_path={tmp_path / 'aime.parquet'}")
    _assert_config_error_line(proc, "config error: data.eval_path:", "aime.parquet")
    assert not (tmp_path / "run").exists()
