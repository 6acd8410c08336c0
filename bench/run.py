"""Run every benchmark under bench/ and write bench/results/latest.json + latest.md.

    python bench/run.py            full sizes
    python bench/run.py --quick    a few minutes on 2 cores
    python bench/run.py --only learner,weight_sync

Each benchmark module has `run(quick: bool) -> dict` returning at least
`{"name", "metric", "ours", "baseline", "baseline_name", "ratio", "higher_is_better"}`
(and optionally `"rows"`: more such dicts, each a further line of the table); both figures
are measured in the same run on the same machine. A benchmark that fails is
reported as failed with its error; the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

# module name -> short name; the order is the order of the table.
BENCHMARKS = {
    "bench_learner": "learner",
    "bench_weight_sync": "weight_sync",
    "bench_engine": "engine",
    "bench_dynamic_sampling": "dynamic_sampling",
    "bench_e2e_trl": "e2e_trl",
    "bench_logprobs_memory": "logprobs_memory",
}


def machine_description() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def render_markdown(results: dict) -> str:
    lines = [f"Machine: {results['machine']}  ", f"Date: {results['date']}, mode: {results['mode']}", "",
             "| benchmark | metric | ours | baseline | baseline figure | ratio |", "|---|---|---|---|---|---|"]
    for name, r in results["benchmarks"].items():
        if r.get("status") == "failed":
            lines.append(f"| {name} | failed: {r['error'][:80]} | | | | |")
            continue
        for row in [dict(r, name=name)] + list(r.get("rows", [])):
            lines.append(f"| {row['name']} | {row['metric']} | {row['ours']:.4g} | {row['baseline_name']} "
                         f"| {row['baseline']:.4g} | {row['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (a few minutes on 2 cores)")
    parser.add_argument("--only", default="", help="comma-separated short names to run")
    args = parser.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    sys.path.insert(0, str(BENCH_DIR))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine_description(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "mode": "quick" if args.quick else "full", "benchmarks": {}}
    failures = 0
    for module_name, short in BENCHMARKS.items():
        if only and short not in only:
            continue
        print(f"[bench] {short} ...", flush=True)
        start = time.time()
        try:
            module = importlib.import_module(module_name)
            result = module.run(quick=args.quick)
            result.setdefault("status", "ok")  # a benchmark may report itself "skipped"
        except Exception as exc:  # report and go on: one broken benchmark must not hide the others
            failures += 1
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
            print(result["traceback"], file=sys.stderr)
        result["seconds"] = round(time.time() - start, 1)
        results["benchmarks"][short] = result
        print(f"[bench] {short}: {json.dumps({k: v for k, v in result.items() if k != 'traceback'})}", flush=True)
    (RESULTS_DIR / "latest.json").write_text(json.dumps(results, indent=2))
    (RESULTS_DIR / "latest.md").write_text(render_markdown(results))
    print(render_markdown(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
