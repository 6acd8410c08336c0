"""Diagnostics of a run read back from its rollout ledger (`tools/ledger_report.py`).

    python tools/ledger_report.py outputs/tiny_cpu [--out DIR]

A rising reward curve proves nothing by itself (DESIGN.md "Records"); this report shows
what the seeds ask a person to look at before believing one:

* per step: all-correct and all-wrong group rates (groups with no gradient), response
  length mean / p50 / p90 / max and truncation rate, verifier exceptions, reject reasons;
* reward and pass rate by sample age bucket (asynchronous runs: is stale data worse?);
* a stratified sample of high-reward responses (per step bucket x length bucket) for a
  person to read for verifier exploits, with suspicious ones flagged:
  `near_empty` (no answer content, yet rewarded), `copied` (the same response text
  rewarded on many different prompts), `repeats_prompt` (the response restates the prompt).

It writes `ledger_report.md` (also printed), `ledger_report.png` and
`high_reward_sample.jsonl` into `--out` (default `<run_dir>/report/`).

Definitions (so the numbers can be checked by hand):
* A group is the samples of one prompt from one generation round of one step, keyed by
  (step, prompt_id, gen_round). It is all-correct when every sample is `correct`,
  all-wrong when none is, whatever the reject reason (so runs without dynamic sampling
  are diagnosed too).
* Verifier exceptions are ledger rows with reject reason `verifier_error`, plus, when
  `metrics.jsonl` is there, the trainer's `verifier/num_errors` per step (the ledger only
  marks errors inside kept groups).
* Age buckets are over every ledger row: 0, 1, 2 and 3+ versions behind the learner.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

AGE_BUCKETS = (0, 1, 2, 3)
"""Lower edges of the age buckets; the last one is open (3+)."""


@dataclass
class StepDiagnostics:
    """One step's ledger rows summarised."""

    step: int
    num_samples: int
    num_groups: int
    all_correct_group_rate: float
    all_wrong_group_rate: float
    reward_mean: float
    pass_rate: float
    length_mean: float
    length_p50: float
    length_p90: float
    length_max: int
    truncation_rate: float
    verifier_errors: int
    """Ledger rows with reject reason `verifier_error`."""
    metrics_verifier_errors: Optional[float] = None
    """`verifier/num_errors` of the step in metrics.jsonl (None when absent)."""
    reject_counts: Dict[str, int] = field(default_factory=dict)


@dataclass
class AgeBucketRow:
    label: str
    num_samples: int
    reward_mean: float
    pass_rate: float


@dataclass
class ReviewSample:
    """A high-reward response picked for a person to read."""

    step: int
    prompt_id: str
    gen_round: int
    sample_index: int
    reward: float
    response_length: int
    step_bucket: str
    length_bucket: str
    flags: List[str]
    prompt_text: str
    response_text: str


@dataclass
class LedgerReport:
    run_dir: str
    num_records: int
    steps: List[StepDiagnostics]
    ages: List[AgeBucketRow]
    reject_totals: Dict[str, int]
    num_high_reward: int
    flag_counts: Dict[str, int]
    sample: List[ReviewSample]
    suspicious: List[ReviewSample]


# ====================================================================== per step
def _group_key(r) -> Tuple[int, str, int]:
    return (int(r.step), str(r.prompt_id), int(r.gen_round))


