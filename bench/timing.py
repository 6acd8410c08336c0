"""Repeated timings for the benchmarks: sides timed in alternation, best of N, the spread.

    seconds = time_alternating({"ours": step_a, "baseline": step_b}, repeats=5)
    row = throughput_figure("learner", "useful train tokens/s", work, seconds["ours"],
                            work, seconds["baseline"], "HF transformers, same packing", "...")

On a shared machine a single timing measures the neighbours as much as the code, and two
sides timed one after the other see different neighbours. So every side runs once per
round, rounds repeat, and a figure is the best round of each side (as timeit reports), with
the median and the range beside it. The figure dict has the keys `bench/run.py` tabulates:
name, metric, ours, baseline, baseline_name, baseline_detail, ratio, ratio_median,
higher_is_better, repeats, ours_spread, baseline_spread (min / median / max in the metric's
unit).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence


def spread(values: Sequence[float]) -> Dict[str, float]:
    """min, median and max of repeated measurements."""
    if not values:
        raise ValueError("spread of no values")
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def time_alternating(sides: Mapping[str, Callable[[], Any]], repeats: int,
                     sync: Optional[Callable[[], None]] = None) -> Dict[str, List[float]]:
    """Seconds of each side's call, `repeats` rounds of one call per side in turn.

    Odd rounds run the sides in reverse order (A B, B A, A B, ...), so a side is not always
    the one that runs right after another (caches, allocator, a neighbour's burst).
    sync: called before and after each timed call (e.g. torch.cuda.synchronize), untimed
    before, timed after (the work must be finished when the clock stops).
    """
    seconds: Dict[str, List[float]] = {name: [] for name in sides}
    for round_ in range(repeats):
        for name in alternation_order(list(sides), round_):
            call = sides[name]
            if sync is not None:
                sync()
            start = time.perf_counter()
            call()
            if sync is not None:
                sync()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def alternation_order(names: Sequence[str], round_: int) -> List[str]:
    """The sides' order in round `round_`: as given in even rounds, reversed in odd ones."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def throughput_figure(name: str, metric: str, ours_work: float, ours_seconds: Sequence[float],
                      baseline_work: float, baseline_seconds: Sequence[float], baseline_name: str,
                      baseline_detail: str, **extra: Any) -> Dict[str, Any]:
    """A work-per-second figure (higher is better) from each side's repeated seconds.

    ours / baseline: work / fastest round; ratio: ours / baseline; ratio_median: the same
    of the median rounds; each side's spread is work / seconds of its rounds.
    """
    ours_rates = [ours_work / s for s in ours_seconds]
    base_rates = [baseline_work / s for s in baseline_seconds]
    ours, base = max(ours_rates), max(base_rates)
    return {"name": name, "metric": metric, "ours": ours, "baseline": base, "baseline_name": baseline_name,
            "baseline_detail": baseline_detail, "ratio": ours / base,
            "ratio_median": statistics.median(ours_rates) / statistics.median(base_rates),
            "higher_is_better": True, "repeats": min(len(ours_seconds), len(baseline_seconds)),
            "ours_spread": spread(ours_rates), "baseline_spread": spread(base_rates),
            "ours_seconds": list(ours_seconds), "baseline_seconds": list(baseline_seconds), **extra}


def write_result(path, result: Dict[str, Any]) -> None:
    """Write a benchmark's result JSON with where it was measured: the commit (and whether
    tracked files differed from it), the machine, its load and the UTC date, under "measured"."""
    import json
    from pathlib import Path

    from provenance import git_state, machine_info

    result["measured"] = {**git_state(), **machine_info()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


def run_cli(run: Callable[[bool], Dict[str, Any]], doc: str) -> None:
    """A benchmark's command line (`python bench/bench_X.py [--quick]`): runs it and prints its
    result, the per-repeat `sides` left to the results file."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    out = run(ap.parse_args().quick)
    print(json.dumps({k: v for k, v in out.items() if k != "sides"}, indent=2))
