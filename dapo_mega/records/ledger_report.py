"""Diagnostics of a run read back from its rollout ledger (`tools/ledger_report.py`).

    python tools/ledger_report.py outputs/tiny_cpu [--steps 100:200] [--out DIR]

A rising reward curve proves nothing by itself (DESIGN.md "Records"); this report shows
what the seeds ask a person to look at before believing one:

* per step: all-correct and all-wrong group rates (groups with no gradient), response
  length mean / p50 / p90 / max and truncation rate, verifier exceptions, reject reasons;
* reward and pass rate by sample age bucket (asynchronous runs: is stale data worse?);
* a stratified sample of high-reward responses (per step bucket x length bucket) for a
  person to read for verifier exploits, with suspicious ones flagged:
  `near_empty` (no answer content, yet rewarded), `copied` (the same response text
  rewarded on many different prompts), `repeats_prompt` (the response restates the prompt);
* the config changes resumes of the run made (`config_history.jsonl`): a line listing them,
  and a dashed line at each step a field that shapes the data or the update changed.

It writes `ledger_report.md` (also printed), `ledger_report.png` and
`high_reward_sample.jsonl` into `--out` (default `<run_dir>/report/`).

It streams: `build_report` reads the shards of the selected steps (`--steps A:B`, both
ends included) one at a time, only the columns it needs, text one row group at a time,
and never holds the run's rows: its memory is one shard's numeric columns, one row group
of text, the per-step table, and 16 bytes per high-reward response of the selection (the
`copied` check). It reads each shard twice: the first pass finds the
step and length buckets and the copied texts, the second draws the sample. On rows read
into memory (`report_from_records`) the same code gives the same report.

Definitions (so the numbers can be checked by hand):
* A group is the samples of one prompt from one generation round of one step, keyed by
  (step, prompt_id, gen_round). It is all-correct when every sample is `correct`,
  all-wrong when none is, whatever the reject reason (so runs without dynamic sampling
  are diagnosed too).
* Verifier exceptions are ledger rows with reject reason `verifier_error`, plus, when
  `metrics.jsonl` is there, the trainer's `verifier/num_errors` per step (the ledger only
  marks errors inside kept groups).
* Age buckets are over every ledger row: 0, 1, 2 and 3+ versions behind the learner.
* The sample: within each stratum, flagged responses first, each list in the order of a
  seeded hash of the row's (step, prompt_id, gen_round, sample_index), so a row's draw
  does not depend on which other rows were read.
* Flags read the text the ledger holds (`trainer.ledger_text`): an elided response is
  flagged near-empty only by its length (<= 1 token), and is a copy of another when the
  stored heads, tails and lengths agree.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import re
from collections import Counter, defaultdict, namedtuple
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np

from dapo_mega.records.metrics import read_metrics
from dapo_mega.rollout.metrics import AGE_BUCKETS, age_label
from dapo_mega.rollout.samples import TRAINED_REASONS
from dapo_mega.run_files.identity import ConfigHistoryRow, history_of_current_run

MAX_FLAGGED = 1000
"""Flagged responses the streamed report keeps to list (`--max-flagged`); they are all counted."""


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
    response_text_elided: bool = False
    """response_text is the ledger's head and tail of the response, or empty (trainer.ledger_text)."""


@dataclass
class LedgerReport:
    run_dir: str
    num_records: int
    steps: List[StepDiagnostics]
    ages: List[AgeBucketRow]
    reject_totals: Dict[str, int]
    num_high_reward: int
    flag_counts: Dict[str, int]
    """Flags over every high-reward response (`suspicious` may list fewer)."""
    sample: List[ReviewSample]
    suspicious: List[ReviewSample]
    """Flagged high-reward responses in ledger order (the streamed report: the first `max_flagged`)."""
    elided_responses: int = 0
    """Rows whose response text the ledger holds elided or not at all."""
    step_range: str = "all"
    """The steps read: `A:B`, `A:`, `:B`, or all."""
    config_changes: List[ConfigHistoryRow] = field(default_factory=list)
    """What resumes of the run changed (`config_history.jsonl` lines: step, field, old, new,
    shapes_training), oldest first."""


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


