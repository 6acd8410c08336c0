"""The engine book (engines/book.py): the one record of which engines serve, are dead or
rejoin; what the policy sync reads of it between two weight syncs (`BookView.changes_since`),
held to the rule the sync followed before the book (dropped once, back once, a restart both);
and the rule that no other module keeps an engine set of its own."""

import ast
import threading
from pathlib import Path

from dapo_mega.engines.book import BookView, EngineBook

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
PACKAGE = Path(__file__).resolve().parents[2] / "dapo_mega"


def test_an_engine_moves_serving_dead_rejoining_serving_and_keeps_its_first_reason():
    book = EngineBook([A, B])
    assert [e.url for e in book.serving()] == [A, B]
    book.mark_dead(B, "hung")
    book.mark_dead(B, "connection refused")  # the first reason is the cause
    book.mark_dead("http://elsewhere:9", "x")  # another book's engine: ignored
    assert book.dead() == {B: "hung"} and [e.url for e in book.serving()] == [A]
    _rejoin(book, B)
    assert [e.url for e in book.serving()] == [A] and book.rejoining() == [B]  # weights first
    book.serve_again([B])
    assert [e.url for e in book.serving()] == [A, B] and book.view() == BookView({}, (), {B: 1})


def test_probe_dead_keeps_silent_engines_dead():
    book = EngineBook([A])
    book.mark_dead(A, "refused")
    assert book.probe_dead(timeout_s=0.5) == [] and book.dead() == {A: "refused"}


def test_changes_between_views_drop_once_readmit_once_and_see_a_restart():
    book = EngineBook([A, B, C])
    seen = book.view()
    assert seen.changes_since(BookView()) == ([], [])
    book.mark_dead(B, "hung")
    now = book.view()
    assert now.changes_since(seen) == ([B], [])
    assert book.view().changes_since(now) == ([], [])  # still dead: not dropped twice
    seen = now
    _rejoin(book, B)
    now = book.view()
    assert now.changes_since(seen) == ([], [B])  # back: rejoins the sync, serves after it
    seen = now
    # C dies and answers again between two syncs (restarted at its address): out and in at once
    book.mark_dead(C, "restarted while the learner trained")
    _rejoin(book, C)
    now = book.view()
    assert now.changes_since(seen) == ([C], [C])
    seen = now
    # B, rejoining but not serving yet, dies and comes back again: its groups went with it
    book.mark_dead(B, "refused")
    _rejoin(book, B)
    assert book.view().changes_since(seen) == ([B], [B])


def test_the_book_is_one_lock_for_every_thread():
    book = EngineBook([A, B])

    def count():
        for _ in range(2000):
            book.count_finished()

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert book.finished_requests() == 8000


def test_load_peaks_are_kept_until_taken():
    book = EngineBook([A, B])
    book.observe_loads(A, [{"num_used_tokens": 30, "max_total_num_tokens": 100, "num_running_reqs": 2}])
    book.observe_loads(A, [{"num_used_tokens": 10, "max_total_num_tokens": 100, "num_running_reqs": 5}])
    book.observe_loads(B, [{"num_used_tokens": 60, "max_total_num_tokens": 200, "num_running_reqs": 1}])
    assert book.take_load_metrics() == {"engine/kv_used_tokens_peak": 60.0, "engine/running_requests_peak": 5.0,
                                        "engine/kv_capacity_tokens": 100.0, "engine/kv_usage_peak": 0.3}
    assert book.take_load_metrics() == {}


def test_no_module_but_the_book_keeps_an_engine_set():
    """Which engines are dead or rejoining is written nowhere but engines/book.py: no other
    module assigns an attribute of that name (the manager, the dispatcher's counter, the
    policy sync and the driver role each held a copy before)."""
    names = {"dead", "rejoining", "dropped", "rejoined", "_dead", "_rejoining", "_finished_requests"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "engines" / "book.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in names:
                    name = t.attr
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}")
        found += [f"{path.relative_to(PACKAGE)} global {n}" for n in names
                  if f"\nglobal {n}" in path.read_text() or f"global {n}\n" in path.read_text()]
    assert not found, found


def _rejoin(book: EngineBook, url: str) -> None:
    """What probe_dead does when `url` answers /health again."""
    with book._lock:
        book._dead.pop(url)
        book._rejoining.append(url)
