"""Multi-turn rounds: samples per second, one episode per sample against lock-step turns.

A multi-turn chunk's samples used to move in lock-step (issue #47): every turn waited for the
chunk's slowest tool call, then the samples that went on were one request, which waited for
the slowest generation, and the engine's batch shrank to the stragglers. Now each sample's
episode runs on its own (rollout/request.py `ChunkRequest._turns`): its tool, then its next
turn as its own request, which the engine batches with the others as they come.

    ratio = samples/s (one episode per sample) / samples/s (lock-step)      (> 1: faster)

Set-up: one embedded engine with a tiny random model, slowed to DECODE_MS per decode step
(`--test-decode-delay-ms`, a clock test hook: a 32B engine decodes ~30 tokens/s per sequence
and the python tool's runs take seconds, so tool and decode time keep their ratio), the
trainer's rollout manager and round. The environment's turns end at a few characters of the
tiny model's alphabet (turns of ~10-40 tokens, uneven as the random model writes them); each
call sleeps an uneven time (TOOL_S_RANGE, from a hash of the prompt, turn and the model's
text) and an episode ends after 1..MAX_CALLS calls (from a hash of the prompt and its first
turn): a slow tool and uneven turn counts. Both sides run the same prompts with the same
seeds on the same engine and the same manager settings; the lock-step side is today's round
with its chunk's turns driven the old way, rebuilt on the same `Episodes` steps (all tools
of the chunk at once, then one request of all the samples that go on). Sides alternate,
order reversed every other repeat; figures are the best repeat, spreads min/median/max.

    python bench/bench_episodes.py [--quick]
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "episodes.json"
QUICK = {"prompts": 4, "repeats": 2}
FULL = {"prompts": 16, "repeats": 3}
G = 8
DECODE_MS = 5
TOOL_S_RANGE = (0.05, 1.0)
MAX_CALLS = 5
BUDGET = 240
STOPS = "xyz"
"""Characters of the tiny model's alphabet a model turn ends at (the tool's call)."""


def _unit(*parts: object) -> float:
    """A number in [0, 1) from `parts` (the same on both sides for the same text)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def environment():
    from dapo_mega.environments.base import Environment, StepResult

    class UnevenTool(Environment):
        """A call sleeps TOOL_S_RANGE unevenly; an episode makes 1..MAX_CALLS calls."""

        stop = list(STOPS)

        def reset(self, problem):
            self.problem_id, self.calls, self.last = problem.id, 0, None

        def step(self, model_text: str) -> StepResult:
            if self.calls == 0:
                self.last = 1 + int(_unit("calls", self.problem_id, model_text) * MAX_CALLS)
            self.calls += 1
            low, high = TOOL_S_RANGE
            seconds = low + (high - low) * _unit("tool", self.problem_id, self.calls, model_text) ** 2
            time.sleep(seconds)
            return StepResult(observation=f"<{self.calls}>", done=self.calls >= self.last, tool_calls=1,
                              tool_time_s=seconds)

    return UnevenTool()


