"""The rollout ledger: one row per generated sample, one parquet shard per step.

`<run_dir>/ledger/step_00000012.parquet` holds every sample generated or consumed in step
12 (kept or rejected, with the reason), with the fields of DESIGN.md "Records". A shard is
written to a temporary file and renamed, so a crash never leaves half a shard, and
rewriting a step after a resume replaces its shard instead of duplicating rows.

A row is read off a `ScoredSample` (rollout/samples.py) by `ledger_record`, field by field
under the same names.

At scale (the 32B recipe generates 24,576 responses per dynamic-sampling round, up to
20,480 tokens each) the text columns are most of a shard. `LedgerText`
(`trainer.ledger_text`) keeps them whole, keeps the head and the tail of long ones (the
answer is at the end of a response) or leaves them out; either way a row records the
text's length in characters and whether the stored text is all of it. The ledger holds no
token ids or log-probs (only `response_length`), so nothing else grows with the response.
Shards are zstd-compressed and written in row groups of `ROW_GROUP_ROWS` rows, so a reader
can stream one row group of text at a time (`dapo_mega.records.ledger_report`).
`ledger_bytes_per_step` estimates a shard's size from the config (`dapo-mega plan`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, get_args

import pyarrow as pa
import pyarrow.parquet as pq

from dapo_mega.config import AlgoConfig, DapoConfig, LedgerTextMode, TrainerConfig, routed_experts_every
from dapo_mega.rollout.samples import ScoredSample
from dapo_mega.run_files.checkpoints import atomic_path

REJECT_REASONS = ("kept", "all_correct_group", "all_wrong_group", "stale", "verifier_error",
                  "surplus_carried", "aborted")
LEDGER_TEXT_MODES = get_args(LedgerTextMode)
"""Values of `trainer.ledger_text`: full, head_tail, none."""
COMPRESSION = "zstd"
ROW_GROUP_ROWS = 2048
"""Rows per parquet row group: what a streaming reader decompresses at once (2,048 whole
20,480-token responses are ~150 MB of text; head_tail at 2,048 chars, ~4 MB)."""


@dataclass
class LedgerRecord:
    run_id: str
    step: int
    prompt_id: str
    dataset_revision: str
    sample_index: int
    seed: Optional[int]
    """`sampling_seed` of the request that produced the sample (the embedded engine seeds
    sample j of a request with seed + j); None when the run sets no seed."""
    policy_version_min: int
    """Oldest weight version that produced a token of this sample (engine spans)."""
    policy_version_max: int
    learner_version: int
    """Version of the learner that consumed (or rejected) the sample."""
    age: int
    """learner_version - policy_version_min."""
    engine_id: str
    queue_delay_s: float
    generation_latency_s: float
    response_length: int
    truncated: bool
    """The engine stopped the response at the length limit (about generation, not about
    what the ledger stores: see response_text_elided)."""
    reward: float
    correct: Optional[bool]
    """The reward's verdict; null when it gave none (a bare score: `reward/returns.py`)."""
    reward_components: str
    """JSON object of the reward's parts (correctness, overlong penalty, ...)."""
    verifier: str
    verifier_version: str
    reject_reason: str
    response_text: str
    """The response as decoded, or its head and tail (response_text_elided)."""
    prompt_text: str
    gen_round: int = 0
    response_text_chars: Optional[int] = None
    """Characters of the whole response text (None when built: len(response_text))."""
    response_text_elided: bool = False
    """response_text is not all of the response: its head and tail around an elision
    marker (trainer.ledger_text=head_tail) or empty (none)."""
    prompt_text_chars: Optional[int] = None
    """Characters of the whole prompt text (None when built: len(prompt_text))."""
    prompt_text_elided: bool = False
    """prompt_text is not all of the prompt (as response_text_elided)."""
    run_name: str = ""
    """trainer.run_name: shared by reruns and by ablation runs of one seed; `run_id` is unique."""
    extracted_answer: Optional[str] = None
    """The answer the verifier read from the response (normalised), None when it found none."""
    answer_found: Optional[bool] = None
    """The format verdict: the verifier found an answer to judge (DAPO: an `Answer:` line)."""
    verifier_error: Optional[str] = None
    """The verifier's error text when it raised or timed out (the row's reward is then -1)."""
    encoder: str = ""
    """What the model was given (`PromptEncoder.fingerprint`: prompt template, chat-template
    hash, tokenizer): a template change shows here, prompt_text being the problem before it."""
    weight_versions: str = ""
    """The sample's `weight_versions` as JSON: spans {"version", "start", "end"}, response tokens
    [start, end) came from weight `version` (a partial rollout resumed under newer weights has
    several)."""
    routed_experts: Optional[str] = None
    """A mixture of experts, with `trainer.ledger_routed_experts`: the experts the engine routed
    each token to, as the sample carries them (`rollout.samples.compact_routed_experts`: "u8:"
    or "u16:" + base64 of [positions, layers, top_k]; `backends.megatron.routing.
    decode_routed_experts` reads it); null for samples the engine did not report."""
    turns: int = 1
    """The model's turns (multi-turn samples, rollout/turns.py); 1 without an environment."""
    env_tokens: int = 0
    """Tokens of the response the environment wrote (in the context, masked from the loss)."""
    env_spans: str = ""
    """JSON [[start, end], ...]: the response tokens the environment wrote ("" when none)."""
    tool_calls: int = 0
    tool_errors: str = ""
    """JSON object: the environment's errors by kind (timeout, memory, ...); "" when none."""
    tool_time_s: float = 0.0
    tool_log: str = ""
    """JSON [{"turn", "name", "arguments", "output", "error"}, ...]: every tool call of the episode,
    the turn that made it, what the model read back and the error kind ("" when it ran); ""
    when none. Its tokens are the env_spans of the response."""

    def __post_init__(self):
        # Rows of shards written before these columns existed read back as nulls: whole texts.
        if self.response_text_chars is None:
            self.response_text_chars = len(self.response_text)
        if self.prompt_text_chars is None:
            self.prompt_text_chars = len(self.prompt_text)
        self.response_text_elided = bool(self.response_text_elided)
        self.run_name = self.run_name or ""
        self.encoder = self.encoder or ""
        self.weight_versions = self.weight_versions or ""
        self.prompt_text_elided = bool(self.prompt_text_elided)
        self.turns = 1 if self.turns is None else self.turns
        self.env_tokens, self.tool_calls = self.env_tokens or 0, self.tool_calls or 0
        self.env_spans, self.tool_errors = self.env_spans or "", self.tool_errors or ""
        self.tool_time_s = self.tool_time_s or 0.0
        self.tool_log = self.tool_log or ""


