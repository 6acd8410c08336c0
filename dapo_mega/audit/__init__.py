"""`dapo-mega audit`: the verifier read by a person before training.

The seeds' step before any training run: roll out a policy (the run's initial one by
default, or any checkpoint) on N fixed training prompts (default 100, drawn with a seed)
with the training prompt encoder, sampling, length limit and verifier, and write a sheet a
person reads: the settings, the counts (correct, wrong, no answer extracted, truncated,
verifier errors) and seeded picks per stratum (correct, wrong, format failures, truncated,
disagreements between the DAPO rule and math-verify, and the suspicious patterns: an answer
copied from the prompt, several `Answer:` lines, an answer with no working), each with the
prompt as rendered, the response, the extracted answer, the verdict and the reward
components. The same call writes the same sheet.

    dapo-mega audit                                   the default task's initial policy, N = 100
    dapo-mega audit --checkpoint outputs/tiny_cpu/checkpoints/latest --n 50 --out audit_step40
    dapo-mega audit +experiment=dapo_qwen2.5_7b --json

Writes `audit.md`, `audit.html` (self-contained) and `audit.json` in `<run_dir>/audit/`
(or `--out`). The pure parts are in `audit.patterns` (verdicts, patterns, picks) and
`audit.sheet` (rendering); `audit.run` rolls out with the trainer's pieces.
"""

from dapo_mega.audit.patterns import PATTERNS, STRATA, VERDICTS, AuditRecord, VerifierView
from dapo_mega.audit.run import USAGE, AuditOptions, run_audit, run_audit_command
from dapo_mega.audit.sheet import AuditSheet

__all__ = ["PATTERNS", "STRATA", "USAGE", "VERDICTS", "AuditOptions", "AuditRecord", "AuditSheet", "VerifierView",
           "run_audit", "run_audit_command"]
