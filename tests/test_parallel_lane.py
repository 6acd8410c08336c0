"""The two-worker suite's rules (tests/helpers/parallel.py): files are units handed out
longest first, the Slurm tests are one unit, and an exclusive test runs alone: it waits for
the tests already running and holds back any that would start after it asked."""

import threading
import time
from pathlib import Path

from helpers import parallel


class _Item:
    def __init__(self, path: str, *markers: str, fixturenames=()):
        self.path = parallel.DURATIONS.parent / path
        self.markers = set(markers)
        self.fixturenames = list(fixturenames)

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def test_units_are_files_or_slurm_and_go_longest_first():
    a1, a2 = _Item("a/test_a.py"), _Item("a/test_a.py")
    b, c = _Item("test_b.py"), _Item("test_c.py")
    s1, s2 = _Item("launch/test_jobs.py", "slurm"), _Item("ablation/test_runs.py", "slurm")
    new = _Item("test_new.py")
    items = [a1, b, s1, a2, c, s2, new]
    seconds = {"a/test_a.py": 100.0, "test_b.py": 5.0, "test_c.py": 300.0, "launch/test_jobs.py": 90.0,
               "ablation/test_runs.py": 30.0}
    assert [parallel.unit_of(i) for i in (a1, s1, s2)] == [str(Path("a/test_a.py")), "slurm", "slurm"]
    # c 300 > slurm 90 + 30 > a 100 > new (unrecorded, 60) > b 5; a unit's tests keep their order
    assert parallel.longest_units_first(items, seconds) == [c, s1, s2, a1, a2, new, b]
    # a test that starts the cluster through its fixture, unmarked, still joins the Slurm unit
    assert parallel.unit_of(_Item("launch/test_other.py", fixturenames=["tmp_path", "slurm_cluster"])) == "slurm"


def test_an_exclusive_test_waits_for_running_ones_and_holds_back_later_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    inside, release = [], {name: threading.Event() for name in ("shared_a", "exclusive", "shared_b")}

    def hold(name: str, exclusive: bool) -> None:
        with parallel.cpu_turn(exclusive):
            inside.append(name)
            release[name].wait(30)

    def start(name: str, exclusive: bool) -> threading.Thread:
        t = threading.Thread(target=hold, args=(name, exclusive), daemon=True)
        t.start()
        time.sleep(0.3)  # long enough for it to block, or to get in
        return t

    threads = [start("shared_a", False), start("exclusive", True), start("shared_b", False)]
    assert inside == ["shared_a"]  # the exclusive one waits; the later shared one waits behind it
    release["shared_a"].set()
    time.sleep(0.3)
    assert inside == ["shared_a", "exclusive"]
    release["exclusive"].set()
    time.sleep(0.3)
    assert inside == ["shared_a", "exclusive", "shared_b"]
    release["shared_b"].set()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_exclusive_tests_in_a_row_keep_the_lock_between_them(tmp_path, monkeypatch):
    """A file of exclusive tests waits once for the other worker, not once per test: a shared
    test that asked while the first ran gets in only after the last."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    inside, release = [], {name: threading.Event() for name in ("first", "second", "shared")}
    turns = parallel.CpuTurns()

    def worker_a() -> None:
        for name, next_exclusive in (("first", True), ("second", False)):
            with turns.turn(True, next_exclusive):
                inside.append(name)
                release[name].wait(30)

    def worker_b() -> None:
        with parallel.cpu_turn(False):
            inside.append("shared")
            release["shared"].wait(30)

    a = threading.Thread(target=worker_a, daemon=True)
    a.start()
    time.sleep(0.3)
    b = threading.Thread(target=worker_b, daemon=True)
    b.start()
    time.sleep(0.3)
    assert inside == ["first"]
    release["first"].set()
    time.sleep(0.3)
    assert inside == ["first", "second"]  # handed on: the waiting shared test did not get in between
    release["second"].set()
    time.sleep(0.3)
    assert inside == ["first", "second", "shared"]
    release["shared"].set()
    for t in (a, b):
        t.join(5)
    assert not any(t.is_alive() for t in (a, b))


def test_ids_that_lost_their_group_are_found():
    """pytest 9.2 drops the `@group` suffix xdist 3.8 gives under loadgroup: caught at collection."""
    grouped = ["tests/a/test_a.py::test_x@a/test_a.py", "tests/launch/test_jobs.py::test_y[p@q]@slurm"]
    lost = ["tests/a/test_a.py::test_z", "tests/b/test_b.py::test_w[user@host]"]
    assert parallel.ungrouped(grouped + lost) == lost
