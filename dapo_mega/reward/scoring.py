"""Score a batch of responses with a hard time bound per response.

A verifier is user-facing code run on model output, which can be anything: megabytes of
text, 100k nested braces, a million-digit number, invalid UTF-8, or an expression whose
symbolic evaluation never ends. `score_responses` never raises and never hangs on such
input:

1. Every response is coerced to text (bytes decoded with U+FFFD replacement, lone
   surrogates replaced by "?") and cut to the verifier's `max_response_chars` tail *first*.
2. Fast path: a verifier with `runs_in_process = True` (the DAPO verifier: 300 characters,
   regexes only) is called in this process. Its work is bounded by construction, which a
   process round trip (~100 µs per item, plus pickling) would only slow down; it is still
   timed, and an item over `timeout_s` is scored as a verifier_error like any other.
   A ground truth longer than `MAX_IN_PROCESS_GROUND_TRUTH_CHARS` is not bounded that way
   and goes to the pool.
3. A verifier that `scores_batches` (a reward server, http_verifier.py) gets the whole
   batch in this process: it only waits on the network, with its own bounds per request.
4. Everything else runs in a `VerifierPool` of worker processes, one task at a time per
   worker, each with a deadline; a worker past its deadline is SIGKILLed and replaced.
   Workers are fresh interpreters (`python -m dapo_mega.reward.worker`), not forks of
   the trainer, whose torch/NCCL threads make a fork unsafe, and not multiprocessing
   spawn/forkserver children, which re-import the caller's `__main__` script. A worker
   starts in well under a second (math-verify without torch).

Exceptions, time-outs and dead workers give correct=False, reward=−1,
error="verifier_error: ..." and are counted in the returned VerifyStats.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from dapo_mega import log
from dapo_mega.reward.types import Verifier, VerifyResult, VerifyStats, call_verifier, verifier_error_result
from dapo_mega.tether import popen_tethered

logger = log.get(__name__)

MAX_IN_PROCESS_GROUND_TRUTH_CHARS = 1000
"""Longer ground truths go to the pool even for in-process verifiers (their normalisation
is not bounded by the response tail)."""

_WORKER_START_TIMEOUT_S = 30.0  # a start imports math-verify (~0.6 s on 2 idle cores)

Text = Union[str, bytes, bytearray, None]


def coerce_text(value: Text, max_chars: Optional[int] = None) -> str:
    """Any response as a valid str, cut to its last `max_chars` characters.

    bytes are decoded as UTF-8 with replacement; lone surrogates (from a lenient decoder)
    become "?" so the text can be encoded, pickled and regex-matched safely.
    """
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        if max_chars is not None:
            value = bytes(value[-4 * max_chars:])  # ≤ 4 bytes per UTF-8 character
        text = bytes(value).decode("utf-8", errors="replace")
    elif isinstance(value, str):
        text = value
    else:
        text = str(value)
    if max_chars is not None:
        text = text[-max_chars:]
    return text.encode("utf-8", errors="replace").decode("utf-8")


# --------------------------------------------------------------------------- workers


class _Worker:
    """One `python -m dapo_mega.reward.worker` process and the two pipe ends to it."""

    def __init__(self, verifier_bytes: bytes):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        # the child must unpickle the verifier: give it this process's import path
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self.process = popen_tethered(  # a hung verifier's worker does not outlive a killed trainer
                [sys.executable, "-m", "dapo_mega.reward.worker", str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env, close_fds=True)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.send_conn = multiprocessing.connection.Connection(to_child_w, readable=False)
        self.recv_conn = multiprocessing.connection.Connection(from_child_r, writable=False)
        self.task: Optional[Tuple[int, float]] = None  # (item index, deadline)
        try:
            self.send_conn.send_bytes(verifier_bytes)
        except OSError:
            pass  # the child died already; wait_ready reports it

    def wait_ready(self, timeout_s: float) -> bool:
        try:
            if self.recv_conn.poll(timeout_s):
                return self.recv_conn.recv() == ("ready", None)
        except (EOFError, OSError):
            pass
        return False

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            logger.error("verifier worker %d did not exit after SIGKILL", self.process.pid)
        self.send_conn.close()
        self.recv_conn.close()


class VerifierPool:
    """Worker processes that score responses, each task bounded by a deadline.

    Long-lived: the trainer scores every rollout step through the same pool (workers start
    once; a killed worker is replaced by a fresh one, well under a second). The bound per
    item is `timeout_s`, plus the restart of a worker killed meanwhile (replacements are
    started synchronously, at most `_WORKER_START_TIMEOUT_S`).
    """

    def __init__(self, verifier: Verifier, num_workers: int = 2):
        self.verifier = verifier
        self.num_workers = max(1, num_workers)
        self._verifier_bytes = pickle.dumps(verifier)
        self._workers: List[_Worker] = []
        self._lock = threading.Lock()
        self.num_restarts = 0

    def _start_worker(self) -> Optional[_Worker]:
        try:
            worker = _Worker(self._verifier_bytes)
        except OSError as exc:
            logger.error("verifier worker could not be started: %s", exc)
            return None
        if worker.wait_ready(_WORKER_START_TIMEOUT_S):
            return worker
        logger.error("verifier worker failed to start (exit code %s)", worker.process.poll())
        worker.kill()
        return None

    def _ensure_workers(self) -> None:
        self._workers = [w for w in self._workers if w.process.poll() is None]
        while len(self._workers) < self.num_workers:
            worker = self._start_worker()
            if worker is None:
                break
            self._workers.append(worker)

    def score(self, responses: Sequence[str], ground_truths: Sequence[str], timeout_s: float,
              stats: VerifyStats, metadata: Optional[Sequence[Mapping[str, object]]] = None) -> List[VerifyResult]:
        """Score every item; each gets at most `timeout_s` of a worker's time. `metadata`: N
        problem metadata dicts for verifiers that take them (default: {} each)."""
        with self._lock:
            return self._score_locked(responses, ground_truths, timeout_s, stats,
                                      metadata if metadata is not None else [{}] * len(responses))

    def _score_locked(self, responses, ground_truths, timeout_s, stats, metadata) -> List[VerifyResult]:
        results: List[Optional[VerifyResult]] = [None] * len(responses)
        pending = deque(range(len(responses)))
        self._ensure_workers()
        if not self._workers:
            for i in pending:
                results[i] = verifier_error_result("verifier worker processes could not be started")
                stats.num_exceptions += 1
            return results  # type: ignore[return-value]
        busy: Dict[int, _Worker] = {}  # id(conn) → worker with a task in flight
        idle = list(self._workers)
        while pending or busy:
            while pending and idle:
                worker = idle.pop()
                index = pending.popleft()
                try:
                    worker.send_conn.send((index, responses[index], ground_truths[index], dict(metadata[index])))
                except (OSError, ValueError, pickle.PicklingError) as exc:
                    results[index] = verifier_error_result(f"could not send to worker: {exc}")
                    stats.num_exceptions += 1
                    replacement = self._replace(worker)
                    if replacement is not None:
                        idle.append(replacement)
                    continue
                worker.task = (index, time.monotonic() + timeout_s)
                busy[id(worker.recv_conn)] = worker
            if not busy:
                if pending and not idle:  # every worker failed to restart
                    for index in pending:
                        results[index] = verifier_error_result("no verifier worker available")
                        stats.num_exceptions += 1
                    pending.clear()
                continue
            next_deadline = min(w.task[1] for w in busy.values())  # type: ignore[index]
            ready = multiprocessing.connection.wait([w.recv_conn for w in busy.values()],
                                                    timeout=max(0.0, next_deadline - time.monotonic()))
            for conn in ready:
                worker = busy.pop(id(conn))
                index = worker.task[0]  # type: ignore[index]
                worker.task = None
                try:
                    reply_index, (correct, reward, extracted, error, components) = conn.recv()
                    assert reply_index == index, (reply_index, index)
                    results[index] = VerifyResult(correct, reward, extracted, error, components)
                    if error is not None:
                        stats.num_exceptions += 1
                    idle.append(worker)
                except (EOFError, OSError):
                    worker.kill()
                    exitcode = worker.process.returncode
                    results[index] = verifier_error_result(f"worker died (exit code {exitcode})")
                    stats.num_worker_deaths += 1
                    replacement = self._replace(worker)
                    if replacement is not None:
                        idle.append(replacement)
            now = time.monotonic()
            for key, worker in list(busy.items()):
                index, deadline = worker.task  # type: ignore[misc]
                if now >= deadline:
                    del busy[key]
                    results[index] = verifier_error_result(f"timeout after {timeout_s:g}s")
                    stats.num_timeouts += 1
                    replacement = self._replace(worker)
                    if replacement is not None:
                        idle.append(replacement)
        return results  # type: ignore[return-value]

    def _replace(self, worker: _Worker) -> Optional[_Worker]:
        worker.kill()
        self.num_restarts += 1
        replacement = self._start_worker()
        self._workers = [w for w in self._workers if w is not worker]
        if replacement is not None:
            self._workers.append(replacement)
        return replacement

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                try:
                    worker.send_conn.send(None)
                except (OSError, ValueError):
                    pass
            for worker in self._workers:
                try:
                    worker.process.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
                worker.kill()
            self._workers = []


_POOLS: Dict[bytes, VerifierPool] = {}
_POOLS_LOCK = threading.Lock()


def get_verifier_pool(verifier: Verifier, num_workers: Optional[int] = None) -> VerifierPool:
    """The shared pool of this verifier (same pickled verifier → same pool), created lazily."""
    key = pickle.dumps(verifier)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            workers = num_workers if num_workers is not None else max(1, min(4, os.cpu_count() or 1))
            pool = _POOLS[key] = VerifierPool(verifier, workers)
        return pool


@atexit.register
def close_verifier_pools() -> None:
    """Stop every shared verifier pool (also runs at interpreter exit)."""
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()


# --------------------------------------------------------------------------- entry point


def score_responses(
    verifier: Verifier,
    responses: Sequence[Text],
    ground_truths: Sequence[str],
    timeout_s: float = 5.0,
    answer_prefixes: Optional[Sequence[str]] = None,
    pool: Optional[VerifierPool] = None,
    metadata: Optional[Sequence[Mapping[str, object]]] = None,
) -> Tuple[List[VerifyResult], VerifyStats]:
    """Score responses against ground truths; never raises on bad input, never hangs.

    Args:
        verifier: a `Verifier` (see `build_verifier`).
        responses: N model responses (str, or raw bytes which are decoded leniently).
        ground_truths: N reference answers.
        timeout_s: hard bound on each response's verification; over it → verifier_error.
        answer_prefixes: optional N strings prepended to each response before scoring: the
            tail of the prompt that belongs to the answer (the synthetic task's prompt ends
            with "Answer:" and the model only writes " 46\\n"). Empty for real datasets.
        pool: the worker pool for verifiers that cannot run in-process; default a shared
            pool per verifier.
        metadata: optional N problem metadata dicts, given to verifiers that take them (a
            reward plugin's third argument; see reward/plugin.py); default {} each.

    Returns:
        (results, stats): N VerifyResults in input order, and the counts of this call.
    """
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    if answer_prefixes is not None and len(answer_prefixes) != len(responses):
        raise ValueError(f"{len(answer_prefixes)} answer prefixes for {len(responses)} responses")
    if metadata is not None and len(metadata) != len(responses):
        raise ValueError(f"{len(metadata)} metadata dicts for {len(responses)} responses")
    metadata = metadata if metadata is not None else [{}] * len(responses)
    start = time.monotonic()
    stats = VerifyStats(num_responses=len(responses))
    window = verifier.max_response_chars
    texts: List[str] = []
    for i, response in enumerate(responses):
        text = coerce_text(response, window)
        if answer_prefixes is not None and answer_prefixes[i]:
            text = coerce_text(answer_prefixes[i] + text, window)
        texts.append(text)
    truths = [coerce_text(gt) for gt in ground_truths]

    if getattr(verifier, "scores_batches", False):  # a reward server: batches, in this process
        results = verifier.score_batch(texts, truths, metadata, timeout_s, stats)  # type: ignore[attr-defined]
        stats.num_errors = sum(1 for r in results if r.error is not None)
        stats.seconds = time.monotonic() - start
        return results, stats

    results: List[Optional[VerifyResult]] = [None] * len(texts)
    pooled: List[int] = []
    for i, (text, truth) in enumerate(zip(texts, truths)):
        if not verifier.runs_in_process or len(truth) > MAX_IN_PROCESS_GROUND_TRUTH_CHARS:
            pooled.append(i)
            continue
        item_start = time.monotonic()
        try:
            result = call_verifier(verifier, text, truth, metadata[i])
        except Exception as exc:  # noqa: BLE001 - scored, counted, never raised
            result = verifier_error_result(f"{type(exc).__name__}: {str(exc)[:200]}")
            stats.num_exceptions += 1
        elapsed = time.monotonic() - item_start
        stats.max_item_seconds = max(stats.max_item_seconds, elapsed)
        if elapsed > timeout_s and result.error is None:
            result = verifier_error_result(f"timeout: took {elapsed:.3g}s > {timeout_s:g}s in process")
            stats.num_timeouts += 1
        results[i] = result
        stats.num_in_process += 1

    if pooled:
        pool = pool or get_verifier_pool(verifier)
        pooled_results = pool.score([texts[i] for i in pooled], [truths[i] for i in pooled], timeout_s, stats,
                                    metadata=[metadata[i] for i in pooled])
        for i, result in zip(pooled, pooled_results):
            results[i] = result
        stats.num_in_pool = len(pooled)

    stats.num_errors = sum(1 for r in results if r is not None and r.error is not None)
    stats.seconds = time.monotonic() - start
    return results, stats  # type: ignore[return-value]