_TYPES = {int: pa.int64(), float: pa.float64(), bool: pa.bool_(), str: pa.string(),
          "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string(),
          "Optional[int]": pa.int64(), "Optional[str]": pa.string(), "Optional[bool]": pa.bool_()}
SCHEMA = pa.schema([(f.name, _TYPES[f.type]) for f in fields(LedgerRecord)])
TEXT_COLUMNS = ("response_text", "prompt_text", "tool_log")


def elision_marker(num_chars: int) -> str:
    """What stands in for the `num_chars` characters left out of the middle of a text."""
    return f"\n[... {num_chars} chars elided ...]\n"


@dataclass(frozen=True)
class LedgerText:
    """What the ledger keeps of each prompt and response text (`trainer.ledger_text`).

    full: the whole text. head_tail: a text longer than `max_chars` keeps its first
    max_chars // 2 and its last max_chars - max_chars // 2 characters, joined by
    `elision_marker` (it names how many were left out). none: no text (prompt_id and
    dataset_revision still say which prompt it was)."""

    mode: str = "full"
    max_chars: int = 2048
    routed_experts: bool = False
    """Keep a mixture's routed experts too (`trainer.ledger_routed_experts`)."""

    def __post_init__(self):
        if self.mode not in LEDGER_TEXT_MODES:
            raise ValueError(f"ledger text mode {self.mode!r} is not one of {LEDGER_TEXT_MODES}")

    @classmethod
    def of(cls, trainer_cfg: TrainerConfig) -> "LedgerText":
        """The setting of a TrainerConfig (trainer.ledger_text, ledger_text_max_chars, ledger_routed_experts)."""
        return cls(trainer_cfg.ledger_text, trainer_cfg.ledger_text_max_chars, trainer_cfg.ledger_routed_experts)

    def keep(self, text: str) -> Tuple[str, bool]:
        """(the text to store, whether it is not all of `text`)."""
        if self.mode == "none":
            return "", bool(text)
        if self.mode == "full" or len(text) <= self.max_chars:
            return text, False
        head = self.max_chars // 2
        tail = self.max_chars - head
        return text[:head] + elision_marker(len(text) - head - tail) + text[len(text) - tail:], True

    def tool_log(self, calls: List[Dict[str, Any]]) -> str:
        """The ledger's `tool_log` of an episode's calls: each output kept as a text is, the
        arguments and outputs left out with mode none (the name, turn and error stay)."""
        if not calls:
            return ""
        if self.mode == "none":
            return json.dumps([{k: v for k, v in c.items() if k not in ("arguments", "output")} for c in calls])
        return json.dumps([{**c, "output": self.keep(str(c.get("output", "")))[0]} for c in calls])