def compute_step_diagnostics(records: Sequence, metrics_rows: Sequence[Dict] = ()) -> List[StepDiagnostics]:
    """One `StepDiagnostics` per step present in `records` (LedgerRecord-like objects)."""
    by_step: Dict[int, List] = defaultdict(list)
    for r in records:
        by_step[int(r.step)].append(r)
    verifier_errors_by_step = {int(row["step"]): row["verifier/num_errors"] for row in metrics_rows
                               if isinstance(row.get("verifier/num_errors"), (int, float))}
    out = []
    for step in sorted(by_step):
        rows = by_step[step]
        groups: Dict[Tuple, List[bool]] = defaultdict(list)
        for r in rows:
            groups[_group_key(r)].append(bool(r.correct))
        n_groups = len(groups)
        lengths = np.array([r.response_length for r in rows], dtype=np.float64)
        out.append(StepDiagnostics(
            step=step, num_samples=len(rows), num_groups=n_groups,
            all_correct_group_rate=sum(all(c) for c in groups.values()) / n_groups,
            all_wrong_group_rate=sum(not any(c) for c in groups.values()) / n_groups,
            reward_mean=float(np.mean([r.reward for r in rows])),
            pass_rate=float(np.mean([bool(r.correct) for r in rows])),
            length_mean=float(lengths.mean()), length_p50=float(np.percentile(lengths, 50)),
            length_p90=float(np.percentile(lengths, 90)), length_max=int(lengths.max()),
            truncation_rate=float(np.mean([bool(r.truncated) for r in rows])),
            verifier_errors=sum(1 for r in rows if r.reject_reason == "verifier_error"),
            metrics_verifier_errors=verifier_errors_by_step.get(step),
            reject_counts=dict(sorted(Counter(r.reject_reason for r in rows).items()))))
    return out


def age_label(age: int) -> str:
    last = AGE_BUCKETS[-1]
    return f"{last}+" if age >= last else str(max(age, 0))


def compute_age_buckets(records: Sequence) -> List[AgeBucketRow]:
    """Reward mean and pass rate per age bucket (buckets with no rows are left out)."""
    buckets: Dict[str, List] = defaultdict(list)
    for r in records:
        buckets[age_label(int(r.age))].append(r)
    out = []
    for lower in AGE_BUCKETS:
        label = age_label(lower)
        rows = buckets.get(label)
        if rows:
            out.append(AgeBucketRow(label, len(rows), float(np.mean([r.reward for r in rows])),
                                    float(np.mean([bool(r.correct) for r in rows]))))
    return out


# ====================================================================== exploit flags
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_ANSWER_PREFIX = re.compile(r"answer\s*:", re.IGNORECASE)


def normalize_text(text: str) -> str:
    """Lower case, whitespace collapsed: what 'the same text' means for the flags."""
    return " ".join(str(text).lower().split())


def is_near_empty(response_text: str, response_length: int) -> bool:
    """No answer content: at most one token (just EOS), or no letter/digit once LaTeX
    commands (`\\boxed`) and an `Answer:` prefix are removed (`\\boxed{}`, `Answer: $$`)."""
    if response_length <= 1:
        return True
    content = _ANSWER_PREFIX.sub("", _LATEX_COMMAND.sub("", str(response_text)))
    return not any(ch.isalnum() for ch in content)


def repeats_prompt(response_text: str, prompt_text: str, min_chars: int = 8, cover: float = 0.8) -> bool:
    """The response restates the prompt: the whole (normalised) prompt occurs in it, or a
    response of at least `min_chars` characters is mostly (`cover`) one block copied from
    the prompt."""
    resp, prompt = normalize_text(response_text), normalize_text(prompt_text)
    if not resp or not prompt:
        return False
    if len(prompt) >= min_chars and prompt in resp:
        return True
    if len(resp) < min_chars:
        return False
    match = SequenceMatcher(None, resp, prompt, autojunk=False).find_longest_match(0, len(resp), 0, len(prompt))
    return match.size >= cover * len(resp)


def flag_suspicious(records: Sequence, copy_min_prompts: int = 3, copy_min_chars: int = 8) -> List[List[str]]:
    """Flags per record (same order): `near_empty`, `copied`, `repeats_prompt`.

    `copied`: the normalised response text of at least `copy_min_chars` characters is
    shared by rewarded responses of at least `copy_min_prompts` different prompts (short
    answers such as "12" legitimately recur, hence the length floor).
    """
    prompts_of_text: Dict[str, set] = defaultdict(set)
    for r in records:
        prompts_of_text[normalize_text(r.response_text)].add(str(r.prompt_id))
    out = []
    for r in records:
        flags = []
        if is_near_empty(r.response_text, int(r.response_length)):
            flags.append("near_empty")
        text = normalize_text(r.response_text)
        if len(text) >= copy_min_chars and len(prompts_of_text[text]) >= copy_min_prompts:
            flags.append("copied")
        if repeats_prompt(r.response_text, r.prompt_text):
            flags.append("repeats_prompt")
        out.append(flags)
    return out


