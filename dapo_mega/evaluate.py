"""Held-out evaluation: avg@k with the training verifier and length limit.

avg@k = mean over problems of (correct samples / k), k samples per problem at the
configured temperature / top-p (AIME protocol: k = 32, T = 1.0, top-p 0.7). The trainer
calls `evaluate_problems` through its own engines; `dapo-mega eval` starts engines of the
configured `rollout.backend` (through the engine fleet, as the trainer does) for one or two
checkpoints (HF directories, or Megatron checkpoints exported to HF first) and compares them
on the same problems, prompt encoding, length limit and verifier:

    dapo-mega eval eval.checkpoint=outputs/run/checkpoints/latest
    dapo-mega eval eval.checkpoint=A eval.compare_checkpoint=B eval.output=cmp.json

Comparisons repeat: requests are seeded (`eval.seed`, per problem), so a checkpoint scores
the same twice and two checkpoints meet the same random numbers; a comparison reports B - A
with a paired bootstrap interval over problems (`paired_difference`); the settings record
the eval set's revision, the engine, the seed and the verifier's version; each checkpoint's
result has its own file (`eval_<run>_<step>.json` under the run's eval/ unless eval.output).

Several sets: the unnamed one (data.eval_path, or the synthetic held-out split; metrics
`eval/avg_at_k`) and the named ones of `eval.sets` (`eval/<name>/avg_at_k`, each with its own
k and length limit, its own result file `<stem>_<name>.json`), evaluated on the same engines
and shown side by side, one row per set, with a paired comparison per set:

    dapo-mega eval eval.checkpoint=A '+eval.sets={aime_2025:{path:data/aime_2025.parquet}}'
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, TypedDict, Union

from dapo_mega import log
from dapo_mega.config import ConfigError, DapoConfig, EngineKind
from dapo_mega.engines.book import EngineBook
from dapo_mega.engines.sglang.endpoint import EngineAddress
from dapo_mega.run_files.checkpoints import write_text_atomic

logger = log.get(__name__)

if TYPE_CHECKING:
    from dapo_mega.data import EvalSet, Problem
    from dapo_mega.reward.types import Verifier
    from dapo_mega.rollout.samples import PromptEncoding


class ProblemOutcome(TypedDict):
    """One problem's line of an evaluation: its k samples' verdicts and answers."""

    id: str
    ground_truth: str
    correct: int
    """Samples the verifier found correct."""
    k: int
    pass_rate: float
    truncated: int
    """Samples cut by the length limit."""
    sample_answers: List[Optional[str]]
    """The answers the verifier read in the first 4 samples (None: none)."""


@dataclass
class EvalResult:
    """Per-problem pass rates of one model."""

    k: int
    problems: List[ProblemOutcome] = field(default_factory=list)
    """[{id, ground_truth, correct: int, k, pass_rate, truncated, sample_answers, response_lengths}]"""
    settings: Dict[str, object] = field(default_factory=dict)
    engines: Dict[str, Dict[str, int]] = field(default_factory=dict)
    """url -> {requests, samples} the engine completed for this evaluation."""
    dead_engines: Dict[str, str] = field(default_factory=dict)
    """url -> why the evaluation found the engine dead (its prompts went to the others)."""
    name: str = ""
    """The eval set: "" for the unnamed one (data.eval_path), else its key in eval.sets."""

    def engine_line(self) -> str:
        """`requests/samples per engine: e0 4/128, e1 4/128` (engines in their order)."""
        parts = [f"e{i} {v['requests']}/{v['samples']}" + (" (dead)" if url in self.dead_engines else "")
                 for i, (url, v) in enumerate(self.engines.items())]
        return "requests/samples per engine: " + ", ".join(parts)

    @property
    def avg_at_k(self) -> float:
        return sum(p["pass_rate"] for p in self.problems) / max(len(self.problems), 1)

    @property
    def pass_at_k(self) -> float:
        return sum(1 for p in self.problems if p["correct"] > 0) / max(len(self.problems), 1)

    @property
    def label(self) -> str:
        """The set's name in tables: its key in eval.sets, `eval` for the unnamed set."""
        return self.name or "eval"

    def metrics(self) -> Dict[str, float]:
        """`eval/avg_at_k`, ... for the unnamed set; `eval/<name>/avg_at_k`, ... for a named one."""
        prefix = f"eval/{self.name}/" if self.name else "eval/"
        return {f"{prefix}avg_at_k": self.avg_at_k, f"{prefix}pass_at_k": self.pass_at_k,
                f"{prefix}num_problems": float(len(self.problems)), f"{prefix}k": float(self.k)}

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, json.dumps({
            "name": self.name, "avg_at_k": self.avg_at_k, "pass_at_k": self.pass_at_k, "k": self.k,
            "settings": self.settings, "engines": self.engines, "dead_engines": self.dead_engines,
            "problems": self.problems}, indent=1))


