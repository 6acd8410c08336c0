"""The suite on two workers (pytest-xdist, `-n 2 --dist loadgroup`): what runs where and when.

Most tests run one process at a time at `OMP_NUM_THREADS=1`, so on the 2-core CI machine one
worker leaves a core idle about half of the time; two workers fill it. Three rules keep that
safe and short:

* **A file is one unit of work** (its xdist group), so its module-scoped fixtures (SGLang
  servers, trained checkpoints) start once; the tests that submit to the local Slurm cluster
  form one unit together (`slurm`), so one worker starts the cluster and no two jobs of
  different tests compete for its two nodes.
* **Longest first**: units are handed out in decreasing order of their recorded seconds
  (`tests/durations.json`, written by `python -m helpers.durations JUNIT_XML` from a run's
  `--junitxml`), so the last unit to start is a short one and neither worker idles long at
  the end. A file not yet recorded counts as `UNRECORDED_S`.
* **`@pytest.mark.exclusive` runs alone**: a test whose limits are the point (a 3-second
  collective timeout at the 32B clock ratios, sub-second liveness timeouts) takes the CPU lock
  exclusively; every other test takes it shared. A turnstile in front of the lock makes an
  exclusive test wait only for the tests already running, not for ones that start later.
  A worker whose next test is exclusive too keeps the lock for it (`CpuTurns`), so a file of
  exclusive tests waits once for the other worker's running test, not once per test.

Without xdist (`python -m pytest` alone, a test named by id) the lock is not taken and the
order is pytest's.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
UNRECORDED_S = 60.0
"""Seconds assumed for a test file not in durations.json (early rather than last)."""
SLURM_GROUP = "slurm"


def recorded_seconds() -> Dict[str, float]:
    """Test file (relative to tests/) -> seconds it took in the recorded run."""
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except FileNotFoundError:
        return {}


def unit_of(item) -> str:
    """The xdist group of a collected test: `slurm` (marked so, or using the cluster fixture), or
    its file relative to tests/."""
    if item.get_closest_marker("slurm") is not None or "slurm_cluster" in getattr(item, "fixturenames", ()):
        return SLURM_GROUP
    return _file_of(item)


def _file_of(item) -> str:
    path = Path(item.path).resolve()
    try:
        return str(path.relative_to(DURATIONS.parent))
    except ValueError:
        return path.name


def longest_units_first(items: List, seconds: Dict[str, float]) -> List:
    """`items` regrouped by unit, units in decreasing recorded seconds (ties: first collected),
    the tests of a unit in their collected order."""
    units: Dict[str, List] = {}
    for item in items:
        units.setdefault(unit_of(item), []).append(item)

    def unit_seconds(unit: str) -> float:
        files = {_file_of(i) for i in units[unit]}
        return sum(seconds.get(f, UNRECORDED_S) for f in files)

    order = sorted(units, key=lambda u: -unit_seconds(u))  # sorted is stable: ties keep collection order
    return [item for unit in order for item in units[unit]]


def ungrouped(nodeids: List[str]) -> List[str]:
    """The collected ids xdist did not suffix with their group (`path::test@group`).

    Under `--dist loadgroup` xdist 3.8 renames each grouped item by assigning `item._nodeid`;
    pytest 9.2 reads the id from elsewhere, so the rename is lost and every unit silently
    falls apart: a file's tests and the Slurm tests spread over both workers (two workers then
    install Slurm and start two clusters at once). Hence pytest < 9.2 in the dev extra, and
    this check at collection, which stops a run whose grouping did not take."""
    return [nodeid for nodeid in nodeids if nodeid.rfind("@") <= nodeid.rfind("]")]


def is_xdist_worker(config) -> bool:
    """This pytest is a worker of xdist (not a pytest a test started, which inherits a worker's
    environment: the mutation check's, whose lock would wait on its own parent's)."""
    return hasattr(config, "workerinput")


def _lock_paths() -> tuple:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "local")
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"dapo_mega_pytest_{run}"
    return base.with_suffix(".turnstile"), base.with_suffix(".cpu")


@contextmanager
def cpu_turn(exclusive: bool) -> Iterator[None]:
    """Hold the suite's CPU lock for one test: shared, or alone (`exclusive`)."""
    turnstile_path, lock_path = _lock_paths()
    with open(turnstile_path, "a") as turnstile, open(lock_path, "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # in line behind a waiting exclusive test
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class CpuTurns:
    """One worker's turns at the CPU lock, test after test (`cpu_turn` each): an exclusive
    test followed by another exclusive one hands its lock on without letting it go."""

    def __init__(self) -> None:
        self._kept = None
        """The exclusive turn the last test handed on, still held."""

    @contextmanager
    def turn(self, exclusive: bool, next_exclusive: bool) -> Iterator[None]:
        held, self._kept = self._kept, None
        if held is None:
            held = cpu_turn(exclusive)
            held.__enter__()
        try:
            yield
        finally:
            if exclusive and next_exclusive:
                self._kept = held
            else:
                held.__exit__(None, None, None)