def _bucket_edges(values: Sequence[float], n: int) -> List[float]:
    """n - 1 inner quantile edges (duplicates removed)."""
    if n <= 1 or not values:
        return []
    return sorted(set(float(np.quantile(values, q)) for q in np.linspace(0, 1, n + 1)[1:-1]))


def _bucket_of(value: float, edges: Sequence[float]) -> int:
    return sum(1 for e in edges if value > e)


def sample_high_reward(records: Sequence, per_stratum: int = 2, n_step_buckets: int = 3,
                       n_length_buckets: int = 3, min_reward: Optional[float] = None, seed: int = 0,
                       copy_min_prompts: int = 3, copy_min_chars: int = 8
                       ) -> Tuple[List[ReviewSample], List[ReviewSample], int]:
    """(stratified sample, every flagged response, number of high-reward responses).

    High reward: `correct`, or reward >= `min_reward` when given. Steps are cut into
    `n_step_buckets` contiguous ranges of equal width, lengths into `n_length_buckets`
    quantile buckets of the high-reward responses; up to `per_stratum` responses are drawn
    per (step bucket, length bucket) with a seeded RNG, flagged ones first.
    """
    high = [r for r in records if (r.reward >= min_reward if min_reward is not None else bool(r.correct))]
    if not high:
        return [], [], 0
    flags = flag_suspicious(high, copy_min_prompts, copy_min_chars)
    steps = [int(r.step) for r in high]
    lo, hi = min(steps), max(steps)
    width = (hi - lo + 1) / max(n_step_buckets, 1)
    step_edges = [(lo + int(np.ceil(width * b)), lo + int(np.ceil(width * (b + 1))) - 1) for b in range(n_step_buckets)]
    length_edges = _bucket_edges([float(r.response_length) for r in high], n_length_buckets)
    length_bounds = [-np.inf, *length_edges, np.inf]

    def to_review(r, f) -> ReviewSample:
        sb = min(int((int(r.step) - lo) / width), n_step_buckets - 1)
        lb = _bucket_of(float(r.response_length), length_edges)
        a, b = step_edges[sb]
        l_lo, l_hi = length_bounds[lb], length_bounds[lb + 1]
        length_label = (f"<= {l_hi:g}" if lb == 0 else f"> {l_lo:g}" if lb == len(length_edges)
                        else f"({l_lo:g}, {l_hi:g}]") if length_edges else "all"
        return ReviewSample(step=int(r.step), prompt_id=str(r.prompt_id), gen_round=int(r.gen_round),
                            sample_index=int(r.sample_index), reward=float(r.reward),
                            response_length=int(r.response_length), step_bucket=f"{a}-{b}",
                            length_bucket=length_label, flags=list(f), prompt_text=str(r.prompt_text),
                            response_text=str(r.response_text))

    reviews = [to_review(r, f) for r, f in zip(high, flags)]
    strata: Dict[Tuple[int, int], List[ReviewSample]] = defaultdict(list)
    for r, rv in zip(high, reviews):
        strata[(min(int((int(r.step) - lo) / width), n_step_buckets - 1),
                _bucket_of(float(r.response_length), length_edges))].append(rv)
    rng = random.Random(seed)
    sample: List[ReviewSample] = []
    for key in sorted(strata):
        members = strata[key]
        flagged = [m for m in members if m.flags]
        plain = [m for m in members if not m.flags]
        rng.shuffle(flagged)
        rng.shuffle(plain)
        sample += (flagged + plain)[:per_stratum]
    suspicious = [rv for rv in reviews if rv.flags]
    return sample, suspicious, len(high)


