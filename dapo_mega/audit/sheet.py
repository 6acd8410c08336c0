"""The audit written for a person (`audit.md`, a self-contained `audit.html`) and for
machines (`audit.json`). Nothing here depends on time or on the machine: the same audit
gives the same bytes."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from dapo_mega.audit.patterns import PATTERNS, STRATA, STRATUM_TITLES, VERDICTS, AuditRecord
from dapo_mega.run_files.checkpoints import write_text_atomic

COUNT_TITLES = {
    "correct": "correct", "wrong": "wrong (an answer, not the ground truth)",
    "no_answer": "no answer extracted (format failure)", "verifier_error": "verifier errors",
    "truncated": "truncated (stopped by the length limit)",
    "disagreement": "the two verifiers disagree", "copied_answer": "answer copied from the prompt",
    "several_answer_lines": "several Answer: lines", "no_working": "an answer with no working",
}


@dataclass
class AuditSheet:
    """One audit: its settings, every record, the counts and the picks per stratum."""

    settings: List[Tuple[str, str]]
    """(name, value) in the sheet's order."""
    records: List[AuditRecord]
    counts: Dict[str, int]
    picks: Dict[str, List[int]]
    """stratum -> positions in `records`."""
    per_stratum: int
    notes: List[str] = field(default_factory=list)
    """Lines the reader needs before the counts (e.g. which checks were skipped)."""

    def to_dict(self) -> Dict[str, object]:
        """audit.json: settings, counts, the picks with their full records, and a line per response."""
        return {"settings": dict(self.settings), "counts": self.counts, "num_prompts": len(self.records),
                "per_stratum": self.per_stratum, "notes": self.notes,
                "picks": {s: [self.records[i].to_dict() for i in idx] for s, idx in self.picks.items()},
                "responses": [_summary(r) for r in self.records]}

    def write(self, out_dir: Path) -> Dict[str, Path]:
        """audit.md, audit.html and audit.json in `out_dir` (each replaced whole)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        texts = {"audit.md": render_markdown(self), "audit.html": render_html(self),
                 "audit.json": json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n"}
        paths = {}
        for name, text in texts.items():
            paths[name] = write_text_atomic(out_dir / name, text)
        return paths


def _summary(r: AuditRecord) -> Dict[str, object]:
    return {"index": r.index, "id": r.problem_id, "verdict": r.verdict, "truncated": r.truncated,
            "extracted": r.verifier.extracted, "ground_truth": r.ground_truth, "reward": r.reward,
            "other_verdict": None if r.other is None else ("correct" if r.other.correct else "not correct"),
            "flags": r.flags}


def _share(k: int, n: int) -> str:
    return f"{k} ({100.0 * k / n:.0f}%)" if n else str(k)


def count_rows(sheet: AuditSheet) -> List[Tuple[str, str]]:
    """(what, count) rows: the verdicts (adding up to N), then the flags beside them."""
    n = len(sheet.records)
    rows = [(COUNT_TITLES[v], _share(sheet.counts[v], n)) for v in VERDICTS]
    rows.append(("total (N)", str(n)))
    rows += [(COUNT_TITLES[k], _share(sheet.counts[k], n)) for k in ("truncated", "disagreement", *PATTERNS)]
    return rows


def _verdict_line(r: AuditRecord) -> List[Tuple[str, str]]:
    """(label, value) facts of one pick, shown above its prompt and response."""
    v = r.verifier
    facts = [("verdict", f"{r.verdict} ({v.name})"), ("extracted answer", _shown(v.extracted)),
             ("ground truth", r.ground_truth),
             ("reward", f"{r.reward:+g} = " + " + ".join(f"{k} {x:+g}" for k, x in r.components.items())),
             ("length", f"{r.response_tokens} tokens" + (", truncated" if r.truncated else "")),
             ("sampling seed", str(r.sampling_seed))]
    if r.other is not None:
        o = r.other
        said = "error: " + o.error if o.error else ("correct" if o.correct else "not correct")
        facts.append((o.name, f"{said}, extracted {_shown(o.extracted)}"))
    if v.error:
        facts.append(("verifier error", v.error))
    if r.verification_prefix:
        facts.append(("verified text", f"{r.verification_prefix!r} + response"))
    facts += [("pattern", note) for note in r.notes]
    return facts


def _shown(value: object) -> str:
    return "(none)" if value is None else repr(str(value))


# ---------------------------------------------------------------------- markdown
def _fence(text: str) -> str:
    """A fenced block that `text` cannot close: more backticks than its longest run."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}text\n{text}\n{ticks}"