class AgeTally:
    """Rows, reward sum and correct rows per age bucket of the samples trained on, added to
    row by row (in ledger order, so a streamed tally sums the same floats in the same order as
    one over all rows).

    Only trained rows count (kept groups): every age then passed the same filter. Over all
    rows, young samples include the uniform groups dynamic sampling rejects while old ones are
    mostly carried-over groups already selected for mixed outcomes, so age 1 looked far better
    than age 0 for a reason that has nothing to do with age."""

    def __init__(self):
        self.count: Counter = Counter()
        self.reward: Dict[str, float] = defaultdict(float)
        self.correct: Counter = Counter()

    def add(self, records: Iterable) -> None:
        for r in records:
            if r.reject_reason not in TRAINED_REASONS:
                continue
            label = age_label(int(r.age))
            self.count[label] += 1
            self.reward[label] += float(r.reward)
            self.correct[label] += bool(r.correct)

    def rows(self) -> List[AgeBucketRow]:
        """Reward mean and pass rate per age bucket (buckets with no rows are left out)."""
        labels = [age_label(lower) for lower in AGE_BUCKETS]
        return [AgeBucketRow(label, self.count[label], self.reward[label] / self.count[label],
                             self.correct[label] / self.count[label]) for label in labels if self.count[label]]


def compute_age_buckets(records: Sequence) -> List[AgeBucketRow]:
    """Reward mean and pass rate per age bucket (buckets with no rows are left out)."""
    tally = AgeTally()
    tally.add(records)
    return tally.rows()


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
    if len(resp) < min_chars or cover * len(resp) > len(prompt):  # no block of the prompt could cover it
        return False
    match = SequenceMatcher(None, resp, prompt, autojunk=False).find_longest_match(0, len(resp), 0, len(prompt))
    return match.size >= cover * len(resp)


def _digest(*parts: object) -> int:
    """64 bits of blake2b over `parts` (collisions among a run's texts: ~n² / 2^65)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(str(part).encode("utf-8", "surrogatepass") + b"\0")
    return int.from_bytes(h.digest(), "little")


class CopyIndex:
    """The prompts that rewarded each long normalised response text (`copied`), as 64-bit
    digests: the memory is 16 bytes per long response added, never the texts."""

    def __init__(self, copy_min_prompts: int = 3, copy_min_chars: int = 8):
        self.copy_min_prompts, self.copy_min_chars = copy_min_prompts, copy_min_chars
        self._pairs: List[np.ndarray] = []
        self._pending: List[Tuple[int, int]] = []
        self._copied: Optional[Set[int]] = None

    def text_digest(self, response_text: str) -> Optional[int]:
        """The digest a response's text is known by, None when too short to count as a copy."""
        text = normalize_text(response_text)
        return _digest(text) if len(text) >= self.copy_min_chars else None

    def add(self, response_text: str, prompt_id: str) -> None:
        digest = self.text_digest(response_text)
        if digest is not None:
            self._pending.append((digest, _digest(prompt_id)))
            if len(self._pending) >= 65536:
                self._compact()

    def _compact(self) -> None:
        if self._pending:
            self._pairs.append(np.unique(np.array(self._pending, dtype=np.uint64).reshape(-1, 2), axis=0))
            self._pending = []

    def copied_digests(self) -> Set[int]:
        """Digests of texts rewarded on at least copy_min_prompts different prompts."""
        if self._copied is None:
            self._compact()
            pairs = np.unique(np.concatenate(self._pairs), axis=0) if self._pairs else np.zeros((0, 2), np.uint64)
            texts, prompts = np.unique(pairs[:, 0], return_counts=True)
            self._copied = {int(t) for t in texts[prompts >= self.copy_min_prompts]}
        return self._copied

    def is_copied(self, response_text: str) -> bool:
        digest = self.text_digest(response_text)
        return digest is not None and digest in self.copied_digests()


def row_flags(r, copies: CopyIndex) -> List[str]:
    """The flags of one high-reward row (`near_empty`, `copied`, `repeats_prompt`), with
    `copies` indexed over every high-reward row of the report."""
    flags = []
    elided = bool(getattr(r, "response_text_elided", False))
    if int(r.response_length) <= 1 or (not elided and is_near_empty(r.response_text, int(r.response_length))):
        flags.append("near_empty")
    if copies.is_copied(r.response_text):
        flags.append("copied")
    if repeats_prompt(r.response_text, r.prompt_text):
        flags.append("repeats_prompt")
    return flags