FULL_TEXT = LedgerText()


def ledger_record(sample: ScoredSample, run_id: str, text: LedgerText = FULL_TEXT,
                  run_name: str = "", encoder: str = "") -> LedgerRecord:
    """The ledger row of a sample that has been scored and stamped by its consumer; its
    texts as `text` keeps them; `run_id` unique to the run, `run_name` its trainer.run_name,
    `encoder` the prompt encoder's fingerprint."""
    response_text, response_elided = text.keep(sample.response_text)
    prompt_text, prompt_elided = text.keep(sample.prompt_text)
    return LedgerRecord(
        run_id=run_id, step=sample.step, prompt_id=sample.prompt_id, dataset_revision=sample.dataset_revision,
        sample_index=sample.sample_index, seed=sample.seed, policy_version_min=sample.policy_version_min,
        policy_version_max=sample.policy_version_max, learner_version=sample.learner_version, age=sample.age,
        engine_id=sample.engine_id, queue_delay_s=sample.queue_delay_s,
        generation_latency_s=sample.generation_latency_s, response_length=sample.response_length,
        truncated=sample.truncated, reward=sample.reward, correct=sample.correct,
        reward_components=json.dumps(sample.score.components()), verifier=sample.score.verifier,
        verifier_version=sample.score.verifier_version, reject_reason=sample.reject_reason,
        response_text=response_text, prompt_text=prompt_text, gen_round=sample.gen_round,
        response_text_chars=len(sample.response_text), response_text_elided=response_elided,
        prompt_text_chars=len(sample.prompt_text), prompt_text_elided=prompt_elided, run_name=run_name,
        extracted_answer=sample.score.extracted, answer_found=sample.score.extracted is not None,
        verifier_error=sample.score.verifier_error, encoder=encoder,
        weight_versions=json.dumps([{"version": str(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
                                    for s in sample.weight_versions]),
        routed_experts=sample.routed_experts if text.routed_experts else None, turns=sample.turns,
        env_tokens=sample.env_tokens, env_spans=json.dumps(sample.env_spans) if sample.env_spans else "",
        tool_calls=sample.tool_calls, tool_errors=json.dumps(sample.tool_errors) if sample.tool_errors else "",
        tool_time_s=sample.tool_time_s, tool_log=text.tool_log(sample.tool_log))


def ledger_dir(run_dir: os.PathLike) -> Path:
    return Path(run_dir) / "ledger"


def shard_path(run_dir: os.PathLike, step: int) -> Path:
    return ledger_dir(run_dir) / f"step_{step:08d}.parquet"


def ledger_shards(run_dir: os.PathLike, first: Optional[int] = None, last: Optional[int] = None
                  ) -> List[Tuple[int, Path]]:
    """(step, path) of the run's shards with first <= step <= last (None: unbounded), in
    step order; the step is read off the file name, no shard is opened."""
    out = []
    for path in ledger_dir(run_dir).glob("step_*.parquet"):
        step = int(path.stem.split("_")[1])
        if (first is None or step >= first) and (last is None or step <= last):
            out.append((step, path))
    return sorted(out)


def prepare_writer() -> None:
    """Load what the first `write_step` would load (pyarrow imports pandas on its first
    array, ~0.3 s): the driver calls this at start-up, not inside its first step."""
    pa.array([0], type=pa.int64())


def write_step(run_dir: os.PathLike, step: int, records: Sequence[LedgerRecord]) -> Path:
    """Write (or replace) the shard of `step` atomically: zstd, ROW_GROUP_ROWS rows per row
    group, built one row group at a time (a step's rows are never all in one table)."""
    path = shard_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    for r in records:
        if r.step != step:
            raise ValueError(f"record of step {r.step} written into step {step}")
        if r.reject_reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {r.reject_reason!r}")
    # Unique texts gain nothing from a dictionary (it overflows and falls back anyway), and
    # min/max statistics of texts would copy whole texts into the footer.
    dictionary = [name for name in SCHEMA.names if name != "response_text"]
    statistics = [name for name in SCHEMA.names if name not in TEXT_COLUMNS]
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, SCHEMA, compression=COMPRESSION, use_dictionary=dictionary,
                                                    write_statistics=statistics) as writer:
        for start in range(0, len(records), ROW_GROUP_ROWS):
            chunk = records[start:start + ROW_GROUP_ROWS]
            # Column by column: `asdict` deep-copies every field of every row (most of a step's driver time).
            writer.write_table(pa.Table.from_pydict({name: [getattr(r, name) for r in chunk] for name in SCHEMA.names},
                                                    schema=SCHEMA), row_group_size=ROW_GROUP_ROWS)
    return path


def read_ledger(run_dir: os.PathLike, steps: Optional[Sequence[int]] = None) -> pa.Table:
    """All shards of a run (or of `steps`), concatenated in step order. Columns a shard
    predates read back as nulls (LedgerRecord fills them in)."""
    paths = [p for _, p in ledger_shards(run_dir)]
    if steps is not None:
        wanted = {shard_path(run_dir, s).name for s in steps}
        paths = [p for p in paths if p.name in wanted]
    if not paths:
        return SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(p, schema=SCHEMA) for p in paths])


