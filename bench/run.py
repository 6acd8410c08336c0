"""Run the benchmarks under bench/ and write bench/results/latest.json + latest.md.

    python bench/run.py                    full sizes (the end-to-end TRL row from its file)
    python bench/run.py --quick            small sizes, to check that everything runs
    python bench/run.py --only learner,weight_sync
    python bench/run.py --e2e              also rerun the end-to-end comparison with TRL

The result records the commit (`git rev-parse HEAD`, and whether tracked files had
uncommitted changes, naming them), the machine (CPU model, cores, torch, GPU) and the date.
Each benchmark module has `run(quick: bool) -> dict` returning at least
`{"name", "metric", "ours", "baseline", "baseline_name", "ratio", "higher_is_better"}` and,
where it times, `baseline_detail`, `repeats`, `ratio_median` and each side's
`ours_spread` / `baseline_spread` (min / median / max over the repeats, bench/timing.py);
`"rows"` holds further figures of the same shape. Both sides of a figure are measured in
the same run on the same machine. A benchmark that fails is reported with its error; the
others still run.

The end-to-end comparison with TRL takes hours at its full size, so by default it is not
rerun: its row comes from the committed `bench/results/e2e_trl.json`, marked as such, with
what that file supports (`summarize_committed_e2e`): the time to target is read at evals
every `eval_interval` steps, so it resolves one interval; the per-step ratio with its
spread over the seeds; the number of seeds; the commit it was measured at, if the file
records one ("commit unknown" otherwise).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
E2E_FILE = RESULTS_DIR / "e2e_trl.json"
sys.path.insert(0, str(BENCH_DIR))
from provenance import _git, git_state, machine_info  # noqa: E402
from timing import spread  # noqa: E402

# module name -> short name; the order is the order of the table.
BENCHMARKS = {
    "bench_learner": "learner",
    "bench_moe": "moe_learner",
    "bench_weight_sync": "weight_sync",
    "bench_engine": "engine",
    "bench_dynamic_sampling": "dynamic_sampling",
    "bench_partial_rollout": "partial_rollout",
    "bench_episodes": "episodes",
    "bench_e2e_trl": "e2e_trl",
    "bench_logprobs_memory": "logprobs_memory",
}


# ---------------------------------------------------------------------- the committed e2e result
def summarize_committed_e2e(data: Dict[str, Any], path: str = "bench/results/e2e_trl.json",
                            committed_in: Optional[str] = None) -> Dict[str, Any]:
    """The end-to-end result of a committed e2e_trl.json, reduced to what it supports."""
    measured_at = data.get("commit") or "commit unknown"
    if data.get("commit") and data.get("dirty"):
        measured_at += " + uncommitted changes"
    interval = data.get("eval_interval")
    steps = data.get("steps_to_target", {})
    both = [s for s in data.get("per_seed", []) if s.get("ours_reached") and s.get("trl_reached")]
    per_step = [s["per_step_ratio"] for s in data.get("per_seed", []) if "per_step_ratio" in s]
    seeds_run = data.get("seeds_run", len(data.get("per_seed", [])))
    source = f"{path}, not rerun (`--e2e` reruns it); measured at {measured_at}"
    if committed_in:
        source += f"; the file was last committed in {committed_in}"
    notes = [source]
    if interval and steps.get("ours") and steps.get("trl"):
        notes.append(f"time to target is read at evals every {interval} rollout steps: steps to target ours "
                     f"{steps['ours']}, TRL {steps['trl']}; one interval is "
                     f"{interval / min(steps['ours']):.0%} of ours' steps; the ratio is the step counts' ratio "
                     f"({sum(steps['trl']) / sum(steps['ours']):.3f}, resolved to one interval) times the per-step "
                     f"ratio")
    notes.append(f"seeds: {seeds_run} run, {data.get('seeds_reached_by_both', len(both))} reached by both "
                 f"(unreached: {data.get('unreached', [])})")
    if data.get("ours_rollout_overrides"):
        notes.append("dapo-mega ran with " + " ".join(data["ours_rollout_overrides"])
                     + " (the benchmark's request size, not the shipped default)")
    detail = ("TRL GRPOTrainer(loss_type='dapo') from the same warm start, the same prompts, rewards and "
              "held-out evaluation")
    main = {"name": "e2e_trl", "metric": "seconds to target held-out avg@k (mean over seeds both reached)",
            "ours": data.get("ours", float("nan")), "baseline": data.get("baseline", float("nan")),
            "baseline_name": data.get("baseline_name", "TRL GRPOTrainer (dapo)"), "baseline_detail": detail,
            "ratio": data.get("ratio", float("nan")), "higher_is_better": False, "repeats": len(both),
            "repeats_unit": "seeds", "status": "from file", "measured_at": measured_at, "notes": notes}
    if both:
        main["ours_spread"] = spread([s["ours_reached"]["train_s"] for s in both])
        main["baseline_spread"] = spread([s["trl_reached"]["train_s"] for s in both])
        if all("ratio" in s for s in both):
            main["ratio_spread"] = spread([s["ratio"] for s in both])
    if "per_step_ratio" in data:
        row = {"name": "e2e_trl (per step)", "metric": "seconds per rollout step (mean over seeds)",
               "ours": data["ours_seconds_per_step"], "baseline": data["trl_seconds_per_step"],
               "baseline_name": main["baseline_name"], "baseline_detail": detail, "ratio": data["per_step_ratio"],
               "higher_is_better": False, "repeats": len(per_step), "repeats_unit": "seeds",
               "status": "from file", "measured_at": measured_at}
        if per_step:
            row["ratio_spread"] = spread(per_step)
            row["ours_spread"] = spread([s["ours_seconds_per_step"] for s in data["per_seed"]])
            row["baseline_spread"] = spread([s["trl_seconds_per_step"] for s in data["per_seed"]])
        main["rows"] = [row]
    return main


def load_committed_e2e() -> Dict[str, Any]:
    if not E2E_FILE.exists():
        return {"status": "skipped", "error": f"no {E2E_FILE.relative_to(REPO)}; run with --e2e"}
    log = _git("log", "-1", "--format=%h %ad", "--date=format:%Y-%m-%d %H:%M", "--", str(E2E_FILE))
    return summarize_committed_e2e(json.loads(E2E_FILE.read_text()), committed_in=(log or "").strip() or None)


# ---------------------------------------------------------------------- the table
def figure_rows(name: str, result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The table rows of one benchmark's result: its own figure, then its `rows`."""
    if result.get("status") in ("failed", "skipped"):
        return [{"name": name, "status": result["status"], "error": result.get("error", result.get("reason", ""))}]
    first = {k: v for k, v in result.items() if k != "rows"}
    first.setdefault("name", name)
    return [first] + list(result.get("rows", []))


