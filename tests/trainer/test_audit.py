"""`dapo-mega audit`: the pattern detectors on hand-written responses, the seeded stratified
picks, the sheet's escaping, both verifiers on hand-written rollouts, and one end-to-end call
on the default tiny task (files, counts adding up to N, provenance, the same call twice)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mega.audit.patterns import (
    STRATA,
    AuditRecord,
    VerifierView,
    choose_indices,
    copied_from_prompt,
    count_answer_lines,
    count_records,
    find_patterns,
    has_no_working,
    pick_strata,
    verdict_of,
)
from dapo_mega.audit.run import choose_prompts, parse_audit_args
from dapo_mega.audit.sheet import AuditSheet, render_html, render_markdown
from dapo_mega.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def record(i=0, response="Answer: 5", prompt="Q: 2+3\n", truth="5", correct=True, extracted="5", error=None,
           truncated=False, other=None, prefix=""):
    return find_patterns(AuditRecord(
        index=i, problem_id=f"p{i}", ground_truth=truth, prompt=prompt, response=response,
        verification_prefix=prefix, response_tokens=4, truncated=truncated, sampling_seed=7 + i,
        reward=1.0 if correct else -1.0, components={"correctness": 1.0 if correct else -1.0, "overlong_penalty": 0.0},
        verifier=VerifierView("dapo", "dapo-minerva-v1", correct, extracted, error), other=other))


# ------------------------------------------------------------------ verdicts and patterns
def test_verdicts_partition_the_responses():
    assert verdict_of(VerifierView("v", "1", True, "5")) == "correct"
    assert verdict_of(VerifierView("v", "1", False, "6")) == "wrong"
    assert verdict_of(VerifierView("v", "1", False, None)) == "no_answer"
    assert verdict_of(VerifierView("v", "1", False, None, "verifier_error: timeout")) == "verifier_error"
    records = [record(0), record(1, correct=False, extracted="6"), record(2, correct=False, extracted=None),
               record(3, correct=False, extracted=None, error="verifier_error: x", truncated=True)]
    counts = count_records(records)
    assert (counts["correct"], counts["wrong"], counts["no_answer"], counts["verifier_error"]) == (1, 1, 1, 1)
    assert counts["truncated"] == 1
    assert records[3].strata() == ["truncated", "verifier_error", "no_working"]


def test_copied_answer_is_a_whole_token_of_the_prompt():
    assert copied_from_prompt("Q: 4+0\nAnswer:", "4", "4") == ["the ground truth '4' appears verbatim in the prompt"]
    assert copied_from_prompt("Q: 42+1\n", "43", "42") == ["the extracted answer '42' appears verbatim in the prompt"]
    assert copied_from_prompt("Q: 142+1\n", "143", "42") == []  # inside a longer number: not a copy
    assert copied_from_prompt("Find x if 2x = 10.", "5", None) == []
    assert copied_from_prompt("Is it \\frac{1}{2}?", "\\frac{1}{2}", "\\frac{1}{2}") != []


def test_several_answer_lines_and_no_working():
    assert count_answer_lines("3+4=7\nAnswer: 7") == 1
    assert count_answer_lines("Answer: 6\nno, wait\nanswer : 7") == 2
    assert has_no_working("Answer: 7")
    assert has_no_working("\n  Answer: 7\n")
    assert not has_no_working("12+34=46\n46-5=41, so the result is\nAnswer: 41")
    assert not has_no_working("7")  # no answer line: a format failure, not a missing working
    assert not has_no_working(" 7\n", verification_prefix="Answer:")  # the prompt asked for the answer alone

    r = record(response="Answer: 6\nAnswer: 5", prompt="What is 2+3?")
    assert r.flags == ["several_answer_lines", "no_working"]
    assert "2 Answer: lines" in r.notes[0]
    assert record(response="Answer: 5", prompt="Q: 5*1").flags == ["copied_answer", "no_working"]
    worked = record(response="two plus three makes five, so\nAnswer: 5", prompt="What is 2+3?")
    assert worked.flags == [] and worked.strata() == ["correct"]


def test_disagreement_needs_two_clean_verdicts():
    agree = record(other=VerifierView("math_verify", "m", True, "5"))
    differ = record(correct=False, extracted=None, other=VerifierView("math_verify", "m", True, "1/2"))
    errored = record(correct=False, extracted=None,
                     other=VerifierView("math_verify", "m", False, None, "verifier_error: t"))
    assert not agree.disagreement and differ.disagreement and not errored.disagreement
    assert differ.strata() == ["no_answer", "disagreement", "no_working"]


# ------------------------------------------------------------------ seeded choices
def varied_records(n=60):
    out = []
    for i in range(n):
        kind = i % 5
        out.append(record(i, correct=kind == 0, extracted=None if kind == 2 else str(i), truncated=kind == 3,
                          error="verifier_error: x" if i == 7 else None,
                          other=VerifierView("math_verify", "m", kind in (0, 4), "5"),
                          response="Answer: 1\nAnswer: 2" if i % 11 == 0 else "working " * 5 + "\nAnswer: 5"))
    return out


def test_stratified_picks_are_seeded_and_cover_every_stratum():
    records = varied_records()
    a, b, c = pick_strata(records, 3, seed=1), pick_strata(records, 3, seed=1), pick_strata(records, 3, seed=2)
    assert a == b
    assert a != c
    assert set(a) == set(STRATA)
    for stratum, idx in a.items():
        members = [i for i, r in enumerate(records) if stratum in r.strata()]
        assert len(idx) == min(3, len(members)), stratum
        assert len(set(idx)) == len(idx) and all(stratum in records[i].strata() for i in idx)
    assert all(a[s] for s in ("correct", "wrong", "no_answer", "truncated", "verifier_error", "disagreement",
                              "several_answer_lines"))
    assert len(a["verifier_error"]) == 1  # a stratum smaller than K: all of it
    assert pick_strata(records, 0, seed=1) == {s: [] for s in STRATA}


def test_prompts_are_chosen_with_the_seed_in_training_order():
    problems = [f"p{i}" for i in range(500)]
    first = choose_prompts(problems, 100, seed=1)
    assert first == choose_prompts(problems, 100, seed=1) != choose_prompts(problems, 100, seed=2)
    assert len(set(first)) == 100 and first == sorted(first, key=problems.index)
    assert choose_prompts(problems[:10], 100, seed=1) == problems[:10]
    assert choose_indices(50, 3, 1, "a") == choose_indices(50, 3, 1, "a") != choose_indices(50, 3, 1, "b")


def test_parse_audit_args_splits_flags_from_overrides():
    options, overrides = parse_audit_args(["--n", "16", "--out=x", "algo.verifier=math_verify", "--json",
                                           "--checkpoint", "ck", "--seed=3", "--per-stratum", "2"])
    assert (options.num_prompts, options.out, options.checkpoint, options.seed, options.per_stratum,
            options.print_json) == (16, "x", "ck", 3, 2, True)
    assert overrides == ["algo.verifier=math_verify"]
    for bad in (["--n", "many"], ["--frobnicate"], ["--n"], ["--n", "0"]):
        with pytest.raises(ConfigError):
            parse_audit_args(bad)


# ------------------------------------------------------------------ the sheet
def assert_well_formed(page):
    """Every tag opened is closed, in order (what a response could break if not escaped)."""
    from html.parser import HTMLParser

    class Tags(HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack, self.mismatched = [], []

        def handle_starttag(self, tag, attrs):
            if tag != "meta":
                self.stack.append(tag)

        def handle_endtag(self, tag):
            if self.stack and self.stack[-1] == tag:
                self.stack.pop()
            else:
                self.mismatched.append(tag)

    parser = Tags()
    parser.feed(page)
    assert parser.stack == [] and parser.mismatched == []


def test_sheet_escapes_every_text():
    nasty = "<script>alert('x')</script> & \"q\"\n```\nAnswer: </pre>"
    r = record(response=nasty, prompt="<b>bold</b> | pipe", truth="<i>5</i>", correct=False, extracted="</pre>")
    sheet = AuditSheet([("policy", "<model & co>")], [r], count_records([r]), pick_strata([r], 3, 1), 3)
    page = render_html(sheet)
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "&lt;model &amp; co&gt;" in page
    assert page.count("<pre>") == page.count("</pre>")  # the response's "</pre>" cannot close a block
    assert "<link" not in page and "<style>" in page and "src=" not in page  # self-contained
    assert_well_formed(page)
    md = render_markdown(sheet)
    assert "````text\n" + nasty + "\n````" in md  # a fence longer than the response's own backticks
    assert "| policy | <model & co> |" in md


# ------------------------------------------------------------------ both verifiers on hand-written rollouts
def test_score_records_runs_both_verifiers():
    pytest.importorskip("math_verify")
    from dapo_mega.audit.run import score_records
    from dapo_mega.config import load_config
    from dapo_mega.data import Problem
    from dapo_mega.rollout.samples import Group, ScoredSample

    class Encoder:
        def render(self, problem):
            return "rendered: " + problem.prompt

    cases = [("What is 2+3?", "5", "two and three make five\nAnswer: 5"),
             ("Half of one?", "1/2", "one split in two gives \\boxed{\\frac{1}{2}}"),  # no Answer: line
             ("Pick 7", "7", "Answer: 7"), ("9 minus 1?", "8", "nine less one is eight, not six\nAnswer: 6\nAnswer: 8")]
    groups = [Group(Problem(f"q{i}", prompt, truth, "test"), [1, 2], [ScoredSample(
        f"q{i}", 0, [5] * 6, None, [], response, False, 11 + i, "e0", 0.0, 0.0)], "e0", 0.0, 0.0)
        for i, (prompt, truth, response) in enumerate(cases)]
    records = score_records(load_config([]), groups, Encoder())
    assert [r.verdict for r in records] == ["correct", "no_answer", "correct", "correct"]
    assert [r.other.correct for r in records] == [True, True, True, True]
    assert [r.disagreement for r in records] == [False, True, False, False]
    assert records[0].prompt == "rendered: What is 2+3?" and records[0].sampling_seed == 11
    assert records[2].flags == ["copied_answer", "no_working"]
    assert records[3].flags == ["several_answer_lines"]
    assert records[0].components == {"correctness": 1.0, "overlong_penalty": 0.0}
    assert records[1].other.name == "math_verify" and records[1].other.version.startswith("math_verify-")


# ------------------------------------------------------------------ end to end
def test_audit_command_on_the_default_task(tmp_path):
    """Two identical calls on the default tiny task (initial policy) write the same sheet."""
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "dapo_mega.cli", "audit", "--n", "16", "--out", str(out),
           f"trainer.output_dir={tmp_path}", "rollout.health_timeout_s=300"]
    sheets = []
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"-> {out}/audit.md" in proc.stdout
        sheets.append({name: (out / name).read_text() for name in ("audit.md", "audit.html", "audit.json")})
    assert sheets[0] == sheets[1]

    audit = json.loads(sheets[0]["audit.json"])
    counts = audit["counts"]
    assert audit["num_prompts"] == len(audit["responses"]) == 16
    assert sum(counts[v] for v in ("correct", "wrong", "no_answer", "verifier_error")) == 16
    from dapo_mega.config import load_config
    from dapo_mega.data import build_datasets
    from dapo_mega.reward import build_verifier

    cfg = load_config([f"trainer.output_dir={tmp_path}"])
    _, _, revision = build_datasets(cfg.data)
    version = build_verifier(cfg.algo.verifier).version
    settings = audit["settings"]
    assert settings["dataset revision"] == revision and version in settings["verifier (training, gives the verdict)"]
    assert settings["policy"] == f"initial policy: {cfg.run_dir / 'base_model'}"
    for name in ("audit.md", "audit.html"):
        assert revision in sheets[0][name] and version in sheets[0][name]
    assert all(p["sampling_seed"] is not None for picks in audit["picks"].values() for p in picks)
    assert all(audit["picks"][s] for s, k in counts.items() if k)  # every non-empty stratum has picks
