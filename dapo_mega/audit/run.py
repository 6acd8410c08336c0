"""`dapo-mega audit`: roll a policy out on N fixed training prompts and write the sheet.

The pieces are the trainer's: the model directory (`session.model_dir_of`, the tiny model
built as a run would build it), the engines (`EngineFleet` of `rollout.backend`), the prompt
encoder, the training sampling parameters and length limit, the rollout manager with
`trainer.seed` (each request's `sampling_seed` from `request_seed`, which the embedded engine
honours), and the verifier with its reward composition. What is added: the seeded choice of
prompts, the second verifier, the patterns and the picks (`audit.patterns`), the sheet
(`audit.sheet`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, TypeVar

from dapo_mega.audit.patterns import (
    AuditRecord,
    VerifierView,
    choose_indices,
    count_records,
    find_patterns,
    pick_strata,
)
from dapo_mega.audit.sheet import AuditSheet
from dapo_mega.config import ConfigError, DapoConfig

if TYPE_CHECKING:
    from dapo_mega.data import Problem, PromptEncoder
    from dapo_mega.rollout.samples import Group

T = TypeVar("T")
"""A training problem (`choose_prompts` keeps what it is given)."""

USAGE = """dapo-mega audit [overrides] [--checkpoint PATH] [--n N] [--seed S] [--per-stratum K] [--out DIR] [--json]

  --checkpoint PATH  the policy to audit: an HF directory, a Megatron checkpoint or a run directory
                     (default: the initial policy of the configured run)
  --n N              prompts drawn from the training set (default 100), one response each
  --seed S           the draw of prompts, the sampling seeds and the picks (default trainer.seed)
  --per-stratum K    picks shown per stratum (default 3)
  --out DIR          where audit.md, audit.html and audit.json go (default <run_dir>/audit)
  --json             also print audit.json on stdout"""


@dataclass
class AuditOptions:
    """The command's own flags (the config comes from the Hydra overrides beside them)."""

    checkpoint: str = ""
    """The policy to audit; empty: the run's initial policy (model.megatron_path, else the
    model directory: model.hf_path or the tiny model in <run_dir>/base_model)."""
    num_prompts: int = 100
    seed: Optional[int] = None
    """None: trainer.seed."""
    per_stratum: int = 3
    out: str = ""
    """Empty: <run_dir>/audit."""
    print_json: bool = False


_FLAGS = {"--checkpoint": "checkpoint", "--n": "num_prompts", "--seed": "seed", "--per-stratum": "per_stratum",
          "--out": "out"}


def parse_audit_args(args: Sequence[str]) -> Tuple[AuditOptions, List[str]]:
    """(the audit's flags, the Hydra overrides): `--flag value` or `--flag=value`."""
    options, overrides = AuditOptions(), []
    it = iter(args)
    for arg in it:
        name, _, inline = arg.partition("=")
        if arg == "--json":
            options.print_json = True
        elif name in _FLAGS:
            value = inline if "=" in arg else next(it, None)
            if value is None:
                raise ConfigError(f"{name}: needs a value. Usage: {USAGE.splitlines()[0]}")
            field_name = _FLAGS[name]
            try:
                setattr(options, field_name, value if field_name in ("checkpoint", "out") else int(value))
            except ValueError:
                raise ConfigError(f"{name}: {value!r} is not an integer. Fix: e.g. {name} 16") from None
        elif arg.startswith("--"):
            raise ConfigError(f"{arg}: unknown flag. Usage: {USAGE.splitlines()[0]}")
        else:
            overrides.append(arg)
    if options.num_prompts < 1 or options.per_stratum < 0:
        raise ConfigError("--n must be >= 1 and --per-stratum >= 0. Fix: e.g. --n 100 --per-stratum 3")
    return options, overrides


def choose_prompts(problems: Sequence[T], n: int, seed: int) -> List[T]:
    """`n` training problems (all when fewer), drawn with `seed`, in training-set order."""
    return [problems[i] for i in choose_indices(len(problems), n, seed, "prompts")]


def resolve_policy(cfg: DapoConfig, checkpoint: str, workdir: Path) -> Tuple[Path, str]:
    """(HF directory to serve, the policy as the sheet names it)."""
    from dapo_mega.evaluate import _hf_dir_of
    from dapo_mega.session import build_tiny_model, model_dir_of

    if checkpoint:
        return _hf_dir_of(checkpoint, workdir), checkpoint
    if cfg.model.megatron_path:
        return _hf_dir_of(cfg.model.megatron_path, workdir), f"initial policy: {cfg.model.megatron_path}"
    model_dir = model_dir_of(cfg)
    if not (model_dir / "config.json").exists():
        build_tiny_model(cfg, model_dir)  # what the run would start from (deterministic in megatron.seed)
    return model_dir, f"initial policy: {model_dir}"