def read_records(run_dir: os.PathLike, steps: Optional[Sequence[int]] = None) -> List[LedgerRecord]:
    """Every row of `read_ledger` as a LedgerRecord: for tests and small runs (the report
    streams instead, `dapo_mega.records.ledger_report`)."""
    return [LedgerRecord(**row) for row in read_ledger(run_dir, steps).to_pylist()]


# ====================================================================== size estimate
CHARS_PER_TOKEN = 3.7
"""Characters per token of math reasoning text (Qwen2.5's tokenizer on English + LaTeX:
~3.5-4)."""
TEXT_COMPRESSION = 3.0
"""zstd (pyarrow's default level) on reasoning text: 3.25x measured on the tests' synthetic
math text (words, products, LaTeX); English prose is typically 2.5-3.5x."""
ROW_BYTES = 40.0
"""Compressed bytes of a row's other columns and its share of the footer: ~14 numbers (two
float timings are most of it) and a few short repeated strings (ids, reject reason, reward
parts as JSON); ~30-35 measured on shards of 512 rows."""


def ledger_responses_per_step(algo_cfg: AlgoConfig, rounds: int = 1) -> int:
    """Ledger rows of a step that takes `rounds` generation rounds: every round sends
    algo.gen_batch_size prompts of algo.n_samples_per_prompt responses, each one a row
    (kept or rejected). The bound is rounds = algo.max_num_gen_batches (when > 0)."""
    return int(algo_cfg.gen_batch_size) * int(algo_cfg.n_samples_per_prompt) * int(rounds)


