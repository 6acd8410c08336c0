"""Running a coroutine from synchronous code: one rule for the rollout rounds, evaluation, the
audit and the HTTP verifier."""

from __future__ import annotations

import asyncio
import concurrent.futures


def run_coroutine(coro):
    """Run `coro` to completion on a fresh event loop: in this thread, or in a helper thread
    when this one already runs a loop (a caller inside async code). Not `asyncio.run`: on
    Python 3.11 its SIGINT handler check at exit formats the repr of the finished task, result
    included, which costs more than a small rollout round."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_here(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as helper:
        return helper.submit(_run_here, coro).result()


def _run_here(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