def roll_out(cfg: DapoConfig, hf_dir: Path, problems: Sequence[Problem], encoder: PromptEncoder, seed: int, revision: str,
             run_id: str) -> list:
    """One response per problem with the training sampling, length limit and seeds: Groups in order."""
    from dapo_mega.aio import run_coroutine
    from dapo_mega.engines.book import EngineBook
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.plan.clock import resolve_health_timeout_s
    from dapo_mega.rollout.manager import RolloutManager

    with EngineFleet(cfg.rollout, str(hf_dir), cfg.run_dir / "logs" / "audit", device=cfg.cluster.device,
                     start_timeout_s=resolve_health_timeout_s(cfg)) as fleet:
        endpoints = fleet.start_on_this_node("dapo-mega audit")  # engine i on its own GPUs of this node
        manager = RolloutManager.from_config(cfg, EngineBook(endpoints), "audit", encoder, run_id=run_id, seed=seed,
                                             dataset_revision=revision)
        return run_coroutine(manager.generate_groups(list(problems)))


def other_verifier_name(primary: str) -> Optional[str]:
    """The verifier run beside the training one: math_verify beside dapo (when installed), dapo beside math_verify."""
    if primary == "math_verify":
        return "dapo"
    return "math_verify" if importlib.util.find_spec("math_verify") is not None else None


def score_records(cfg: DapoConfig, groups: Sequence[Group], encoder: PromptEncoder) -> List[AuditRecord]:
    """Both verifiers on every response (one per group), the training reward components (the
    trainer's own `score_groups`), the patterns."""
    from dapo_mega.data import verification_prefix
    from dapo_mega.reward import build_verifier, score_groups, score_responses

    samples = [(g.prompt, g.samples[0]) for g in groups]
    assert all(len(g.samples) == 1 for g in groups), "the audit rolls out one response per problem"
    texts = [s.response_text for _, s in samples]
    truths = [p.ground_truth for p, _ in samples]
    prefixes = [verification_prefix(p, cfg.data.prompt_template) for p, _ in samples]
    verifier = build_verifier(cfg.algo.verifier, cfg.algo.reward_kwargs)
    rewards = score_groups(verifier, groups, cfg.algo, cfg.data.prompt_template).items()
    other_name = other_verifier_name(cfg.algo.verifier)
    others: List[Optional[VerifierView]] = [None] * len(samples)
    if other_name:
        other = build_verifier(other_name)
        results, _ = score_responses(other, texts, truths, cfg.algo.verifier_timeout_s, answer_prefixes=prefixes)
        others = [VerifierView(other.name, other.version, r.correct, r.extracted, r.error) for r in results]
    records = []
    for i, ((problem, s), reward, o) in enumerate(zip(samples, rewards, others)):
        records.append(find_patterns(AuditRecord(
            index=i, problem_id=problem.id, ground_truth=problem.ground_truth, prompt=encoder.render(problem),
            response=s.response_text, verification_prefix=prefixes[i], response_tokens=len(s.token_ids),
            truncated=s.truncated, sampling_seed=s.seed, reward=reward.reward, components=reward.components(),
            verifier=VerifierView(verifier.name, verifier.version, reward.correct, reward.extracted,
                                  reward.verifier_error), other=o)))
    return records