def _num(x: Any) -> str:
    if not isinstance(x, (int, float)):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _cell(value: Any, rounds: Optional[Dict[str, float]]) -> str:
    if rounds is None:
        return _num(value)
    return f"{_num(value)} (med {_num(rounds['median'])}; {_num(rounds['min'])}-{_num(rounds['max'])})"


def table_row(row: Dict[str, Any]) -> str:
    """One markdown line: benchmark | metric | ours | baseline | baseline figure | ratio | repeats."""
    if row.get("status") in ("failed", "skipped"):
        return f"| {row['name']} | {row['status']}: {str(row.get('error', ''))[:100]} | | | | | |"
    ratio = _num(row.get("ratio"))
    if "ratio_median" in row:
        ratio += f" (of medians {_num(row['ratio_median'])})"
    elif "ratio_spread" in row:
        s = row["ratio_spread"]
        ratio += f" (per seed {_num(s['min'])}-{_num(s['max'])})"
    repeats = row.get("repeats")
    repeats = "-" if repeats is None else f"{repeats} {row.get('repeats_unit', '')}".strip()
    if row.get("status") == "from file":
        repeats += ", from file"
    return (f"| {row['name']} | {row['metric']} | {_cell(row.get('ours'), row.get('ours_spread'))} | "
            f"{row.get('baseline_name', '')} | {_cell(row.get('baseline'), row.get('baseline_spread'))} | "
            f"{ratio} | {repeats} |")