def flag_suspicious(records: Sequence, copy_min_prompts: int = 3, copy_min_chars: int = 8) -> List[List[str]]:
    """Flags per record (same order): `near_empty`, `copied`, `repeats_prompt`.

    `copied`: the normalised response text of at least `copy_min_chars` characters is
    shared by rewarded responses of at least `copy_min_prompts` different prompts (short
    answers such as "12" legitimately recur, hence the length floor).
    """
    copies = CopyIndex(copy_min_prompts, copy_min_chars)
    for r in records:
        copies.add(r.response_text, str(r.prompt_id))
    return [row_flags(r, copies) for r in records]


# ====================================================================== the sample
def _bucket_edges(values: Sequence[float], n: int) -> List[float]:
    """n - 1 inner quantile edges (duplicates removed)."""
    if n <= 1 or not len(values):
        return []
    return sorted(set(float(np.quantile(values, q)) for q in np.linspace(0, 1, n + 1)[1:-1]))


def _bucket_of(value: float, edges: Sequence[float]) -> int:
    return sum(1 for e in edges if value > e)


def is_high_reward(r, min_reward: Optional[float]) -> bool:
    """`correct`, or reward >= `min_reward` when given."""
    return r.reward >= min_reward if min_reward is not None else bool(r.correct)


class HighRewardScan:
    """First pass over the high-reward rows: their steps, lengths and texts, which fix the
    step and length buckets and the copied texts before anything is drawn."""

    def __init__(self, copy_min_prompts: int = 3, copy_min_chars: int = 8):
        self.copies = CopyIndex(copy_min_prompts, copy_min_chars)
        self.lengths: Counter = Counter()
        """response_length -> rows (bounded by the length limit; the quantiles are exact)."""
        self.lo: Optional[int] = None
        self.hi: Optional[int] = None
        self.count = 0

    def add(self, r) -> None:
        step = int(r.step)
        self.lo = step if self.lo is None else min(self.lo, step)
        self.hi = step if self.hi is None else max(self.hi, step)
        self.lengths[int(r.response_length)] += 1
        self.copies.add(r.response_text, str(r.prompt_id))
        self.count += 1

    def sorted_lengths(self) -> np.ndarray:
        values = sorted(self.lengths)
        return np.repeat(np.array(values, dtype=np.float64), [self.lengths[v] for v in values])


