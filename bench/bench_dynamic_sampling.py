"""Dynamic-sampling waste: samples generated per sample trained, against the minimum.

DAPO's dynamic sampling (§3.2, Eq. 11) drops groups whose G rewards are all equal and
generates more until the train batch is full. Some over-generation is forced by the task:
a prompt whose per-sample accuracy is p gives an informative group (neither all correct
nor all wrong) with probability

    P_inf(p) = 1 - p^G - (1 - p)^G                                                 (1)

so at best one generates 1 / E_prompts[P_inf(p)] samples per sample kept.             (2)
Anything above that is waste of the implementation: informative groups generated but
never trained on (a surplus thrown away at the end of each step instead of carried over,
rounds larger than needed, ...). The benchmark runs a short real `dapo-mega train` (dynamic
sampling on, from the cached warm start of `bench_e2e_trl`) and reads its ledger:

    measured = samples generated / samples trained
             = (ledger rows + groups still carried at the end x G
                + tokens of aborted requests / mean response length) / rows of kept groups
    minimum  = Eq. (2) with the estimator below
    ratio    = minimum / measured      (1.0 = no waste beyond what the accuracy forces)

Estimator of E[P_inf]. A prompt i has n_i samples in the ledger (usually one group, n_i =
G) of which k_i are correct. Plugging p = k_i / n_i into (1) is biased (a group with 1 of 8
correct is informative, yet (1) at p = 1/8 gives 0.66). The unbiased estimator of p^G from
n >= G Bernoulli draws is the U-statistic C(k, G) / C(n, G) (E[C(K,G)] = C(n,G) p^G for
K ~ Binomial(n, p)), so

    P̂_inf,i = 1 - [C(k_i, G) + C(n_i - k_i, G)] / C(n_i, G)                          (3)

which for n_i = G is the indicator "this group was informative". E[P_inf] is the mean of
(3) over prompts weighted by their number of groups n_i / G; groups still carried at the
end (not in the ledger yet) are informative by construction and count with P̂ = 1. The
plug-in figure and the per-step pooled figure (one p per step: (1) at the step's accuracy,
which Jensen's inequality biases low for mixed difficulties) are reported beside it.

    python bench/bench_dynamic_sampling.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from math import comb
from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence, Tuple

from dapo_mega.rollout.samples import TRAINED_REASONS

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results" / "dynamic_sampling.json"


# ============================================================================ pure math
def p_informative(p: float, group_size: int) -> float:
    """Eq. (1): probability that G samples at accuracy p are neither all correct nor all wrong."""
    return 1.0 - p ** group_size - (1.0 - p) ** group_size


def informative_estimate(num_correct: int, num_samples: int, group_size: int) -> float:
    """Eq. (3): unbiased estimate of P_inf(p) from k correct of n >= G samples of one prompt."""
    if num_samples < group_size:
        raise ValueError(f"need at least G={group_size} samples, got {num_samples}")
    k, n, g = num_correct, num_samples, group_size
    return 1.0 - (comb(k, g) + comb(n - k, g)) / comb(n, g)


def minimum_samples_per_trained(prompts: Iterable[Tuple[int, int]], group_size: int,
                                extra_informative_groups: int = 0) -> float:
    """Eq. (2) with Eq. (3): 1 / E[P̂_inf] over prompts given as (correct, samples) pairs,
    weighted by their groups n/G, plus `extra_informative_groups` known-informative groups."""
    weight = float(extra_informative_groups)
    informative = float(extra_informative_groups)
    for k, n in prompts:
        w = n / group_size
        weight += w
        informative += w * informative_estimate(k, n, group_size)
    if informative <= 0:
        return float("inf")
    return weight / informative


def plugin_minimum(prompts: Iterable[Tuple[int, int]], group_size: int) -> float:
    """The biased plug-in figure: 1 / mean over groups of Eq. (1) at p = k/n."""
    weight = informative = 0.0
    for k, n in prompts:
        w = n / group_size
        weight += w
        informative += w * p_informative(k / n, group_size)
    return weight / informative if informative > 0 else float("inf")


def ledger_waste(rows: Sequence[Dict[str, Any]], group_size: int, carried_groups_at_end: int,
                 discarded_samples: int = 0) -> Dict[str, Any]:
    """Measured and minimum samples per trained sample from ledger rows.

    Args:
        rows: ledger records as dicts with step, prompt_id, correct, reject_reason.
        group_size: G.
        carried_groups_at_end: informative groups generated but not yet trained when the run
            ended (`rollout/carried_groups` of the last step); they are not in the ledger.
        discarded_samples: samples that finished after a streamed batch was full, discarded
            with their prompts put back (`rollout/discarded_samples` summed over steps); they
            are generated work that is no ledger row either.
    """
    groups: Dict[Tuple[int, str], List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["step"], r["prompt_id"])].append(r)
    trained = sum(len(g) for g in groups.values() if any(r["reject_reason"] in TRAINED_REASONS for r in g))
    generated = len(rows) + carried_groups_at_end * group_size + discarded_samples
    per_prompt: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    per_step: Dict[int, List[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        per_prompt[r["prompt_id"]][0] += int(bool(r["correct"]))
        per_prompt[r["prompt_id"]][1] += 1
        per_step[r["step"]][0] += int(bool(r["correct"]))
        per_step[r["step"]][1] += 1
    pairs = [(k, n) for k, n in per_prompt.values() if n >= group_size]
    minimum = minimum_samples_per_trained(pairs, group_size, carried_groups_at_end)
    # per step: every group of the step at the step's pooled accuracy
    pooled_weight = sum(n for _, n in per_step.values())
    pooled_inf = sum(n * p_informative(k / n, group_size) for k, n in per_step.values())
    measured = generated / trained if trained else float("inf")
    return {"samples_generated": generated, "samples_trained": trained, "ledger_rows": len(rows),
            "groups_in_ledger": len(groups), "carried_groups_at_end": carried_groups_at_end,
            "discarded_samples": discarded_samples,
            "distinct_prompts": len(per_prompt), "measured": measured, "minimum": minimum,
            "minimum_plugin": plugin_minimum(pairs, group_size),
            "minimum_per_step_pooled": pooled_weight / pooled_inf if pooled_inf > 0 else float("inf"),
            "accuracy": sum(k for k, _ in per_step.values()) / max(pooled_weight, 1),
            "ratio": minimum / measured if trained else float("nan")}


# ============================================================================ the run
QUICK = {"steps": 3}
FULL = {"steps": 20}


def run(quick: bool = False, keep_work: bool = False) -> Dict[str, Any]:
    from bench_e2e_trl import COMMON_OVERRIDES, ensure_warm_start, sizes_for

    from dapo_mega.records.ledger import read_ledger

    steps = (QUICK if quick else FULL)["steps"]
    overrides = COMMON_OVERRIDES + sizes_for(quick)["overrides"]
    warm = ensure_warm_start(overrides, quick)
    work = Path(tempfile.mkdtemp(prefix="dapo_bench_ds_"))
    argv = [sys.executable, "-m", "dapo_mega.cli", "train", *overrides, f"model.hf_path={warm['hf_dir']}",
            "trainer.sft_warmup_steps=0", f"trainer.total_steps={steps}", "trainer.eval_interval=0",
            f"trainer.save_interval={steps}", f"trainer.output_dir={work}", "trainer.run_name=ds",
            "trainer.resume=false", "algo.dynamic_sampling=true", "algo.max_num_gen_batches=0"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"dapo-mega train failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}")
        run_dir = work / "ds"
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        config = (run_dir / "config.yaml").read_text()
        from dapo_mega.config import from_yaml

        cfg = from_yaml(config)
        rows = read_ledger(run_dir).select(["step", "prompt_id", "correct", "reject_reason",
                                            "response_length"]).to_pylist()
        last = max(metrics, key=lambda m: m["step"])
        waste = ledger_waste(rows, cfg.algo.n_samples_per_prompt, int(last.get("rollout/carried_groups", 0)),
                             int(sum(m.get("rollout/discarded_samples", 0) for m in metrics)))
        # Requests aborted once a batch was full (synchronous streaming) are no ledger rows; their
        # partial tokens count here as samples of the mean completed length.
        aborted_tokens = sum(m.get("rollout/aborted_tokens", 0) for m in metrics)
        mean_length = sum(r["response_length"] for r in rows) / max(len(rows), 1)
        waste["aborted_samples"] = sum(m.get("rollout/aborted_samples", 0) for m in metrics)
        waste["aborted_tokens"] = aborted_tokens
        waste["aborted_sample_equivalents"] = aborted_tokens / mean_length if mean_length else 0.0
        waste["measured_completed_only"] = waste["measured"]
        waste["measured"] = (waste["samples_generated"] + waste["aborted_sample_equivalents"]) / \
            waste["samples_trained"]
        waste["ratio"] = waste["minimum"] / waste["measured"]
        from_metrics = sum(m.get("rollout/groups_generated", 0) for m in metrics) * cfg.algo.n_samples_per_prompt
    finally:
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)
    result = {"name": "dynamic_sampling", "metric": "samples generated / trained (lower is better)",
              "ours": waste["measured"], "baseline": waste["minimum"],
              "baseline_name": "minimum the group accuracy allows, 1/E[P_inf]", "ratio": waste["ratio"],
              "higher_is_better": True, "quick": quick, "steps": steps, "group_size": cfg.algo.n_samples_per_prompt,
              "train_batch_size": cfg.algo.train_batch_size, "gen_batch_size": cfg.algo.gen_batch_size,
              "samples_generated_from_metrics": from_metrics, "warm_start": warm, **waste,
              "run_seconds": time.perf_counter() - t0,
              "note": "ratio = minimum / measured: 1.0 means no generation beyond what the accuracy forces"}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH_DIR))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep-work", action="store_true")
    a = ap.parse_args()
    print(json.dumps(run(a.quick, a.keep_work), indent=2))