# ====================================================================== the report
def build_report(run_dir: Path, per_stratum: int = 2, n_step_buckets: int = 3, n_length_buckets: int = 3,
                 min_reward: Optional[float] = None, seed: int = 0) -> LedgerReport:
    """Read `<run_dir>/ledger/` (and metrics.jsonl when there) and compute every table."""
    from dapo_mega.records import read_metrics
    from dapo_mega.rollout.ledger import read_records

    records = read_records(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir}: no ledger shards under {Path(run_dir) / 'ledger'}. Fix: pass a run "
                                "directory of `dapo-mega train` (outputs/<run_name>)")
    sample, suspicious, num_high = sample_high_reward(records, per_stratum, n_step_buckets, n_length_buckets,
                                                      min_reward, seed)
    return LedgerReport(run_dir=str(run_dir), num_records=len(records),
                        steps=compute_step_diagnostics(records, read_metrics(Path(run_dir))),
                        ages=compute_age_buckets(records),
                        reject_totals=dict(sorted(Counter(r.reject_reason for r in records).items())),
                        num_high_reward=num_high,
                        flag_counts=dict(sorted(Counter(f for rv in suspicious for f in rv.flags).items())),
                        sample=sample, suspicious=suspicious)


def _quote(text: str, limit: int = 160) -> str:
    text = str(text).replace("\n", "\\n").replace("|", "\\|")
    return text if len(text) <= limit else text[:limit] + "..."