def describe_settings(cfg: DapoConfig, policy: str, run_id: str, encoder: PromptEncoder, revision: str, seed: int,
                      num_train: int, records: Sequence[AuditRecord]) -> List[Tuple[str, str]]:
    """The sheet's settings: what produced these responses and who graded them."""
    from dapo_mega.reward import build_verifier

    a, d = cfg.algo, cfg.data
    verifier = build_verifier(a.verifier, a.reward_kwargs)
    other = records[0].other if records else None
    other_name = other_verifier_name(a.verifier)
    chat = getattr(encoder.tokenizer, "chat_template", None) or ""
    chat_line = (f"applied (sha256 {hashlib.sha256(chat.encode()).hexdigest()[:12]})" if d.apply_chat_template
                 else "not applied")
    shaping = (f"overlong buffer {a.overlong_buffer_length} tokens, factor {a.overlong_penalty_factor}"
               if a.overlong_buffer_enable else "off")
    return [
        ("policy", policy), ("run id of the policy", run_id or "(none: not a run's checkpoint)"),
        ("rollout backend", cfg.rollout.backend),
        ("verifier (training, gives the verdict)", f"{verifier.name} {verifier.version}"),
        ("second verifier", f"{other.name} {other.version}" if other else
         (f"{other_name} (no responses)" if other_name else "math_verify not installed (pip install math-verify)")),
        ("prompt template", d.prompt_template), ("chat template", chat_line),
        ("tokenizer", type(encoder.tokenizer).__name__),
        ("dataset", d.train_path or f"synthetic {d.synthetic_task} (data.seed {d.seed})"),
        ("dataset revision", revision),
        ("sampling", f"temperature {a.temperature}, top_p {a.top_p}, top_k {a.top_k}, 1 response per prompt"),
        ("length limit", f"{a.max_response_length} response tokens"), ("reward shaping", shaping),
        ("seed", str(seed)), ("N", f"{len(records)} prompts drawn from {num_train} training prompts"),
    ]


def run_audit(cfg: DapoConfig, options: AuditOptions) -> Tuple[AuditSheet, Path]:
    """Roll out, score, pick and write; returns the sheet and its directory."""
    from dapo_mega.data import PromptEncoder, build_datasets
    from dapo_mega.plan.preflight import check_data_paths, check_engine_python
    from dapo_mega.reward import close_verifier_pools
    from dapo_mega.run_files.identity import run_id_of_path

    check_engine_python(cfg.rollout, starts_engines=True)  # before a checkpoint is exported for its engines
    check_data_paths(cfg.data)
    if options.checkpoint and not Path(options.checkpoint).exists():
        raise ConfigError(f"--checkpoint: {options.checkpoint} does not exist. Fix: point it at an HF directory, a "
                          "Megatron checkpoint or a run directory")
    seed = cfg.trainer.seed if options.seed is None else options.seed
    train, _, revision = build_datasets(cfg.data)
    if not train:
        raise ConfigError("data.train_path: no training problems to audit. Fix: point it at a non-empty file")
    problems = choose_prompts(train, options.num_prompts, seed)
    with tempfile.TemporaryDirectory(prefix="dapo_mega_audit_") as tmp:
        hf_dir, policy = resolve_policy(cfg, options.checkpoint, Path(tmp))
        run_id = run_id_of_path(options.checkpoint) if options.checkpoint else ""
        encoder = PromptEncoder.from_pretrained(hf_dir, cfg.data)  # the trainer's encoder
        groups = roll_out(cfg, hf_dir, problems, encoder, seed, revision, run_id)
    try:
        records = score_records(cfg, groups, encoder)
    finally:
        close_verifier_pools()
    notes = []
    if any(r.verification_prefix for r in records):
        notes.append("The prompts end in the answer line (the verifier reads the prompt's answer prefix + the "
                     "response), so 'no working' is not checked: the answer alone is what was asked for.")
    sheet = AuditSheet(describe_settings(cfg, policy, run_id, encoder, revision, seed, len(train), records),
                       records, count_records(records), pick_strata(records, options.per_stratum, seed),
                       options.per_stratum, notes)
    out_dir = Path(options.out) if options.out else cfg.run_dir / "audit"
    sheet.write(out_dir)
    return sheet, out_dir


def run_audit_command(args: Sequence[str]) -> int:
    """`dapo-mega audit`: flags (USAGE) and Hydra overrides; prints the counts and where the sheet is."""
    import json

    from dapo_mega.config import load_config

    options, overrides = parse_audit_args(args)
    cfg = load_config(overrides)
    start = time.perf_counter()
    sheet, out_dir = run_audit(cfg, options)
    if options.print_json:  # stdout holds the JSON alone; the summary line goes to stderr
        print(json.dumps(sheet.to_dict(), indent=1, ensure_ascii=False), flush=True)
    c, n = sheet.counts, len(sheet.records)
    print(f"[audit] {n} prompts: {c['correct']} correct, {c['wrong']} wrong, {c['no_answer']} no answer, "
          f"{c['verifier_error']} verifier errors; {c['truncated']} truncated, {c['disagreement']} disagreements, "
          f"{c['copied_answer']} copied, {c['several_answer_lines']} several Answer: lines, {c['no_working']} no "
          f"working ({time.perf_counter() - start:.0f} s) -> {out_dir}/audit.md, audit.html, audit.json", flush=True,
          file=sys.stderr if options.print_json else sys.stdout)
    return 0
