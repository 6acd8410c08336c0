"""`dapo-mega eval`: avg@k of an HF checkpoint on the held-out set, and two checkpoints
compared on the same problems; greedy answers checked against HF transformers' generate."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_mega.config import load_config

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["data.synthetic_max_digits=1", "data.synthetic_num_eval=40", "eval.max_problems=6",
             "eval.n_samples=2", "eval.temperature=0.0", "rollout.health_timeout_s=300"]


def build_model(path: Path, seed: int) -> Path:
    from dapo_mega.models.tiny import build_tiny_model_dir

    build_tiny_model_dir(path, load_config(OVERRIDES).model, seed=seed)
    return path


def hf_greedy_answers(model_dir: Path):
    """Reference: HF transformers greedy decoding of the same prompts, scored by the verifier."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_mega.data import build_datasets, format_prompt, verification_prefix
    from dapo_mega.reward import build_verifier, compute_rewards

    cfg = load_config(OVERRIDES)
    _, problems, _ = build_datasets(cfg.data)
    problems = problems[:cfg.eval.max_problems]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    texts, lengths = [], []
    for p in problems:
        ids = tok(format_prompt(p, cfg.data.prompt_template), add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=cfg.algo.max_response_length, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        new = out[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[:new.index(tok.eos_token_id) + 1]
        texts.append(tok.decode(new, skip_special_tokens=True))
        lengths.append(len(new))
    scored = compute_rewards(build_verifier(cfg.algo.verifier), texts, [p.ground_truth for p in problems], lengths,
                             cfg.algo, answer_prefixes=[verification_prefix(p, cfg.data.prompt_template)
                                                        for p in problems])
    return [p.id for p in problems], [bool(c) for c in scored.correct], list(scored.extracted)


@pytest.mark.slow
def test_eval_and_compare_checkpoints(tmp_path):
    a = build_model(tmp_path / "model_a", seed=3)
    b = build_model(tmp_path / "model_b", seed=4)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "dapo_mega.cli", "eval", *OVERRIDES, f"eval.checkpoint={a}",
           f"eval.compare_checkpoint={b}", f"eval.output={out}", f"trainer.output_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads(out.read_text())
    compare = json.loads((tmp_path / "result_compare.json").read_text())
    assert result["k"] == 2 and result["settings"]["checkpoint"] == str(a)
    assert compare["settings"]["checkpoint"] == str(b)
    assert result["settings"]["max_response_length"] == load_config(OVERRIDES).algo.max_response_length
    ids, hf_correct, hf_extracted = hf_greedy_answers(a)
    assert [p["id"] for p in result["problems"]] == ids == [p["id"] for p in compare["problems"]]
    for p, correct, extracted in zip(result["problems"], hf_correct, hf_extracted):
        assert p["k"] == 2 and p["pass_rate"] == p["correct"] / 2
        # greedy: both samples are HF's greedy answer, right or wrong alike
        assert p["correct"] == 2 * int(correct)
        assert p["sample_answers"] == [extracted, extracted]
    for r in (result, compare):
        assert r["avg_at_k"] == pytest.approx(sum(p["pass_rate"] for p in r["problems"]) / len(r["problems"]))
        assert r["pass_at_k"] == pytest.approx(sum(p["correct"] > 0 for p in r["problems"]) / len(r["problems"]))
    assert f"avg@2 = {result['avg_at_k']:.4f}" in proc.stdout and "largest differences" in proc.stdout
    paired = json.loads((tmp_path / "result_vs_result_compare_paired.json").read_text())["paired"]
    assert paired["difference"] == pytest.approx(compare["avg_at_k"] - result["avg_at_k"])
    assert paired["low"] <= paired["difference"] <= paired["high"] and "paired bootstrap interval" in proc.stdout


def test_seeded_evaluation_repeats_and_a_paired_comparison_of_one_model_with_itself_is_zero(tmp_path):
    """eval.seed: the same checkpoint and settings give the same per-problem results at
    temperature 1 (the requests carry seeds from (seed, problem id)); unseeded they vary; the
    paired bootstrap interval of a model against itself is exactly [0, 0], and against a
    shifted copy it brackets the shift."""
    import copy

    from dapo_mega.data import PromptEncoder, build_datasets
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.evaluate import evaluate_problems, paired_difference
    from dapo_mega.reward import build_verifier

    model = build_model(tmp_path / "model", seed=3)
    cfg = load_config([*OVERRIDES, "eval.temperature=1.0", "eval.n_samples=4", "eval.top_p=1.0"])
    _, problems, _ = build_datasets(cfg.data)
    problems = problems[:cfg.eval.max_problems]
    encoder, verifier = PromptEncoder.from_pretrained(model, cfg.data), build_verifier(cfg.algo.verifier)
    with EngineFleet(cfg.rollout, str(model), tmp_path / "logs", num_threads=1) as fleet:
        engines = fleet.start(1)
        first, second = (evaluate_problems(engines, problems, cfg, encoder, verifier) for _ in range(2))
        cfg.eval.seed = None
        unseeded = [evaluate_problems(engines, problems, cfg, encoder, verifier) for _ in range(2)]

    def answers(result):
        return [(p["id"], p["correct"], p["sample_answers"]) for p in result.problems]

    assert answers(first) == answers(second) and first.settings["seed"] == 0
    assert first.settings["eval_set_revision"] and first.settings["engine"].startswith("embedded")
    assert answers(unseeded[0]) != answers(unseeded[1]), "unseeded sampling repeated itself: the test shows nothing"
    assert paired_difference(first, second) == {"difference": 0.0, "low": 0.0, "high": 0.0, "level": 0.95,
                                                "problems": len(problems), "reps": 10_000}
    shifted = copy.deepcopy(first)
    for p in shifted.problems:
        p["pass_rate"] = min(1.0, p["pass_rate"] + 0.25) if p["id"] != problems[0].id else p["pass_rate"]
    paired = paired_difference(first, shifted)
    assert paired["low"] <= paired["difference"] <= paired["high"] and paired["difference"] > 0
