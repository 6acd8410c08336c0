"""The embedded engine's generation core: a queue of sequences and one generation thread
that batches, caches and samples them on a `ModelRunner` (`model_runner.py`).

`GenerationEngine` owns the queue and the thread. The thread collects queued sequences while
they keep arriving (at most `batch_wait_s`), left-pads them into one batch, prefills, then
decodes token by token with the model's KV cache, dropping finished rows from the cache as
it goes. Batching is continuous, as SGLang's: between two decode steps, sequences queued
meanwhile join the running batch (up to `max_running_requests`): they are prefilled on
their own and their KV cache is merged into the batch's, both left-padded to one width
(`kv_cache.merge_caches`); columns that no live row uses any more are trimmed from the left
(`kv_cache.trim_cache`), so a long-lived batch does not grow. (transformers < 4.56, whose
caches have no `.layers`: newcomers wait for the next batch.) Each step samples one token
per row (`sampling.sample_tokens`, SGLang's sampler) stamped with the weight version of
that step. The HTTP layer (`server.py`) never touches the model: it enqueues sequences, and
weight updates go through `ModelRunner.load_named_tensors` (or a broadcast straight into the
parameters, `flat_weights.BucketReceiver`), which take the same lock as a forward step, so a
step never sees half-loaded weights.

Limits (as SGLang 0.5.23): at most `max_running_requests` sequences run in one batch; the
rest wait in a queue (bounded by `max_queued_requests` when set); the HTTP layer refuses
prompts that do not fit the context. `abort` finishes chosen sequences (SGLang's
`/abort_request`), `shutdown` finishes every one with finish_reason abort so a SIGTERM
never waits for a generation to run out.

Pausing (SGLang's `/pause_generation` modes): `abort` finishes running and queued
sequences at once with finish_reason abort; `in_place` stops between decode steps and
keeps the KV cache (tokens after a weight update then attend to keys computed by the old
weights, as in SGLang); `retract` stops likewise but drops the KV cache, which is
recomputed from prompt + output so far on `continue` (with the then-current weights).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional, Sequence, Tuple

import torch

from dapo_mega.engines.embedded.kv_cache import MERGEABLE_CACHES, merge_caches, trim_cache
from dapo_mega.engines.embedded.model_runner import ModelRunner
from dapo_mega.engines.embedded.sampling import Sequence_, sample_tokens

logger = logging.getLogger(__name__)


class GenerationEngine:
    """Batched generation on one HF model with pause / weight-update hooks (CPU or GPU)."""

    def __init__(self, model_path: str, dtype: str = "float32", max_running_requests: int = 256,
                 weight_version: str = "default", batch_wait_s: float = 0.005, seed: int = 0,
                 enable_weights_cpu_backup: bool = False, device: str = "cpu",
                 max_queued_requests: Optional[int] = None, decode_delay_s: float = 0.0):
        self.runner = ModelRunner(model_path, dtype=dtype, weight_version=weight_version,
                                  enable_weights_cpu_backup=enable_weights_cpu_backup, device=device)
        self.max_running_requests = max_running_requests
        self.max_queued_requests = max_queued_requests
        self.batch_wait_s = batch_wait_s
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._cv = threading.Condition()
        self._waiting: List[Sequence_] = []
        self._running: List[Sequence_] = []
        self._paused = False
        self._pause_mode = "abort"
        self._recompute_kv = False
        self._stop = False
        self._abort_rids: set = set()
        self._abort_all = False
        self.max_batch_seen = 0
        self.num_generated_tokens = 0
        self.num_forward_steps = 0
        """Model forward calls (prefill or decode of a batch): the engine's cost on a small model."""
        self.last_step_time = time.monotonic()
        """When the last forward step ended (or the engine started): its progress, for /health."""
        self.decode_delay_s = float(decode_delay_s)
        """Test clock only (the server refuses it outside tests and benchmarks): a sleep after
        every forward step, so that a tiny model decodes at a large model's pace."""
        self._thread = threading.Thread(target=self._loop, name="generation", daemon=True)
        self._thread.start()

    def load(self) -> Tuple[int, int]:
        """(sequences running, sequences waiting): SGLang's /v1/loads num_running_reqs /
        num_waiting_reqs."""
        with self._cv:
            return len(self._running), len(self._waiting)

    def kv_tokens(self) -> Tuple[int, int]:
        """(tokens in the running sequences' KV cache, the most it holds: max_running_requests
        sequences of the model's context): SGLang's /v1/loads num_used_tokens /
        max_total_num_tokens."""
        with self._cv:
            used = sum(len(s.prompt_ids) + len(s.output_ids) for s in self._running)
        return used, self.max_running_requests * self.runner.max_context

    def is_idle(self) -> bool:
        """Nothing running, and nothing waiting unless paused (SGLang's release condition)."""
        running, waiting = self.load()
        return running == 0 and (waiting == 0 or self._paused)

    def is_progressing(self, stall_s: float) -> bool:
        """The generation thread is alive and, with sequences to run, made a forward step
        within `stall_s` (SGLang's /health: output since the probe began, else 503)."""
        if not self._thread.is_alive():
            return False
        with self._cv:
            busy = bool(self._running or self._waiting) and not self._paused and not self.runner.weights_released
        return not busy or time.monotonic() - self.last_step_time < stall_s

    # ------------------------------------------------------------------ requests
    def new_generator(self, seed: Optional[int]) -> torch.Generator:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return torch.Generator().manual_seed(int(seed))

    def submit(self, seqs: Sequence[Sequence_]) -> bool:
        """Queue `seqs`; False (nothing queued) when the queue would exceed max_queued_requests."""
        with self._cv:
            if self._stop:
                return False
            if self.max_queued_requests is not None and \
                    len(self._waiting) + len(seqs) > self.max_queued_requests:
                return False
            self._waiting.extend(seqs)
            self._cv.notify_all()
            return True

    def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """Finish the sequences of request `rid` (or every one) with finish_reason abort.

        Queued ones finish at once; running ones after the forward step in flight.
        """
        def hit(seq: Sequence_) -> bool:
            return abort_all or (bool(rid) and (seq.rid == rid or seq.rid.startswith(f"{rid}_")))

        with self._cv:
            for seq in [s for s in self._waiting if hit(s)]:
                self._finish(seq, {"type": "abort", "message": "Abort by abort_request."})
            if abort_all:
                self._abort_all = bool(self._running)
            elif rid:
                self._abort_rids |= {s.rid for s in self._running if hit(s)}

    def pause(self, mode: str, answered_timeout_s: float = 60.0) -> None:
        """Stop generating (see module docstring for the modes); returns once the thread is idle,
        and in mode abort once every aborted request is answered (SGLang's tokenizer manager
        returns only when no request is in flight), waiting at most `answered_timeout_s`."""
        with self._cv:
            self._paused, self._pause_mode = True, mode
            if mode == "retract":
                self._recompute_kv = True
            if mode == "abort":
                for seq in list(self._waiting):
                    self._finish(seq, {"type": "abort", "message": "Abort by pause_generation."})
            self._cv.notify_all()
        # Wait until the step in flight has finished: after this returns no forward runs.
        with self.runner.model_lock:
            pass
        if mode == "abort":  # the thread finishes the running rows at its next loop turn
            deadline = time.monotonic() + answered_timeout_s
            with self._cv:
                while self._running and self._thread.is_alive() and time.monotonic() < deadline:
                    self._cv.wait(timeout=min(0.5, max(deadline - time.monotonic(), 0.0)))

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def flush_cache(self) -> bool:
        """Drop cached KV; SGLang refuses while requests hold it (in_place pause)."""
        with self._cv:
            if self._running and not self._recompute_kv:
                return False
            return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop generating: every queued or running sequence finishes with finish_reason abort
        (running ones after the forward step in flight); waits up to `timeout_s` for the thread."""
        with self._cv:
            self._stop = True
            for seq in list(self._waiting):
                self._finish(seq, {"type": "abort", "message": "The server is shutting down."})
            self._cv.notify_all()
        self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ memory
    def release_weights(self) -> None:
        """Free the parameter storage (`ModelRunner.release_weights`); call when idle."""
        self.runner.release_weights()

    def resume_weights(self) -> None:
        """Reallocate the parameters (`ModelRunner.resume_weights`) and wake the thread."""
        self.runner.resume_weights()
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ generation thread
    def _finish(self, seq: Sequence_, reason: dict) -> None:
        """The one way a sequence ends: the engine's own state drops it first (off the running
        batch and the queue), and only then is its request answered. Every endpoint that reports
        that state (/flush_cache, /v1/loads, the idle check before a release) counts only
        sequences that have not finished, so a client that acts on its reply at once (an
        aborted reply, then /flush_cache) never sees the request it was just answered for."""
        with self._cv:  # an RLock: callers may hold it already
            seq.finish_reason = reason
            seq.end_time = time.monotonic()
            self._running = [s for s in self._running if s is not seq]
            self._waiting = [s for s in self._waiting if s is not seq]
            self._cv.notify_all()
        try:
            seq.on_done(seq)
        except Exception:  # a closed event loop must not kill the generation thread
            logger.exception("on_done callback failed")

    def _take_batch(self) -> List[Sequence_]:
        with self._cv:
            while not self._stop and (not self._waiting or self._paused or self.runner.weights_released):
                self._cv.wait(timeout=0.5)
            if self._stop:
                return []
        self._gather_arrivals()
        with self._cv:
            if self._paused or self.runner.weights_released:
                return []
            batch = self._waiting[: self.max_running_requests]
            del self._waiting[: len(batch)]
            self._running = list(batch)
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            return batch

    def _gather_arrivals(self, quiet_s: float = 0.001) -> None:
        """Let requests sent together join one batch: wait while sequences keep arriving
        (none for `quiet_s` ends it), for at most `batch_wait_s`. A trainer sends its first
        requests of a step within a few ms; a fixed wait cost every new batch the whole window
        (2-3 batches per rollout step on the CPU default: 10-15 ms of a ~85 ms step)."""
        deadline = time.monotonic() + self.batch_wait_s
        with self._cv:
            seen = len(self._waiting)
        while time.monotonic() < deadline:
            time.sleep(min(quiet_s, max(deadline - time.monotonic(), 0.0)))
            with self._cv:
                if len(self._waiting) == seen:
                    return
                seen = len(self._waiting)

    def _admit(self, running: int) -> List[Sequence_]:
        """Queued sequences that join a running batch of `running` rows (call under `_cv`)."""
        room = self.max_running_requests - running
        if (room <= 0 or not self._waiting or self._paused or self._stop or self.runner.weights_released
                or not MERGEABLE_CACHES):
            return []
        admitted = self._waiting[:room]
        del self._waiting[:len(admitted)]
        now = time.monotonic()
        for seq in admitted:
            seq.start_time = now
        self._running.extend(admitted)
        self.max_batch_seen = max(self.max_batch_seen, running + len(admitted))
        return admitted

    def _loop(self) -> None:
        while not self._stop:
            batch = self._take_batch()
            if not batch:
                continue
            try:
                self._run_batch(batch)
            except Exception as exc:  # report, never hang the HTTP side
                logger.exception("generation failed")
                with self._cv:  # the batch and every sequence that joined it since
                    unfinished = list(self._running)
                for seq in unfinished:
                    self._finish(seq, {"type": "abort", "message": f"engine error: {exc}"})
            finally:
                with self._cv:
                    self._running = []

    def _run_batch(self, batch: List[Sequence_]) -> None:
        now = time.monotonic()
        for seq in batch:
            seq.start_time = now
        rows = list(batch)
        cache, mask, need_prefill = None, None, True
        while rows:
            admitted: List[Sequence_] = []
            with self._cv:
                if self._paused:
                    if self._pause_mode == "abort":
                        for seq in rows:
                            self._finish(seq, {"type": "abort", "message": "Abort by pause_generation."})
                        return
                    while self._paused and not self._stop:
                        self._cv.wait(timeout=0.5)
                if self._recompute_kv:
                    need_prefill, cache, self._recompute_kv = True, None, False
                if self._stop:
                    for seq in rows:
                        self._finish(seq, {"type": "abort", "message": "The server is shutting down."})
                    return
                if self._abort_all or self._abort_rids:
                    gone = [i for i, r in enumerate(rows) if self._abort_all or r.rid in self._abort_rids]
                    self._abort_all = False
                    self._abort_rids -= {rows[i].rid for i in gone}
                    for i in gone:
                        self._finish(rows[i], {"type": "abort", "message": "Abort by abort_request."})
                    if gone:
                        keep = [i for i in range(len(rows)) if i not in set(gone)]
                        rows = [rows[i] for i in keep]
                        if not rows:
                            return
                        if cache is not None:
                            cache.batch_select_indices(torch.tensor(keep, dtype=torch.long).to(self.runner.device))
                            mask = mask[torch.tensor(keep, dtype=torch.long)]
                admitted = self._admit(len(rows))
                if need_prefill:  # the whole batch is prefilled anyway: newcomers simply join
                    rows, admitted = rows + admitted, []
            with self.runner.model_lock, torch.no_grad():
                if self.runner.weights_released:
                    need_prefill = True
                    rows += admitted
                    continue
                if need_prefill:
                    logits, cache, mask = self.runner.forward_prefill(rows)
                    need_prefill = False
                else:
                    logits, cache, mask = self.runner.forward_decode(rows, cache, mask)
                    if admitted:
                        new_logits, new_cache, new_mask = self.runner.forward_prefill(admitted)
                        logits = torch.cat([logits, new_logits])
                        cache, mask = merge_caches(cache, mask, new_cache, new_mask)
                        rows = rows + admitted
                version = self.runner.weight_version
                self.num_forward_steps += 1
            if self.decode_delay_s:
                time.sleep(self.decode_delay_s)
            self.last_step_time = time.monotonic()
            uniforms = torch.tensor([r.next_uniform(logits.dtype) for r in rows], dtype=logits.dtype)
            tokens, logprobs = sample_tokens(logits, [r.spec for r in rows], uniforms)
            keep = []
            for i, (seq, token, logprob) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist())):
                seq.append(token, logprob, version)
                self.num_generated_tokens += 1
                reason = self._stop_reason(seq)
                if reason is None:
                    keep.append(i)
                else:
                    self._finish(seq, reason)
            if len(keep) < len(rows):
                rows = [rows[i] for i in keep]
                if rows:
                    index = torch.tensor(keep, dtype=torch.long)
                    cache.batch_select_indices(index.to(self.runner.device))
                    mask = mask[index]
                    cache, mask = trim_cache(cache, mask)

    def _stop_reason(self, seq: Sequence_) -> Optional[dict]:
        spec, token, n = seq.spec, seq.output_ids[-1], len(seq.output_ids)
        if n >= spec.min_new_tokens:
            # ignore_eos ignores stop_token_ids too (SGLang's Req._check_token_based_finish)
            if not spec.ignore_eos and (token in self.runner.eos_token_ids or token in spec.stop_token_ids):
                return {"type": "stop", "matched": token}
            if spec.stop:
                tail = self.runner.tokenizer.decode(seq.output_ids[-64:], skip_special_tokens=spec.skip_special_tokens)
                for s in spec.stop:
                    if s and s in tail:
                        return {"type": "stop", "matched": s}
        if n >= spec.max_new_tokens or len(seq.prompt_ids) + n >= self.runner.max_context:
            return {"type": "length", "length": n}
        return None