def evaluate_problems(engines: Union[EngineBook, Sequence[EngineAddress]], problems: Sequence[Problem],
                      cfg: DapoConfig, encoding: PromptEncoding, verifier: Verifier, run_id: str = "",
                      n_samples: Optional[int] = None, max_response_length: Optional[int] = None) -> EvalResult:
    """k samples per problem on the engines, scored by `verifier` with the training length limit;
    `run_id`: the run whose model this is (in the settings), when known; `n_samples` /
    `max_response_length`: an eval set's own k and limit (None: eval.n_samples, and
    eval.max_response_length or the training limit)."""
    from dapo_mega.aio import run_coroutine
    from dapo_mega.reward import score_groups
    from dapo_mega.rollout.manager import RolloutManager

    book = engines if isinstance(engines, EngineBook) else EngineBook(engines)
    manager = RolloutManager.from_config(cfg, book, "eval", encoding, run_id=run_id, n_samples=n_samples,
                                         max_response_length=max_response_length)
    e, samples_per_problem = cfg.eval, manager.settings.n_samples
    max_len = manager.settings.sampling_params["max_new_tokens"]
    groups = run_coroutine(manager.generate_groups(list(problems)))
    scored = score_groups(verifier, groups, cfg.algo, cfg.data.prompt_template)
    from dapo_mega.data.problem import compute_dataset_revision

    result = EvalResult(k=samples_per_problem, settings={"temperature": e.temperature, "top_p": e.top_p,
                                                 "max_response_length": max_len, "verifier": verifier.name,
                                                 "verifier_version": verifier.version, "run_id": run_id,
                                                 "seed": e.seed, "num_problems": len(problems),
                                                 "eval_set_revision": compute_dataset_revision(list(problems)),
                                                 "engine": engine_identity(cfg),
                                                 # the weight versions that produced its tokens (one,
                                                 # unless weights changed during the evaluation)
                                                 "weight_versions": sorted(
                                                     {v for g in groups for s in g.samples
                                                      for v in (s.policy_version_min, s.policy_version_max)})},
                        engines={url: {"requests": manager.requests_by_engine.get(url, 0),
                                       "samples": manager.samples_by_engine.get(url, 0)}
                                 for url in book.urls},
                        dead_engines=book.dead())
    unjudged = int((~scored.verdict).sum())
    if unjudged:  # avg@k is a share of correct answers: a bare score is no verdict (reward/returns.py)
        logger.warning(f"[eval] the reward gave no verdict for {unjudged} of {len(scored.verdict)} samples (a bare "
                       "score): avg@k counts them as not correct. Fix: return a bool, or a dict with 'acc'")
    k = 0
    for g in groups:
        correct = truncated = 0
        answers = []
        for s in g.samples:
            correct += int(bool(scored.correct[k]))
            truncated += int(s.truncated)
            answers.append(scored.extracted[k])
            k += 1
        result.problems.append({"id": g.prompt.id, "ground_truth": g.prompt.ground_truth, "correct": correct,
                                "k": len(g.samples), "pass_rate": correct / max(len(g.samples), 1),
                                "truncated": truncated, "sample_answers": answers[:4],
                                "response_lengths": [len(s.token_ids) for s in g.samples]})
    return result


def evaluate_set(engines: Union[EngineBook, Sequence[EngineAddress]], eval_set: EvalSet, cfg: DapoConfig,
                 encoding: PromptEncoding, verifier: Verifier, run_id: str = "") -> EvalResult:
    """`evaluate_problems` on one `EvalSet` (data/build.py) with its k and length limit; on the
    run's engine book, an engine it finds dead is lost to the training rounds too."""
    result = evaluate_problems(engines, eval_set.problems, cfg, encoding, verifier, run_id=run_id,
                               n_samples=eval_set.n_samples, max_response_length=eval_set.max_response_length)
    result.name = eval_set.name
    result.settings["eval_set"] = eval_set.name
    return result


def engine_identity(cfg: DapoConfig) -> str:
    """The engine that generated: `sglang <version>` (the release the API is pinned to) or
    `embedded dapo-mega <version>`."""
    from importlib.metadata import PackageNotFoundError, version

    if cfg.rollout.backend == EngineKind.SGLANG:
        from dapo_mega.engines.sglang.api import SGLANG_VERSION_READ

        return f"sglang {SGLANG_VERSION_READ}"
    try:
        return f"embedded dapo-mega {version('dapo-mega')}"
    except PackageNotFoundError:
        return "embedded dapo-mega"