class HighRewardSampler:
    """Second pass: each high-reward row's flags and stratum; keeps the `per_stratum` first
    of each stratum (flagged first, then by seeded hash) and the first `max_flagged`
    flagged rows, so its memory does not grow with the rows."""

    def __init__(self, scan: HighRewardScan, per_stratum: int = 2, n_step_buckets: int = 3,
                 n_length_buckets: int = 3, seed: int = 0, max_flagged: Optional[int] = None):
        self.scan, self.per_stratum, self.n_step_buckets, self.seed = scan, per_stratum, n_step_buckets, seed
        self.max_flagged = max_flagged
        lo, hi = scan.lo or 0, scan.hi or 0
        self.width = (hi - lo + 1) / max(n_step_buckets, 1)
        self.step_edges = [(lo + int(np.ceil(self.width * b)), lo + int(np.ceil(self.width * (b + 1))) - 1)
                           for b in range(n_step_buckets)]
        self.length_edges = _bucket_edges(scan.sorted_lengths(), n_length_buckets) if scan.count else []
        self.heaps: Dict[Tuple[int, int], List] = defaultdict(list)
        self.flagged: List[ReviewSample] = []
        self.flag_counts: Counter = Counter()
        self.seen = 0

    def _review(self, r, flags: List[str], sb: int, lb: int) -> ReviewSample:
        a, b = self.step_edges[sb]
        bounds = [-np.inf, *self.length_edges, np.inf]
        l_lo, l_hi = bounds[lb], bounds[lb + 1]
        length_label = (f"<= {l_hi:g}" if lb == 0 else f"> {l_lo:g}" if lb == len(self.length_edges)
                        else f"({l_lo:g}, {l_hi:g}]") if self.length_edges else "all"
        return ReviewSample(step=int(r.step), prompt_id=str(r.prompt_id), gen_round=int(r.gen_round),
                            sample_index=int(r.sample_index), reward=float(r.reward),
                            response_length=int(r.response_length), step_bucket=f"{a}-{b}",
                            length_bucket=length_label, flags=list(flags), prompt_text=str(r.prompt_text),
                            response_text=str(r.response_text),
                            response_text_elided=bool(getattr(r, "response_text_elided", False)))

    def add(self, r) -> None:
        flags = row_flags(r, self.scan.copies)
        self.flag_counts.update(flags)
        sb = min(int((int(r.step) - (self.scan.lo or 0)) / self.width), self.n_step_buckets - 1)
        lb = _bucket_of(float(r.response_length), self.length_edges)
        # Smallest (not flagged, hash, order) first; the heap keeps the per_stratum smallest.
        rank = (0 if flags else 1, _digest(self.seed, r.step, r.prompt_id, r.gen_round, r.sample_index), self.seen)
        self.seen += 1
        listed = bool(flags) and (self.max_flagged is None or len(self.flagged) < self.max_flagged)
        heap = self.heaps[(sb, lb)]  # a max-heap of the stratum's smallest ranks (negated)
        drawn = len(heap) < self.per_stratum or (bool(heap) and rank < _negated(heap[0][0]))
        if not (listed or drawn):
            return
        review = self._review(r, flags, sb, lb)  # one object in both lists (write_report lists it once)
        if listed:
            self.flagged.append(review)
        if drawn and len(heap) < self.per_stratum:
            heapq.heappush(heap, (_negated(rank), review))
        elif drawn:
            heapq.heapreplace(heap, (_negated(rank), review))

    def sample(self) -> List[ReviewSample]:
        """The drawn responses, stratum by stratum (sorted), each stratum in rank order."""
        out = []
        for key in sorted(self.heaps):
            out += [review for _, review in sorted(self.heaps[key], key=lambda item: _negated(item[0]))]
        return out