def ledger_bytes_per_step(responses_per_step: float, mean_response_tokens: float, *, text: str = "full",
                          text_max_chars: int = 2048, group_size: int = 16, prompt_tokens: float = 150.0,
                          chars_per_token: float = CHARS_PER_TOKEN, text_compression: float = TEXT_COMPRESSION,
                          row_bytes: float = ROW_BYTES, routed_bytes_per_token: float = 0.0) -> float:
    """Estimated bytes of one step's ledger shard.

        bytes = N · (row_bytes + C(mean_response_tokens) / text_compression
                 + R · (prompt_tokens + mean_response_tokens))
              + (N / group_size) · C(prompt_tokens) / text_compression

    with N = responses_per_step (`ledger_responses_per_step`: dynamic sampling's rounds
    included) and C(t) the characters stored of a text of t tokens: t · chars_per_token for
    text="full"; min(that, text_max_chars + ~30 for the marker) for "head_tail"; 0 for
    "none". Assumptions:
    * A prompt's text costs once per group: its group_size rows repeat it next to each
      other and parquet's dictionary encoding stores it once per row group.
    * head_tail applies min() to the mean length, not to each response: min is concave,
      so with a spread of lengths this is an upper bound (by Jensen).
    * row_bytes and text_compression default to ROW_BYTES and TEXT_COMPRESSION; on shards
      of synthetic math text the estimate is 0.96-1.11x the written bytes (the tests hold
      it within 1.5x); real reasoning text may compress differently.
    * UTF-8 takes one byte per character (math text is nearly all ASCII).
    * R = routed_bytes_per_token: a mixture's routed experts kept (`routed_experts_bytes_per_token`),
      uncompressed (expert indices are close to random bytes); 0 when they are not kept.
    """
    if text not in LEDGER_TEXT_MODES:
        raise ValueError(f"text {text!r} is not one of {LEDGER_TEXT_MODES}")

    def stored_chars(tokens: float) -> float:
        chars = tokens * chars_per_token
        if text == "none":
            return 0.0
        if text == "head_tail":
            return min(chars, text_max_chars + len(elision_marker(int(chars))))
        return chars

    n = float(responses_per_step)
    routed = routed_bytes_per_token * (prompt_tokens + mean_response_tokens)
    return (n * (row_bytes + stored_chars(mean_response_tokens) / text_compression + routed)
            + n / max(group_size, 1) * stored_chars(prompt_tokens) / text_compression)


def routed_experts_bytes_per_token(num_layers: int, top_k: int, num_experts: int, reported_share: float) -> float:
    """Bytes per token of a mixture's routed experts in the ledger: base64 (4/3) of a byte per
    choice (two above 256 experts) over every layer, times the share of samples the engines
    report (all with routing replay, else one request in checks.router_agreement_every)."""
    width = 1 if num_experts <= 256 else 2
    return 4.0 / 3.0 * num_layers * top_k * width * reported_share


def ledger_bytes_per_step_of(cfg: DapoConfig, mean_response_tokens: float, prompt_tokens: float = 150.0,
                             rounds: int = 1, shape=None) -> float:
    """`ledger_bytes_per_step` of a DapoConfig: its rows per step (`rounds` generation rounds;
    algo.max_num_gen_batches is the bound), group size and trainer.ledger_text setting; with
    trainer.ledger_routed_experts and a mixture's `shape` (models.shape.ModelShape), its
    routed experts."""
    routed = 0.0
    if cfg.trainer.ledger_routed_experts and shape is not None and shape.is_moe:
        every = routed_experts_every(cfg)
        share = 1.0 / every if every > 0 else 0.0
        routed = routed_experts_bytes_per_token(shape.num_layers, shape.num_experts_per_tok, shape.num_experts, share)
    return ledger_bytes_per_step(ledger_responses_per_step(cfg.algo, rounds), mean_response_tokens,
                                 text=cfg.trainer.ledger_text, text_max_chars=cfg.trainer.ledger_text_max_chars,
                                 group_size=cfg.algo.n_samples_per_prompt, prompt_tokens=prompt_tokens,
                                 routed_bytes_per_token=routed)
