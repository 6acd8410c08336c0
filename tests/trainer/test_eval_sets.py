"""Several evaluation sets (eval.sets) end to end: a short `dapo-mega train` with the embedded
engine and `dapo-mega eval` report each named set beside the unnamed one, and each set's
avg@k is the count of right answers in its result file."""

import json
from pathlib import Path

import pytest
from helpers.training import RUN_NAME, read_rows, run_train

from dapo_mega.config import load_config
from dapo_mega.data import generate_synthetic_problems


def write_set(path: Path, seed: int, count: int) -> Path:
    """A held-out file of single-digit sums in the JSONL simple form (disjoint from training by seed)."""
    _, problems = generate_synthetic_problems(num_train=1, num_eval=count, min_digits=1, max_digits=1,
                                              ops="+", num_operands=2, seed=seed)
    path.write_text("".join(json.dumps({"id": f"{path.stem}-{p.id}", "prompt": p.prompt, "answer": p.ground_truth,
                                        "answer_prefix": p.answer_prefix}) + "\n" for p in problems))
    return path


def sets_override(tmp_path: Path) -> str:
    a, b = write_set(tmp_path / "alpha.jsonl", seed=11, count=5), write_set(tmp_path / "beta.jsonl", seed=12, count=6)
    return (f"+eval.sets={{alpha:{{path:'{a}',n_samples:3}},"
            f"beta:{{path:'{b}',max_problems:4,max_response_length:{BETA_LIMIT}}}}}")


BETA_LIMIT = 2
"""beta's own length limit, below the training limit the other sets generate at."""


def hand_avg_at_k(result: dict) -> float:
    """Mean over problems of (samples whose extracted answer is the ground truth) / k, from
    the file's answers (k <= 4: every sample's answer is kept)."""
    assert all(len(p["sample_answers"]) == result["k"] for p in result["problems"])
    return sum(sum(a == p["ground_truth"] for a in p["sample_answers"]) / result["k"]
               for p in result["problems"]) / len(result["problems"])


@pytest.mark.slow  # a real run with its warm start: ~45 s
def test_two_named_sets_side_by_side_in_a_training_run(tmp_path):
    output = run_train(tmp_path, "trainer.total_steps=1", "trainer.eval_interval=1", "trainer.plot=true",
                       sets_override(tmp_path))
    run_dir = tmp_path / RUN_NAME
    rows = {r["step"]: r for r in read_rows(run_dir)}
    for step in (0, 1):
        row = rows[step]
        assert row["eval/k"] == 2 and row["eval/num_problems"] == 8  # the unnamed set keeps its keys
        assert row["eval/alpha/k"] == 3 and row["eval/alpha/num_problems"] == 5  # its own n_samples
        assert row["eval/beta/k"] == 2 and row["eval/beta/num_problems"] == 4  # eval.n_samples, its max_problems
        for name, suffix in (("", ""), ("alpha/", "_alpha"), ("beta/", "_beta")):
            result = json.loads((run_dir / "eval" / f"step_{step:06d}{suffix}.json").read_text())
            assert row[f"eval/{name}avg_at_k"] == pytest.approx(hand_avg_at_k(result))
            assert row[f"eval/{name}pass_at_k"] == pytest.approx(
                sum(any(a == p["ground_truth"] for a in p["sample_answers"]) for p in result["problems"])
                / len(result["problems"]))
        assert f"eval/alpha {row['eval/alpha/avg_at_k']:.3f} | eval/beta {row['eval/beta/avg_at_k']:.3f}" in output
    alpha = json.loads((run_dir / "eval" / "step_000001_alpha.json").read_text())
    assert alpha["name"] == "alpha" and [p["id"] for p in alpha["problems"]][0].startswith("alpha-")
    assert (run_dir / "curves.png").stat().st_size > 1000


@pytest.mark.slow  # two models on three sets: ~35 s
def test_eval_command_reports_each_set_and_compares_per_set(tmp_path, capsys):
    from dapo_mega.evaluate import run_eval_command
    from dapo_mega.models.tiny import build_tiny_model_dir

    overrides = ["data.synthetic_max_digits=1", "data.synthetic_num_eval=20", "eval.max_problems=3",
                 "eval.n_samples=2", "eval.temperature=1.0", "eval.top_p=1.0", f"trainer.output_dir={tmp_path}",
                 sets_override(tmp_path)]
    models = [build_tiny_model_dir(tmp_path / name, load_config(overrides).model, seed=seed)
              for name, seed in (("a", 3), ("b", 4))]
    out = tmp_path / "result.json"
    cfg = load_config([*overrides, f"eval.checkpoint={tmp_path / 'a'}", f"eval.compare_checkpoint={tmp_path / 'b'}",
                       f"eval.output={out}"])
    assert models and run_eval_command(cfg) == 0
    printed = capsys.readouterr().out
    comparison = json.loads((tmp_path / "result_vs_result_compare_paired.json").read_text())
    table = printed[printed.rindex("set "):].splitlines()
    assert [line.split()[0] for line in table[1:]] == ["eval", "alpha", "beta"]
    for line, (label, suffix) in zip(table[1:], (("eval", ""), ("alpha", "_alpha"), ("beta", "_beta"))):
        a = json.loads((tmp_path / f"result{suffix}.json").read_text())
        b = json.loads((tmp_path / f"result_compare{suffix}.json").read_text())
        cells = line.split()
        assert int(cells[1]) == len(a["problems"]) and int(cells[2]) == a["k"]
        assert float(cells[3]) == pytest.approx(hand_avg_at_k(a), abs=1e-4)
        assert float(cells[5]) == pytest.approx(hand_avg_at_k(b), abs=1e-4)
        paired = comparison["sets"][label]["paired"]
        assert paired["difference"] == pytest.approx(hand_avg_at_k(b) - hand_avg_at_k(a))
        assert float(cells[7]) == pytest.approx(paired["difference"], abs=1e-4)
        assert paired["problems"] == len(a["problems"]) and f"[{label}]" in printed
        # each set generates at its own limit: beta's, or the training limit for the others
        limit = BETA_LIMIT if label == "beta" else cfg.algo.max_response_length
        assert a["settings"]["max_response_length"] == b["settings"]["max_response_length"] == limit
        lengths = [n for p in a["problems"] for n in p["response_lengths"]]
        assert len(lengths) == a["k"] * len(a["problems"])
        assert max(lengths) <= limit and (label == "beta" or max(lengths) > BETA_LIMIT), (label, lengths)