def _negated(rank: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(-x for x in rank)


def sample_high_reward(records: Sequence, per_stratum: int = 2, n_step_buckets: int = 3,
                       n_length_buckets: int = 3, min_reward: Optional[float] = None, seed: int = 0,
                       copy_min_prompts: int = 3, copy_min_chars: int = 8
                       ) -> Tuple[List[ReviewSample], List[ReviewSample], int]:
    """(stratified sample, every flagged response, number of high-reward responses).

    High reward: `correct`, or reward >= `min_reward` when given. Steps are cut into
    `n_step_buckets` contiguous ranges of equal width, lengths into `n_length_buckets`
    quantile buckets of the high-reward responses; up to `per_stratum` responses are drawn
    per (step bucket, length bucket), flagged ones first, each kind in the order of a hash
    of the row seeded with `seed`.
    """
    high = [r for r in records if is_high_reward(r, min_reward)]
    scan = HighRewardScan(copy_min_prompts, copy_min_chars)
    for r in high:
        scan.add(r)
    sampler = HighRewardSampler(scan, per_stratum, n_step_buckets, n_length_buckets, seed)
    for r in high:
        sampler.add(r)
    return sampler.sample(), sampler.flagged, scan.count


# ====================================================================== the report
def report_from_records(records: Sequence, metrics_rows: Sequence[Dict] = (), run_dir: str = "",
                        per_stratum: int = 2, n_step_buckets: int = 3, n_length_buckets: int = 3,
                        min_reward: Optional[float] = None, seed: int = 0, step_range: str = "all") -> LedgerReport:
    """The report of rows held in memory (LedgerRecord-like, in ledger order): every table
    at once. `build_report` streams the same tables from a run directory."""
    sample, suspicious, num_high = sample_high_reward(records, per_stratum, n_step_buckets, n_length_buckets,
                                                      min_reward, seed)
    return LedgerReport(run_dir=str(run_dir), num_records=len(records),
                        steps=compute_step_diagnostics(records, metrics_rows), ages=compute_age_buckets(records),
                        reject_totals=dict(sorted(Counter(r.reject_reason for r in records).items())),
                        num_high_reward=num_high,
                        flag_counts=dict(sorted(Counter(f for rv in suspicious for f in rv.flags).items())),
                        sample=sample, suspicious=suspicious,
                        elided_responses=sum(1 for r in records if getattr(r, "response_text_elided", False)),
                        step_range=step_range)


STEP_COLUMNS = ("step", "prompt_id", "gen_round", "correct", "reward", "response_length", "truncated",
                "reject_reason", "age", "response_text_elided")
"""What the per-step and age tables read: no text."""
SCAN_COLUMNS = ("step", "prompt_id", "correct", "reward", "response_length", "response_text")
SAMPLE_COLUMNS = ("step", "prompt_id", "gen_round", "sample_index", "correct", "reward", "response_length",
                  "response_text", "prompt_text", "response_text_elided")
_MISSING = {"response_text_elided": False}
"""Columns that shards written before them lack, and the value they stand for."""


@lru_cache(maxsize=None)
def _row_type(columns: Tuple[str, ...]):
    return namedtuple("LedgerRow", columns)


def iter_shard_rows(path: Path, columns: Sequence[str], batch_rows: Optional[int] = None) -> Iterator:
    """The rows of one shard as named tuples of `columns`, one row group (or `batch_rows`
    rows) read at a time."""
    import pyarrow.parquet as pq

    from dapo_mega.records import ledger  # read at call time: a test writes and reads smaller row groups

    shard = pq.ParquetFile(path)
    present = set(shard.schema_arrow.names)
    row = _row_type(tuple(columns))
    for batch in shard.iter_batches(batch_size=batch_rows or ledger.ROW_GROUP_ROWS, columns=[c for c in columns if c in present]):
        values = [batch.column(c).to_pylist() if c in present else [_MISSING[c]] * batch.num_rows for c in columns]
        for r in zip(*values):
            yield row(*r)


def parse_steps(text: Optional[str]) -> Tuple[Optional[int], Optional[int]]:
    """`A:B` (A to B, both included), `A:`, `:B`, `A` (one step) or None/'' (all)."""
    if not text:
        return None, None
    try:
        if ":" not in text:
            return int(text), int(text)
        first, last = text.split(":", 1)
        return (int(first) if first.strip() else None), (int(last) if last.strip() else None)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B, A:, :B or A (step numbers)") from None


def build_report(run_dir: Path, per_stratum: int = 2, n_step_buckets: int = 3, n_length_buckets: int = 3,
                 min_reward: Optional[float] = None, seed: int = 0, steps: Tuple[Optional[int], Optional[int]] =
                 (None, None), max_flagged: Optional[int] = MAX_FLAGGED) -> LedgerReport:
    """Stream `<run_dir>/ledger/` (the shards of `steps`, both ends included) and
    metrics.jsonl when there into every table (module docstring)."""
    from dapo_mega.records.ledger import ledger_dir, ledger_shards  # pyarrow, only when a report is built

    first, last = steps
    step_range = "all" if steps == (None, None) else f"{'' if first is None else first}:{'' if last is None else last}"
    shards = ledger_shards(run_dir, first, last)
    if not shards:
        where = "" if step_range == "all" else f" of steps {step_range}"
        raise FileNotFoundError(f"{run_dir}: no ledger shards{where} under {ledger_dir(run_dir)}. Fix: pass a run "
                                "directory of `dapo-mega train` (outputs/<run_name>)"
                                + ("" if step_range == "all" else " and a --steps range it has written"))
    metrics_rows = read_metrics(Path(run_dir))
    step_rows: List[StepDiagnostics] = []
    ages, rejects, num_records, elided = AgeTally(), Counter(), 0, 0
    scan = HighRewardScan()
    with_high: List[Path] = []
    for _, path in shards:  # pass 1: the tables, and what fixes the sample's buckets
        rows = list(iter_shard_rows(path, STEP_COLUMNS))
        diagnostics = compute_step_diagnostics(rows, metrics_rows)
        repeated = {d.step for d in diagnostics} & {d.step for d in step_rows}
        if repeated:  # a step's table needs all its rows at once: write_step puts them in one shard
            raise ValueError(f"{path}: rows of step {sorted(repeated)} are in another shard too (a shard holds one step)")
        step_rows += diagnostics
        ages.add(rows)
        rejects.update(r.reject_reason for r in rows)
        num_records += len(rows)
        elided += sum(1 for r in rows if r.response_text_elided)
        if any(is_high_reward(r, min_reward) for r in rows):
            with_high.append(path)
            for r in iter_shard_rows(path, SCAN_COLUMNS):
                if is_high_reward(r, min_reward):
                    scan.add(r)
    sampler = HighRewardSampler(scan, per_stratum, n_step_buckets, n_length_buckets, seed, max_flagged)
    for path in with_high:  # pass 2: flags and the draw
        for r in iter_shard_rows(path, SAMPLE_COLUMNS):
            if is_high_reward(r, min_reward):
                sampler.add(r)
    return LedgerReport(run_dir=str(run_dir), num_records=num_records, steps=sorted(step_rows, key=lambda d: d.step),
                        ages=ages.rows(), reject_totals=dict(sorted(rejects.items())), num_high_reward=scan.count,
                        flag_counts=dict(sorted(sampler.flag_counts.items())), sample=sampler.sample(),
                        suspicious=sampler.flagged, elided_responses=elided, step_range=step_range,
                        config_changes=history_of_current_run(Path(run_dir)))


def _quote(text: str, limit: int = 160) -> str:
    text = str(text).replace("\n", "\\n").replace("|", "\\|")
    return text if len(text) <= limit else text[:limit] + "..."


def config_changes_line(changes: Sequence[ConfigHistoryRow]) -> str:
    """The report's line on what resumes changed: guarded fields first (they were allowed by
    name, trainer.allow_changes), then the others."""
    def describe(c: ConfigHistoryRow) -> str:
        return f"step {c['step']}: {c['field']} {json.dumps(c['old'])} -> {json.dumps(c['new'])}"

    guarded = [describe(c) for c in changes if c.get("shapes_training")]
    other = [describe(c) for c in changes if not c.get("shapes_training")]
    if not changes:
        return "Config changes on resume (config_history.jsonl): none."
    return ("Config changes on resume (config_history.jsonl): shaping the data or the update (allowed by "
            f"trainer.allow_changes): {'; '.join(guarded) or 'none'}; other settings: {'; '.join(other) or 'none'}.")


def render_markdown(report: LedgerReport, max_suspicious: int = 50) -> str:
    steps = "" if report.step_range == "all" else f" (steps {report.step_range})"
    lines = [f"# Ledger report: {report.run_dir}", "",
             f"{report.num_records} ledger rows, {len(report.steps)} steps{steps}, "
             f"{report.num_high_reward} high-reward responses."]
    if report.elided_responses:
        lines += ["", f"{report.elided_responses} responses are held elided or not at all (trainer.ledger_text): "
                  "the flags read what the ledger holds, and judge such a response near-empty by its length only."]
    lines += ["", config_changes_line(report.config_changes)]
    lines += ["", "## Per step", "",
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
              "Samples trained on only (kept groups: every age passed the same filter, so the comparison is "
              "within kept groups, not matched on prompts).", "",
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
    from dapo_mega.records.curves import mark_config_changes

    mark_config_changes([axes[0, 0], axes[0, 1], axes[1, 0]], [c for c in report.config_changes
                                                               if c.get("shapes_training")])
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
    parser.add_argument("--steps", default=None,
                        help="steps to read: A:B (both included), A:, :B or A (default: all)")
    parser.add_argument("--max-flagged", type=int, default=MAX_FLAGGED,
                        help="flagged responses listed in high_reward_sample.jsonl (all are counted)")
    args = parser.parse_args(argv)
    try:
        steps = parse_steps(args.steps)
    except ValueError as exc:
        print(f"ledger_report: {exc}")
        return 2
    try:
        report = build_report(args.run_dir, args.per_stratum, args.step_buckets, args.length_buckets,
                              args.min_reward, args.seed, steps=steps, max_flagged=args.max_flagged)
    except FileNotFoundError as exc:
        print(f"ledger_report: {exc}")
        return 2
    paths = write_report(report, args.out or args.run_dir / "report")
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