def result_name(checkpoint: str) -> str:
    """File stem of a checkpoint's result: `eval_<run>_<step dir>` from its last two path parts,
    so evaluating another checkpoint does not overwrite this one's."""
    parts = [p for p in Path(checkpoint).resolve().parts[-2:] if p not in ("/", "")]
    return "eval_" + "_".join("".join(c if c.isalnum() or c in "-." else "_" for c in p) for p in parts)


def paired_difference(a: EvalResult, b: EvalResult, reps: int = 10_000, seed: int = 0,
                      level: float = 0.95) -> Dict[str, float]:
    """B's avg@k minus A's on the problems both scored, with a percentile bootstrap interval
    over problems (the pairs resampled together, seeded): {difference, low, high, level,
    problems, reps}. Pairing removes the problems' own difficulty from the spread."""
    import numpy as np

    by_id = {p["id"]: p["pass_rate"] for p in b.problems}
    pairs = [(p["pass_rate"], by_id[p["id"]]) for p in a.problems if p["id"] in by_id]
    if not pairs:
        raise ValueError("the two results share no problem: nothing to compare")
    d = np.array([pb - pa for pa, pb in pairs])
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(reps, len(d)))].mean(axis=1)
    tail = (1 - level) / 2
    return {"difference": float(d.mean()), "low": float(np.quantile(means, tail)),
            "high": float(np.quantile(means, 1 - tail)), "level": level, "problems": len(d), "reps": reps}


def _hf_dir_of(checkpoint: str, workdir: Path) -> Path:
    """An HF directory for `checkpoint`: itself, or a Megatron checkpoint exported to HF."""
    path = Path(checkpoint)
    if (path / "config.json").exists():
        return path
    from dapo_mega.weights.convert import export_megatron_checkpoint

    out = workdir / f"hf_{abs(hash(str(path.resolve()))) % 10**8}"
    export_megatron_checkpoint(path, out)
    return out


def evaluate_checkpoint(cfg: DapoConfig, checkpoint: str, workdir: Path) -> List[EvalResult]:
    """Start `rollout.num_engines` engines of `rollout.backend` serving `checkpoint` (logs in
    `<run_dir>/logs/eval/`; on GPUs each on its own GPUs of this node by the device rule, more
    than fit refused: `EngineFleet.start_on_this_node`), evaluate every eval set (the unnamed
    one first), stop them."""
    from dapo_mega.data import PromptEncoder, build_run_datasets
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.reward import build_verifier
    from dapo_mega.run_files.identity import run_id_of_path

    hf_dir = _hf_dir_of(checkpoint, workdir)
    _, eval_sets, _ = build_run_datasets(cfg.data, cfg.eval)
    if not any(s.problems for s in eval_sets):
        raise ConfigError("data.eval_path: no held-out problems to evaluate. Fix: set data.eval_path or eval.sets")
    encoder = PromptEncoder.from_pretrained(hf_dir, cfg.data)  # the trainer's encoder (chat template included)
    verifier = build_verifier(cfg.algo.verifier, cfg.algo.reward_kwargs)

    from dapo_mega.plan.clock import resolve_health_timeout_s

    with EngineFleet(cfg.rollout, str(hf_dir), cfg.run_dir / "logs" / "eval", device=cfg.cluster.device,
                     start_timeout_s=resolve_health_timeout_s(cfg)) as fleet:
        endpoints = fleet.start_on_this_node("dapo-mega eval")  # engine i on its own GPUs of this node
        book = EngineBook(endpoints)  # an engine lost on one set is not given the next
        results = [evaluate_set(book, eval_set, cfg, encoder, verifier,
                                run_id=run_id_of_path(checkpoint)) for eval_set in eval_sets]
    for result in results:
        result.settings["checkpoint"] = str(checkpoint)
    return results


def sets_table(a: Sequence[EvalResult], b: Optional[Sequence[EvalResult]] = None,
               paired: Optional[Sequence[Dict[str, float]]] = None) -> str:
    """One row per eval set: problems, k, A's avg@k and pass@k, and with a comparison B's and
    B - A of avg@k with its paired bootstrap interval (`paired[i]` for set i)."""
    head = f"{'set':16s} {'problems':>8s} {'k':>4s} {'A avg@k':>9s} {'A pass@k':>9s}"
    if b is not None:
        head += f" {'B avg@k':>9s} {'B pass@k':>9s} {'B - A':>8s}  paired bootstrap interval"
    lines = [head]
    for i, ra in enumerate(a):
        line = f"{ra.label:16s} {len(ra.problems):8d} {ra.k:4d} {ra.avg_at_k:9.4f} {ra.pass_at_k:9.4f}"
        if b is not None and paired is not None:
            rb, d = b[i], paired[i]
            line += (f" {rb.avg_at_k:9.4f} {rb.pass_at_k:9.4f} {d['difference']:+8.4f}  "
                     f"{d['level']:.0%} [{d['low']:+.4f}, {d['high']:+.4f}]")
        lines.append(line)
    return "\n".join(lines)