def lock_step_request():
    """Today's round with a chunk's turns in lock-step (the baseline): the ChunkRequest whose
    `_turns` runs every pending tool of the chunk, then one request of all that go on."""
    from dapo_mega.rollout.request import ChunkRequest
    from dapo_mega.rollout.turns import Episodes

    class LockStep(ChunkRequest):
        async def _turns(self, groups, replies, resume, bases):
            rnd, n = self.rnd, self.s.n_samples
            owners = resume.owners if resume is not None else [(q // n, q % n) for q in range(len(replies))]
            episodes = Episodes(self.s.environment, rnd.encoding, self.s.max_turns, groups, dict(zip(owners, replies)),
                                bases, groups[0].budget if groups else 0, tools=rnd.tools)
            pending = episodes.pending()
            while pending and not rnd.stopping.is_set():
                going = [st for st, on in zip(pending, await asyncio.gather(*(episodes.answer(st) for st in pending)))
                         if on]
                if not going:
                    break
                turns = [episodes.next_turn(st) for st in going]
                t1 = time.monotonic()
                replies = await self._generate([t.input for t in turns], [t.params for t in turns])
                pending = [st for st, reply in zip(going, replies)
                           if episodes.take(st, reply, self.url, time.monotonic() - t1)]
            return episodes.partial_groups(), replies

    return LockStep


def run_side(endpoints, encoder, prompts, lock_step: bool) -> Dict[str, float]:
    from dapo_mega.aio import run_coroutine
    from dapo_mega.rollout import round as rollout_round
    from dapo_mega.rollout.manager import RolloutManager, RoundSettings

    settings = RoundSettings(n_samples=G, sampling_params={"max_new_tokens": BUDGET, "temperature": 1.0},
                             environment=environment(), max_turns=MAX_CALLS + 1, prompts_per_request=4,
                             requests_per_engine=2, tool_slots=4 * G * 2, seed=7)
    mgr = RolloutManager(endpoints, settings, encoder)
    original = rollout_round.ChunkRequest
    rollout_round.ChunkRequest = lock_step_request() if lock_step else original

    async def one_round():
        async with mgr.round(prompts, 0) as rnd:
            async for _ in rnd:
                pass
        return rnd.outcome

    try:
        t0 = time.perf_counter()
        out = run_coroutine(one_round())
        seconds = time.perf_counter() - t0
    finally:
        rollout_round.ChunkRequest = original
    samples = [s for g in out.groups.values() for s in g.samples]
    if len(samples) != len(prompts) * G:
        raise RuntimeError(f"{len(samples)} samples of {len(prompts) * G}: {out.failures}")
    return {"seconds": seconds, "samples_per_s": len(samples) / seconds,
            "tool_calls": float(sum(s.tool_calls for s in samples)),
            "tool_s": float(sum(s.tool_time_s for s in samples)),
            "model_tokens": float(sum(len(s.token_ids) - sum(b - a for a, b in s.env_spans) for s in samples)),
            "turns_max": float(max(s.turns for s in samples))}


def run(quick: bool = False) -> Dict[str, Any]:
    from timing import spread, write_result

    from dapo_mega.config import DataConfig, RolloutConfig
    from dapo_mega.data import PromptEncoder
    from dapo_mega.data.problem import Problem
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.models.tiny import build_tiny_model_dir

    size = QUICK if quick else FULL
    model_dir = build_tiny_model_dir(Path(tempfile.mkdtemp(prefix="dapo_bench_episodes_")) / "tiny", seed=3)
    encoder = PromptEncoder.from_pretrained(model_dir, DataConfig(prompt_template="raw"))
    prompts = [Problem(id=f"e{i}", prompt=f"{i}+{i}=", ground_truth=str(2 * i), data_source="bench")
               for i in range(size["prompts"])]
    fleet = EngineFleet(RolloutConfig(extra_server_args=["--test-decode-delay-ms", str(DECODE_MS)],
                                      max_running_requests=256, health_timeout_s=120),
                        str(model_dir), num_threads=1, weight_version="0", extra_env={"DAPO_MEGA_TEST_CLOCK": "1"})
    endpoints = fleet.start(1)
    sides: Dict[str, List[Dict[str, float]]] = {"episodes": [], "lock_step": []}
    try:
        for r in range(size["repeats"]):
            for name in (("episodes", "lock_step") if r % 2 == 0 else ("lock_step", "episodes")):
                sides[name].append(run_side(endpoints, encoder, prompts, name == "lock_step"))
    finally:
        fleet.close()
    ours = [s["samples_per_s"] for s in sides["episodes"]]
    base = [s["samples_per_s"] for s in sides["lock_step"]]
    ratios = [o / b for o, b in zip(ours, base)]
    result = {"name": "episodes", "metric": "samples/s of a multi-turn round (higher is better)",
              "ours": max(ours), "baseline": max(base), "baseline_name": "lock-step turns (each turn waits for the "
              "chunk's slowest tool and generation)", "ratio": max(ours) / max(base),
              "ratio_median": sorted(ratios)[len(ratios) // 2], "ratio_spread": spread(ratios),
              "ours_spread": spread(ours), "baseline_spread": spread(base), "higher_is_better": True,
              "repeats": size["repeats"], "quick": quick, "prompts": size["prompts"], "group_size": G,
              "decode_ms": DECODE_MS, "tool_s_range": list(TOOL_S_RANGE), "max_calls": MAX_CALLS, "budget": BUDGET,
              "sides": sides,
              "note": "same prompts, seeds, engine and manager settings; figures: best of repeats"}
    write_result(RESULTS, result)
    return result


if __name__ == "__main__":
    sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent)]
    from timing import run_cli

    run_cli(run, __doc__)