def render_markdown(report: LedgerReport, max_suspicious: int = 50) -> str:
    lines = [f"# Ledger report: {report.run_dir}", "",
             f"{report.num_records} ledger rows, {len(report.steps)} steps, "
             f"{report.num_high_reward} high-reward responses.", "", "## Per step", "",
             "| step | samples | groups | all-correct | all-wrong | reward | pass | len mean | len p50 | len p90 "
             "| len max | trunc | verifier err (ledger / metrics) | reject reasons |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in report.steps:
        metric_err = "-" if s.metrics_verifier_errors is None else f"{s.metrics_verifier_errors:g}"
        reasons = ", ".join(f"{k} {v}" for k, v in s.reject_counts.items())
        lines.append(f"| {s.step} | {s.num_samples} | {s.num_groups} | {s.all_correct_group_rate:.3f} "
                     f"| {s.all_wrong_group_rate:.3f} | {s.reward_mean:+.3f} | {s.pass_rate:.3f} | {s.length_mean:.1f} "
                     f"| {s.length_p50:g} | {s.length_p90:g} | {s.length_max} | {s.truncation_rate:.3f} "
                     f"| {s.verifier_errors} / {metric_err} | {reasons} |")
    lines += ["", "## By sample age (versions behind the learner)", "",
              "| age | samples | reward mean | pass rate |", "|---|---:|---:|---:|"]
    lines += [f"| {a.label} | {a.num_samples} | {a.reward_mean:+.3f} | {a.pass_rate:.3f} |" for a in report.ages]
    lines += ["", "## Reject reasons (all steps)", "", "| reason | samples |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in report.reject_totals.items()]
    flag_text = ", ".join(f"{k} {v}" for k, v in report.flag_counts.items()) or "none"
    lines += ["", "## High-reward responses to read (stratified by step bucket x length bucket)", "",
              f"Suspicious among all {report.num_high_reward} high-reward responses: {flag_text}.", "",
              "| step bucket | length bucket | step | prompt | len | reward | flags | prompt text | response |",
              "|---|---|---:|---|---:|---:|---|---|---|"]
    for rv in report.sample:
        lines.append(f"| {rv.step_bucket} | {rv.length_bucket} | {rv.step} | {rv.prompt_id} | {rv.response_length} "
                     f"| {rv.reward:+.2f} | {' '.join(rv.flags)} | {_quote(rv.prompt_text, 60)} "
                     f"| {_quote(rv.response_text)} |")
    if report.suspicious:
        lines += ["", f"## Flagged responses (first {max_suspicious})", "",
                  "| step | prompt | flags | response |", "|---:|---|---|---|"]
        lines += [f"| {rv.step} | {rv.prompt_id} | {' '.join(rv.flags)} | {_quote(rv.response_text)} |"
                  for rv in report.suspicious[:max_suspicious]]
    return "\n".join(lines) + "\n"


def plot_report(report: LedgerReport, path: Path) -> Path:
    """Four panels: group rates, lengths + truncation, reject reasons, age buckets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in report.steps]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0, 0]
    ax.plot(steps, [s.all_correct_group_rate for s in report.steps], marker="o", label="all-correct groups")
    ax.plot(steps, [s.all_wrong_group_rate for s in report.steps], marker="o", label="all-wrong groups")
    ax.plot(steps, [s.pass_rate for s in report.steps], marker=".", label="pass rate")
    ax.set_title("group rates per step")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    for key in ("length_mean", "length_p50", "length_p90", "length_max"):
        ax.plot(steps, [getattr(s, key) for s in report.steps], marker=".", label=key)
    ax.set_title("response length (tokens)")
    twin = ax.twinx()
    twin.plot(steps, [s.truncation_rate for s in report.steps], "k--", label="truncation rate")
    twin.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="upper right")
    ax = axes[1, 0]
    bottom = np.zeros(len(steps))
    for reason in report.reject_totals:
        counts = np.array([s.reject_counts.get(reason, 0) for s in report.steps], dtype=np.float64)
        ax.bar(steps, counts, bottom=bottom, label=reason)
        bottom += counts
    ax.set_title("reject reasons per step (samples)")
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    x = np.arange(len(report.ages))
    ax.bar(x - 0.2, [a.pass_rate for a in report.ages], width=0.4, label="pass rate")
    ax.bar(x + 0.2, [a.reward_mean for a in report.ages], width=0.4, label="reward mean")
    ax.set_xticks(x, [f"{a.label}\n(n={a.num_samples})" for a in report.ages])
    ax.set_title("by sample age (versions)")
    ax.legend(fontsize=7)
    for a in axes.flat:
        a.set_xlabel("step" if a is not axes[1, 1] else "age")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_report(report: LedgerReport, out_dir: Path) -> Dict[str, Path]:
    """ledger_report.md, ledger_report.png, high_reward_sample.jsonl in `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "ledger_report.md"
    md.write_text(render_markdown(report))
    sample = out_dir / "high_reward_sample.jsonl"
    in_sample = {id(rv) for rv in report.sample}
    rows = report.sample + [rv for rv in report.suspicious if id(rv) not in in_sample]
    sample.write_text("".join(json.dumps({**asdict(rv), "in_sample": id(rv) in in_sample}) + "\n" for rv in rows))
    return {"markdown": md, "plot": plot_report(report, out_dir / "ledger_report.png"), "sample": sample}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Diagnostics of a dapo-mega run from its rollout ledger.")
    parser.add_argument("run_dir", type=Path, help="a run directory (outputs/<run_name>) holding ledger/")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default <run_dir>/report)")
    parser.add_argument("--per-stratum", type=int, default=2, help="responses drawn per (step, length) bucket")
    parser.add_argument("--step-buckets", type=int, default=3)
    parser.add_argument("--length-buckets", type=int, default=3)
    parser.add_argument("--min-reward", type=float, default=None,
                        help="high reward threshold (default: the verifier said correct)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        report = build_report(args.run_dir, args.per_stratum, args.step_buckets, args.length_buckets,
                              args.min_reward, args.seed)
    except FileNotFoundError as exc:
        print(f"ledger_report: {exc}")
        return 2
    paths = write_report(report, args.out or args.run_dir / "report")
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