def compare_results(a: EvalResult, b: EvalResult, paired: Optional[Dict[str, float]] = None) -> str:
    """A side-by-side table: overall avg@k, the problems where the two differ most, and B - A
    with its paired bootstrap interval (`paired`: `paired_difference(a, b)`, computed if not given)."""
    by_id = {p["id"]: p for p in b.problems}
    lines = [f"{'':30s} {'A':>10s} {'B':>10s}",
             f"{'avg@' + str(a.k):30s} {a.avg_at_k:10.4f} {b.avg_at_k:10.4f}",
             f"{'pass@' + str(a.k):30s} {a.pass_at_k:10.4f} {b.pass_at_k:10.4f}", "", "largest differences:"]
    diffs = sorted(((by_id[p["id"]]["pass_rate"] - p["pass_rate"], p["id"]) for p in a.problems if p["id"] in by_id),
                   key=lambda t: -abs(t[0]))
    for delta, pid in diffs[:10]:
        lines.append(f"  {pid:28s} {by_id[pid]['pass_rate'] - delta:10.3f} {by_id[pid]['pass_rate']:10.3f}")
    paired = paired or paired_difference(a, b)
    lines += ["", f"B - A: {paired['difference']:+.4f} avg@{a.k}, {paired['level']:.0%} paired bootstrap interval "
              f"[{paired['low']:+.4f}, {paired['high']:+.4f}] over {paired['problems']} problems"]
    return "\n".join(lines)


def _set_path(out: Path, result: EvalResult) -> Path:
    """The unnamed set's result file is `out`; a named set's `<stem>_<name><suffix>` beside it."""
    return out.with_name(f"{out.stem}_{result.name}{out.suffix}") if result.name else out


def run_eval_command(cfg: DapoConfig) -> int:
    """`dapo-mega eval`: one checkpoint's avg@k on every eval set, or two compared on the same problems."""
    if not cfg.eval.checkpoint:
        print("dapo-mega eval: set eval.checkpoint=PATH (an HF directory, a Megatron checkpoint, or a run "
              "directory), and optionally eval.compare_checkpoint=PATH")
        return 2
    named = Path(cfg.eval.output) if cfg.eval.output else None  # else one file per checkpoint
    out = named or cfg.run_dir / "eval" / f"{result_name(cfg.eval.checkpoint)}.json"
    with tempfile.TemporaryDirectory(prefix="dapo_mega_eval_") as tmp:
        a = evaluate_checkpoint(cfg, cfg.eval.checkpoint, Path(tmp))
        for r in a:
            path = r.write(_set_path(out, r))
            print(f"{r.label}: avg@{r.k} = {r.avg_at_k:.4f} (pass@{r.k} = {r.pass_at_k:.4f}) on {len(r.problems)} "
                  f"problems -> {path}\n{r.engine_line()}")
        if not cfg.eval.compare_checkpoint:
            print(sets_table(a))
            return 0
        b = evaluate_checkpoint(cfg, cfg.eval.compare_checkpoint, Path(tmp))
        b_out = out.with_name((f"{out.stem}_compare" if named else result_name(cfg.eval.compare_checkpoint))
                              + out.suffix)
        paired = [paired_difference(ra, rb) for ra, rb in zip(a, b)]
        for ra, rb, d in zip(a, b, paired):
            rb.write(_set_path(b_out, rb))
            print(f"\n[{ra.label}]\n{compare_results(ra, rb, d)}")
        print("\n" + sets_table(a, b, paired))
        comparison = out.with_name(f"{out.stem}_vs_{b_out.stem}_paired{out.suffix}")
        comparison.write_text(json.dumps({"a": str(cfg.eval.checkpoint), "b": str(cfg.eval.compare_checkpoint),
                                          "avg_at_k": [a[0].avg_at_k, b[0].avg_at_k], "paired": paired[0],
                                          "settings": a[0].settings,
                                          "sets": {ra.label: {"avg_at_k": [ra.avg_at_k, rb.avg_at_k], "paired": d,
                                                              "settings": ra.settings}
                                                   for ra, rb, d in zip(a, b, paired)}}, indent=1))
    return 0