def _md_cell(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def render_markdown(sheet: AuditSheet) -> str:
    """audit.md: settings, counts, then the picks of each stratum."""
    out = ["# Audit: rollouts of one policy, read before training", "", "## Settings", "",
           "| setting | value |", "|---|---|"]
    out += [f"| {_md_cell(k)} | {_md_cell(v)} |" for k, v in sheet.settings]
    out += ["", "## Counts", ""] + [f"- {note}" for note in sheet.notes] + ([""] if sheet.notes else [])
    out += ["| responses | count |", "|---|---|"] + [f"| {_md_cell(a)} | {b} |" for a, b in count_rows(sheet)]
    out += ["", f"## Picks (up to {sheet.per_stratum} per stratum, seeded)", ""]
    for stratum in STRATA:
        idx = sheet.picks.get(stratum, [])
        out += [f"### {STRATUM_TITLES[stratum]}: {len(idx)} of {sheet.counts.get(stratum, 0)}", ""]
        if not idx:
            out += ["(none)", ""]
        for i in idx:
            r = sheet.records[i]
            out += [f"#### prompt {r.index}: `{_md_cell(r.problem_id)}`", ""]
            out += [f"- {label}: {_md_cell(value)}" for label, value in _verdict_line(r)]
            out += ["", "Prompt (as rendered for the model):", "", _fence(r.prompt), "",
                    "Response:", "", _fence(r.response), ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------- html
_CSS = """
body { font-family: system-ui, sans-serif; max-width: 70em; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: 0.5em; white-space: pre-wrap; word-break: break-all; }
.pick { border-left: 4px solid #888; padding-left: 1em; margin: 1em 0 2em; }
.correct { border-color: #2a7; } .wrong { border-color: #c33; } .no_answer { border-color: #e90; }
.verifier_error { border-color: #70c; }
.none { color: #888; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(header: Tuple[str, str], rows: Sequence[Tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{_e(a)}</td><td>{_e(b)}</td></tr>" for a, b in rows)
    return f"<table><tr><th>{_e(header[0])}</th><th>{_e(header[1])}</th></tr>{body}</table>"


def render_html(sheet: AuditSheet) -> str:
    """audit.html: the same content as audit.md, one file, inline CSS, every text escaped."""
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<title>dapo-mega audit</title>", f"<style>{_CSS}</style></head><body>",
           "<h1>Audit: rollouts of one policy, read before training</h1>", "<h2>Settings</h2>",
           _table(("setting", "value"), sheet.settings), "<h2>Counts</h2>"]
    out += [f"<p>{_e(note)}</p>" for note in sheet.notes]
    out += [_table(("responses", "count"), count_rows(sheet)),
            f"<h2>Picks (up to {sheet.per_stratum} per stratum, seeded)</h2>"]
    for stratum in STRATA:
        idx = sheet.picks.get(stratum, [])
        out.append(f"<h3>{_e(STRATUM_TITLES[stratum])}: {len(idx)} of {sheet.counts.get(stratum, 0)}</h3>")
        if not idx:
            out.append('<p class="none">(none)</p>')
        for i in idx:
            r = sheet.records[i]
            facts = "".join(f"<li>{_e(label)}: {_e(value)}</li>" for label, value in _verdict_line(r))
            out.append(f'<div class="pick {_e(r.verdict)}"><h4>prompt {r.index}: <code>{_e(r.problem_id)}</code></h4>'
                       f"<ul>{facts}</ul><p>Prompt (as rendered for the model):</p><pre>{_e(r.prompt)}</pre>"
                       f"<p>Response:</p><pre>{_e(r.response)}</pre></div>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