def render_markdown(results: Dict[str, Any]) -> str:
    m, g = results["machine"], results["git"]
    commit = g["commit"][:12] + (" + uncommitted changes" if g["dirty"] else "")
    lines = [f"Commit: {commit}  ", f"Machine: {m['cores']} cores ({m['cpu']}), GPU {m['gpu']}, torch {m['torch']}, "
             f"Python {m['python']}, load average {m['load_average']:.1f} at the start  ",
             f"Date: {m['date_utc']} UTC, mode: {results['mode']}", "",
             "Figures are the best of `repeats` rounds per side, sides timed in alternation; in brackets the "
             "median and the range.", "",
             "| benchmark | metric | ours | baseline | baseline figure | ratio | repeats |",
             "|---|---|---|---|---|---|---|"]
    details, last = [], None
    for name, result in results["benchmarks"].items():
        for row in figure_rows(name, result):
            lines.append(table_row(row))
            if row.get("baseline_detail") and row["baseline_detail"] != last:
                details.append(f"- {row['name']}: baseline = {row['baseline_detail']}")
                last = row["baseline_detail"]
            for note in row.get("notes", []):
                details.append(f"  - {note}")
    return "\n".join(lines + ([""] + details if details else [])) + "\n"


# ---------------------------------------------------------------------- main
RUNNER = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
module, quick, out = sys.argv[2], sys.argv[3] == "1", sys.argv[4]
try:
    import importlib
    result = importlib.import_module(module).run(quick=quick)
except Exception as exc:
    traceback.print_exc()
    result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
with open(out, "w") as f:
    json.dump(result, f)
"""


def run_benchmark(module_name: str, quick: bool) -> Dict[str, Any]:
    """`module.run(quick)` in a fresh interpreter: one benchmark's process state (the
    learner's CPU function mode, thread pools, the heap) must not slow or speed the next."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(BENCH_DIR), module_name, "1" if quick else "0",
                               str(out)], cwd=REPO)
        if not out.exists():
            return {"status": "failed", "error": f"{module_name} exited with {proc.returncode} and no result "
                                                 "(its output is above)"}
        result = json.loads(out.read_text())
    result.setdefault("status", "ok")  # a benchmark may report itself "skipped"
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, to check that everything runs")
    parser.add_argument("--only", default="", help="comma-separated short names to run")
    parser.add_argument("--e2e", action="store_true", help="rerun the end-to-end comparison with TRL (hours at "
                                                            "full size); without it its row comes from e2e_trl.json")
    args = parser.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    git = git_state()
    results = {"git": git, "machine": machine_info(), "mode": "quick" if args.quick else "full", "benchmarks": {}}
    failures = 0
    for module_name, short in BENCHMARKS.items():
        if only and short not in only:
            continue
        start = time.time()
        if short == "e2e_trl" and not args.e2e:
            result = load_committed_e2e()
        else:
            print(f"[bench] {short} ...", flush=True)
            result = run_benchmark(module_name, args.quick)
            if short == "e2e_trl" and result.get("status") == "ok" and not args.quick:
                # the committed file says which commit made it, for the runs that read it back
                result.update(commit=git["commit"], dirty=git["dirty"])
                E2E_FILE.write_text(json.dumps(result, indent=2))
        failures += result.get("status") == "failed"
        result["seconds"] = round(time.time() - start, 1)
        results["benchmarks"][short] = result
        print(f"[bench] {short}: {json.dumps({k: v for k, v in result.items() if k not in ('traceback', 'rows')})}",
              flush=True)
    (RESULTS_DIR / "latest.json").write_text(json.dumps(results, indent=2))
    (RESULTS_DIR / "latest.md").write_text(render_markdown(results))
    print(render_markdown(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
