"""Partial rollouts: tokens generated per token trained, partial vs abort, side by side.

When a streamed (synchronous) step's batch is full, the requests still in flight are
aborted. Without partial rollouts their tokens are thrown away and their prompts generated
again from scratch; with `rollout.partial_rollout` (rollout/partial.py) their samples so far
are carried and resumed by the next step. The waste is measured where it is paid, on the
engine: its own count of sampled tokens (`/server_info` num_generated_tokens, every token of
every request: aborted, discarded, rejected or trained) over the tokens of the samples the
steps trained on:

    waste = engine tokens generated / tokens of the trained samples        (1 = none wasted)
    ratio = waste(abort) / waste(partial)                                   (> 1: partial wastes less)

Set-up (the rollout manager and dynamic sampling of the trainer, on one embedded engine with a
tiny random model): prompts are chain-task problems (data.synthetic_task=chain) with 2..12
operands, and each response is as long as the problem's worked solution in tokens (15..139,
median 68: the length range the task asks for; `ignore_eos` and the request's max_new_tokens
stand in for a model that stops there, as a random model never does). Rewards are a fixed
coin per (prompt, sample) (half correct), so dynamic sampling keeps ~7/8 of the groups of 4.
Both sides run the same steps (same prompts, same seeds), the age limit 1 (a resumed sample
is one version old), the engine's weight version bumped after each step as by a weight sync;
they alternate, the order reversed every other repeat. The samples still carried when the
partial side's last step ends count as waste (they would be trained by a later step).

    python bench/bench_partial_rollout.py [--quick]
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "partial_rollout.json"
QUICK = {"steps": 3, "repeats": 2}
FULL = {"steps": 10, "repeats": 3}
G, TRAIN_BATCH, GEN_BATCH = 4, 16, 16
BUDGET = 160
"""Response budget (max_response_length): above the longest worked solution."""


@dataclass
class Feed:
    """A step's StepInputs (rollout/dynamic_sampling.py): chain problems in a fixed order, coin rewards."""

    draw: Callable[[int], list]
    score: Callable[[list], list]


def coin(prompt_id: str, sample_index: int) -> bool:
    """The fixed reward of one sample: correct for 1 in 5 (prompt, sample) pairs."""
    return hashlib.sha256(f"{prompt_id}:{sample_index}".encode()).digest()[0] < 51


def chain_items(tokenizer, count: int) -> List[Any]:
    """(prompt item with token ids and its response length) of `count` chain problems."""
    from dapo_mega.data import generate_synthetic_problems, reference_response

    problems, _ = generate_synthetic_problems(count, 0, min_digits=1, max_digits=2, num_operands=12, task="chain",
                                              seed=7)
    return [(p, tokenizer.encode(p.prompt), len(tokenizer.encode(reference_response(p)))) for p in problems]


def run_side(url: str, items, partial: bool, steps: int) -> Dict[str, float]:
    """`steps` steps of one side on the engine at `url`: tokens generated and trained, counts."""
    from dapo_mega.aio import run_coroutine
    from dapo_mega.engines.sglang.client import EngineClient
    from dapo_mega.reward import SampleReward
    from dapo_mega.rollout.manager import RolloutManager, RoundSettings, SamplingRule

    lengths = {p.id: n for p, _, n in items}
    ids = {p.id: tokens for p, tokens, _ in items}

    @dataclass(frozen=True)
    class ChainSettings(RoundSettings):
        def params_for(self, prompts, step, gen_round):  # each response as long as its worked solution
            return [{**params, "max_new_tokens": lengths[p.id]}
                    for p, params in zip(prompts, super().params_for(prompts, step, gen_round))]

    class TokenIds:
        @staticmethod
        def encode(prompt):  # a PromptEncoding
            return ids[prompt.id]

    async def engine(call):
        async with EngineClient(url) as c:
            return await call(c)

    cursor = [0]

    def draw(k):
        out = [items[(cursor[0] + i) % len(items)][0] for i in range(k)]
        cursor[0] += k
        return out

    def score(groups):
        return [[SampleReward(1.0 if coin(g.prompt_id, s.sample_index) else -1.0, coin(g.prompt_id, s.sample_index))
                 for s in g.samples] for g in groups]

    settings = ChainSettings(n_samples=G, sampling_params={"ignore_eos": True, "max_new_tokens": BUDGET,
                                                           "temperature": 1.0},
                             prompts_per_request=1, requests_per_engine=8, seed=11, partial_rollout=partial)
    mgr = RolloutManager([url], settings, TokenIds())
    run_coroutine(engine(lambda c: c.update_weight_version("0")))
    before = run_coroutine(engine(lambda c: c._request("GET", "/server_info")))["num_generated_tokens"]
    trained, totals = 0, {}
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        kept, _ = mgr.collect_step(step=step, learner_version=step - 1, inputs=Feed(draw, score),
                                   rule=SamplingRule(TRAIN_BATCH, GEN_BATCH, max_staleness=1, stream=True))
        trained += sum(len(s.token_ids) for g in kept for s in g.samples)
        for k, v in mgr.metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        run_coroutine(engine(lambda c, v=str(step): c.update_weight_version(v)))  # the weight sync
    seconds = time.perf_counter() - t0
    generated = run_coroutine(engine(lambda c: c._request("GET", "/server_info")))["num_generated_tokens"] - before
    return {"generated_tokens": generated, "trained_tokens": trained, "waste": generated / trained,
            "seconds": seconds, "carried_tokens_at_end": float(mgr.metrics.get("rollout/partial_tokens", 0)),
            **{k: totals.get(f"rollout/{k}", 0.0) for k in (
                "aborted_requests", "aborted_tokens", "discarded_tokens", "resumed_groups", "resumed_tokens",
                "partial_stale_groups", "groups_generated")}}


def run(quick: bool = False) -> Dict[str, Any]:
    from provenance import git_state, machine_info
    from timing import spread, write_result
    from transformers import AutoTokenizer

    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.models.tiny import build_tiny_model_dir

    size = QUICK if quick else FULL
    model_dir = build_tiny_model_dir(Path(tempfile.mkdtemp(prefix="dapo_bench_partial_")) / "tiny", seed=3)
    items = chain_items(AutoTokenizer.from_pretrained(model_dir), 400)
    fleet = EngineFleet(RolloutConfig(max_running_requests=64), str(model_dir), num_threads=1, weight_version="0")
    fleet.start(1)
    sides: Dict[str, List[Dict[str, float]]] = {"partial": [], "abort": []}
    try:
        url = fleet.engines[0].url
        for r in range(size["repeats"]):
            for name in (("partial", "abort") if r % 2 == 0 else ("abort", "partial")):
                sides[name].append(run_side(url, items, name == "partial", size["steps"]))
    finally:
        fleet.close()
    ours = [s["waste"] for s in sides["partial"]]
    base = [s["waste"] for s in sides["abort"]]
    ratios = [b / o for b, o in zip(base, ours)]
    result = {"name": "partial_rollout", "metric": "engine tokens generated / token trained (lower is better)",
              "ours": min(ours), "baseline": min(base), "baseline_name": "abort (rollout.partial_rollout=false)",
              "ratio": min(base) / min(ours), "ratio_median": sorted(ratios)[len(ratios) // 2],
              "ratio_spread": spread(ratios), "ours_spread": spread(ours), "baseline_spread": spread(base),
              "higher_is_better": True, "repeats": size["repeats"], "steps": size["steps"], "quick": quick,
              "group_size": G, "train_batch_size": TRAIN_BATCH, "budget": BUDGET,
              "lengths": {"min": min(n for *_, n in items), "max": max(n for *_, n in items)},
              "sides": sides, **git_state(), "machine": machine_info(),
              "note": "ratio = waste(abort) / waste(partial) (figures: best of repeats; spreads min/median/max)"}
    write_result(RESULTS, result)
    return result


if __name__ == "__main__":
    sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent)]
    from timing import run_cli

    run_cli(run, __doc__)
