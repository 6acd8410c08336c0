"""The embedded engine's generation core: batched sampling with a KV cache on a HF model.

`GenerationEngine` owns a transformers `AutoModelForCausalLM`, a queue of sequences and one
generation thread. The forward is transformers' own, so every family it loads (Qwen2, Qwen3
with its q/k norms and head_dim, Llama with llama3 RoPE scaling) is computed as transformers
computes it; this module only batches, caches and samples. The thread collects queued sequences while they keep arriving (at most
`batch_wait_s`), left-pads them into one batch, prefills, then decodes token by token with
the model's KV cache, dropping finished rows from the cache as it goes. Batching is continuous, as SGLang's: between two
decode steps, sequences queued meanwhile join the running batch (up to
`max_running_requests`): they are prefilled on their own and their KV cache is merged into
the batch's, both left-padded to one width (`merge_caches`); columns that no live row uses
any more are trimmed from the left (`trim_cache`), so a long-lived batch does not grow.
(transformers < 4.56, whose caches have no `.layers`: newcomers wait for the next batch.)
The HTTP layer (`server.py`) never touches the model: it enqueues sequences, and weight
updates go through `load_named_tensors`, which takes the same lock as a forward step, so a
step never sees half-loaded weights.

Sampling follows SGLang 0.5.23 (`srt/layers/sampler.py`), per row:

    p = softmax(z / T)                      (T = temperature; T < 1e-5 means greedy)
    p' = top-k, then top-p, then min-p filtered p, renormalised
    y ~ p'
    reported logprob = log p[y]            (temperature-scaled, *before* top-k/top-p;
                                             greedy rows report log_softmax(z)[y])

Every generated token is stamped with the weight version current at the forward step that
produced it; runs of equal versions become SGLang's `weight_versions` spans.

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
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

GREEDY_EPS = 1e-5
UNIFORM_BLOCK = 16
"""Uniform numbers a sequence draws from its generator at a time (`Sequence_.next_uniform`)."""


def _cache_kwarg() -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; accept either release."""
    import inspect

    from transformers import PreTrainedModel  # noqa: F401
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


_CACHE_KWARG = _cache_kwarg()


def _cache_of(out):
    return getattr(out, "cache", None) if _CACHE_KWARG == "cache" else out.past_key_values


@dataclass
class SamplingSpec:
    """One request's sampling parameters (SGLang SamplingParams names)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: Tuple[str, ...] = ()
    stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Optional[int] = None


@dataclass
class Sequence_:
    """One sample being generated. `on_done(seq)` is called from the engine thread."""

    prompt_ids: List[int]
    spec: SamplingSpec
    on_done: Callable[["Sequence_"], None]
    generator: torch.Generator
    rid: str = ""
    """The request id (SGLang's rid); `/abort_request` aborts by it."""
    output_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    spans: List[Dict[str, object]] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    enqueue_time: float = field(default_factory=time.monotonic)
    start_time: Optional[float] = None
    end_time: Optional[float] = None
    _uniforms: List[float] = field(default_factory=list, repr=False)
    """Uniform numbers drawn from `generator` ahead, in reverse order (`next_uniform`)."""

    def next_uniform(self, dtype: torch.dtype) -> float:
        """The next uniform number of this sequence's generator. Drawn UNIFORM_BLOCK at a time:
        torch draws a block in the order of single draws (same numbers, same tokens), and a
        batch of 256 rows then costs one list read per row instead of one torch call."""
        if not self._uniforms:
            self._uniforms = torch.rand(UNIFORM_BLOCK, generator=self.generator, dtype=dtype).tolist()[::-1]
        return self._uniforms.pop()

    def append(self, token: int, logprob: float, version: str) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        n = len(self.output_ids)
        if self.spans and self.spans[-1]["version"] == version:
            self.spans[-1]["end"] = n
        else:
            self.spans.append({"version": version, "start": n - 1, "end": n})


class GenerationEngine:
    """Batched generation on one HF model with pause / weight-update hooks (CPU or GPU)."""

    def __init__(self, model_path: str, dtype: str = "float32", max_running_requests: int = 256,
                 weight_version: str = "default", batch_wait_s: float = 0.005, seed: int = 0,
                 enable_weights_cpu_backup: bool = False, device: str = "cpu",
                 max_queued_requests: Optional[int] = None, decode_delay_s: float = 0.0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch_dtype = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16, "half": torch.float16, "auto": torch.float32}[dtype]
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model_path = model_path
        self.weight_version = str(weight_version)
        self.max_running_requests = max_running_requests
        self.max_queued_requests = max_queued_requests
        self.batch_wait_s = batch_wait_s
        self.enable_weights_cpu_backup = enable_weights_cpu_backup
        self.tied_embeddings = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._seed_rng = torch.Generator().manual_seed(seed)
        self.params: Dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        self._param_shapes = {k: tuple(v.shape) for k, v in self.params.items()}
        self._backup: Dict[str, torch.Tensor] = {}
        self.weights_released = False
        # model_lock: held by every forward step and every weight load / release.
        self.model_lock = threading.RLock()
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
            return sum(1 for s in self._running if s.finish_reason is None), len(self._waiting)

    def kv_tokens(self) -> Tuple[int, int]:
        """(tokens in the running sequences' KV cache, the most it holds: max_running_requests
        sequences of the model's context): SGLang's /v1/loads num_used_tokens /
        max_total_num_tokens."""
        with self._cv:
            used = sum(len(s.prompt_ids) + len(s.output_ids) for s in self._running if s.finish_reason is None)
        return used, self.max_running_requests * self.max_context

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
            busy = bool(self._running or self._waiting) and not self._paused and not self.weights_released
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
            self._waiting = [s for s in self._waiting if s.finish_reason is None]
            if abort_all:
                self._abort_all = bool(self._running)
            elif rid:
                self._abort_rids |= {s.rid for s in self._running if hit(s)}

    def pause(self, mode: str) -> None:
        """Stop generating (see module docstring for the modes); returns once the thread is idle."""
        with self._cv:
            self._paused, self._pause_mode = True, mode
            if mode == "retract":
                self._recompute_kv = True
            if mode == "abort":
                for seq in self._waiting:
                    self._finish(seq, {"type": "abort", "message": "Abort by pause_generation."})
                self._waiting.clear()
            self._cv.notify_all()
        # Wait until the step in flight has finished: after this returns no forward runs.
        with self.model_lock:
            pass

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
            for seq in self._waiting:
                self._finish(seq, {"type": "abort", "message": "The server is shutting down."})
            self._waiting.clear()
            self._cv.notify_all()
        self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ weights
    def check_named_meta(self, names: Sequence[str], dtypes: Sequence[str],
                         shapes: Sequence[Sequence[int]]) -> Optional[str]:
        """None if every (name, dtype, shape) can be loaded, else a message naming the first bad one."""
        from dapo_mega.weights.transport import parse_dtype

        if not (len(names) == len(dtypes) == len(shapes)):
            return f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length"
        seen = set()
        for name, dtype, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str) or name not in self._param_shapes:
                return f"unknown parameter name {name!r} (not in the model's HF state dict)"
            if name in seen:
                return f"parameter {name!r} appears twice"
            seen.add(name)
            try:
                dt = parse_dtype(dtype)
            except ValueError as exc:
                return f"parameter {name!r}: {exc}"
            if not dt.is_floating_point:
                return f"parameter {name!r}: dtype {dtype} is not a floating-point dtype"
            if not isinstance(shape, (list, tuple)) or tuple(int(s) for s in shape) != self._param_shapes[name]:
                return f"parameter {name!r}: shape {shape} != model shape {list(self._param_shapes[name])}"
        return None

    def load_named_tensors(self, named: Sequence[Tuple[str, torch.Tensor]],
                           weight_version: Optional[str] = None) -> None:
        """Copy tensors into the model by HF name (cast to the model dtype), then set the version.

        `lm_head.weight` of a tied model is skipped, as SGLang's Qwen2/Qwen3/Llama `load_weights`
        does: the tied matrix is loaded through `model.embed_tokens.weight`.
        """
        with self.model_lock:
            if self.weights_released:
                raise RuntimeError("weights are released; call /resume_memory_occupation first")
            with torch.no_grad():
                for name, tensor in named:
                    if self.tied_embeddings and name == "lm_head.weight":
                        continue
                    self.params[name].copy_(tensor.to(self.device))
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def get_weight(self, name: str) -> torch.Tensor:
        if name not in self.params:
            raise KeyError(f"unknown parameter name {name!r}")
        if self.tied_embeddings and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        return self.params[name].detach()

    def release_weights(self) -> None:
        """Free the parameter storage (SGLang's release of the `weights` tag).

        Without --enable-weights-cpu-backup the contents are lost, as in SGLang: after
        resume the learner must push weights (update_weights_from_tensor) before generating.
        """
        with self.model_lock:
            if self.weights_released:
                return
            for name, p in self.params.items():
                if self.enable_weights_cpu_backup:
                    self._backup[name] = p.data
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.weights_released = True

    def resume_weights(self) -> None:
        with self.model_lock:
            if not self.weights_released:
                return
            for name, p in self.params.items():
                p.data = self._backup.pop(name) if name in self._backup else torch.zeros(
                    self._param_shapes[name], dtype=p.dtype, device=p.device)
            # Tied parameters share one tensor object; re-tie after reallocating.
            if self.tied_embeddings:
                self.model.tie_weights()
            self.weights_released = False
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ generation thread
    def _finish(self, seq: Sequence_, reason: dict) -> None:
        seq.finish_reason = reason
        seq.end_time = time.monotonic()
        try:
            seq.on_done(seq)
        except Exception:  # a closed event loop must not kill the generation thread
            logger.exception("on_done callback failed")

    def _take_batch(self) -> List[Sequence_]:
        with self._cv:
            while not self._stop and (not self._waiting or self._paused or self.weights_released):
                self._cv.wait(timeout=0.5)
            if self._stop:
                return []
        self._gather_arrivals()
        with self._cv:
            if self._paused or self.weights_released:
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
        if (room <= 0 or not self._waiting or self._paused or self._stop or self.weights_released
                or not _MERGEABLE_CACHES):
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
                for seq in batch:
                    if seq.finish_reason is None:
                        self._finish(seq, {"type": "abort", "message": f"engine error: {exc}"})
            finally:
                with self._cv:
                    self._running = []

    def _forward_prefill(self, rows: List[Sequence_]):
        """Left-padded prefill of prompt + output so far. Returns (last logits [B,V], cache, mask [B,T]).

        Rows with the same tokens (the n samples of one prompt) are computed once and their
        cache rows copied, as SGLang's prefix cache shares a prompt's KV among its samples.
        """
        unique: Dict[Tuple[int, ...], int] = {}
        inverse = [unique.setdefault(tuple(r.prompt_ids + r.output_ids), len(unique)) for r in rows]
        logits, cache, mask = self._prefill_tokens([list(s) for s in unique])
        if len(unique) < len(rows):
            index = torch.tensor(inverse, dtype=torch.long)
            cache.batch_select_indices(index.to(self.device))
            logits, mask = logits[index.to(logits.device)], mask[index]
        return logits, cache, mask

    def _prefill_tokens(self, seqs: List[List[int]]):
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), _cache_of(out), mask

    def _forward_decode(self, rows: List[Sequence_], cache, mask: torch.Tensor):
        ids = torch.tensor([[r.output_ids[-1]] for r in rows], dtype=torch.long)
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
        pos = mask.sum(-1, keepdim=True) - 1
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, logits_to_keep=1,
                         **{_CACHE_KWARG: cache})
        return out.logits[:, -1].float(), _cache_of(out), mask

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
                            cache.batch_select_indices(torch.tensor(keep, dtype=torch.long).to(self.device))
                            mask = mask[torch.tensor(keep, dtype=torch.long)]
                admitted = self._admit(len(rows))
                if need_prefill:  # the whole batch is prefilled anyway: newcomers simply join
                    rows, admitted = rows + admitted, []
            with self.model_lock, torch.no_grad():
                if self.weights_released:
                    need_prefill = True
                    rows += admitted
                    continue
                if need_prefill:
                    logits, cache, mask = self._forward_prefill(rows)
                    need_prefill = False
                else:
                    logits, cache, mask = self._forward_decode(rows, cache, mask)
                    if admitted:
                        new_logits, new_cache, new_mask = self._forward_prefill(admitted)
                        logits = torch.cat([logits, new_logits])
                        cache, mask = merge_caches(cache, mask, new_cache, new_mask)
                        rows = rows + admitted
                version = self.weight_version
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
                    cache.batch_select_indices(index.to(self.device))
                    mask = mask[index]
                    cache, mask = trim_cache(cache, mask)

    def _stop_reason(self, seq: Sequence_) -> Optional[dict]:
        spec, token, n = seq.spec, seq.output_ids[-1], len(seq.output_ids)
        if n >= spec.min_new_tokens:
            # ignore_eos ignores stop_token_ids too (SGLang's Req._check_token_based_finish)
            if not spec.ignore_eos and (token in self.eos_token_ids or token in spec.stop_token_ids):
                return {"type": "stop", "matched": token}
            if spec.stop:
                tail = self.tokenizer.decode(seq.output_ids[-64:], skip_special_tokens=spec.skip_special_tokens)
                for s in spec.stop:
                    if s and s in tail:
                        return {"type": "stop", "matched": s}
        if n >= spec.max_new_tokens or len(seq.prompt_ids) + n >= self.max_context:
            return {"type": "length", "length": n}
        return None


def _caches_have_layers() -> bool:
    from transformers import DynamicCache

    return hasattr(DynamicCache(), "layers")


_MERGEABLE_CACHES = _caches_have_layers()
"""Whether this transformers' KV caches can be merged (`merge_caches`) for continuous batching."""


def _cache_layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"{type(cache).__name__}: expected a transformers>=4.56 cache with .layers "
                        "(continuous batching merges caches layer by layer)")
    return layers


def merge_caches(cache, mask: torch.Tensor, other, other_mask: torch.Tensor):
    """Append the rows of `other` (a prefilled cache, mask [B2, T2]) to `cache` (mask [B1, T1]).

    Both are left-padded: each is padded on the left to max(T1, T2) with masked zero
    keys/values, then the two are concatenated along the batch. Positions come from the mask
    (`_forward_decode`), so left padding changes no row's positions or attention.
    Returns (cache, mask [B1 + B2, max(T1, T2)]).
    """
    width = max(mask.shape[1], other_mask.shape[1])

    def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - t.shape[dim]
        if missing == 0:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t.new_zeros(shape), t], dim=dim)

    for mine, theirs in zip(_cache_layers(cache), _cache_layers(other)):
        mine.keys = torch.cat([pad(mine.keys, -2), pad(theirs.keys, -2)])
        mine.values = torch.cat([pad(mine.values, -2), pad(theirs.values, -2)])
    return cache, torch.cat([pad(mask, 1), pad(other_mask, 1)])


def trim_cache(cache, mask: torch.Tensor):
    """Drop the leading cache columns that every row masks (rows that needed them are gone)."""
    used = mask.any(dim=0).nonzero()
    first = int(used[0]) if len(used) else 0
    if first == 0:
        return cache, mask
    for layer in _cache_layers(cache):
        layer.keys = layer.keys[..., first:, :]
        layer.values = layer.values[..., first:, :]
    return cache, mask[:, first:]


def sample_tokens(logits: torch.Tensor, specs: Sequence[SamplingSpec],
                  uniforms: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row as SGLang does (module docstring), the whole batch at once.

    Filters (top-k, then top-p over the top-k survivors, then min-p) are applied to the
    rows sorted by probability; each row then picks its token by inverse CDF at its uniform
    number, drawn from the row's own generator (so a seeded sequence samples the same tokens
    whatever batch it is in).

    Args:
        logits: [B, V] float32 next-token logits.
        uniforms: [B] one number in [0, 1) per row (`Sequence_.next_uniform`).
    Returns:
        tokens [B] long, logprobs [B] float32: log softmax(z/T)[y] (greedy: log softmax(z)[y]).
    """
    B, V = logits.shape
    temps = torch.tensor([s.temperature for s in specs], dtype=logits.dtype)
    greedy = temps < GREEDY_EPS
    logp = torch.log_softmax(logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None], dim=-1)
    sorted_p, order = torch.sort(logp.exp(), dim=-1, descending=True)
    top_k = torch.tensor([s.top_k if 0 < s.top_k < V else V for s in specs])
    top_p = torch.tensor([s.top_p for s in specs], dtype=logits.dtype)
    min_p = torch.tensor([s.min_p for s in specs], dtype=logits.dtype)
    keep = torch.arange(V)[None, :] < top_k[:, None]
    kept_p = sorted_p * keep
    # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
    keep &= (kept_p.cumsum(-1) - kept_p) <= top_p[:, None]
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    cdf = (sorted_p * keep).cumsum(-1)
    u = uniforms.to(logits.dtype) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None]).clamp_(max=V - 1)
    tokens = torch.where(greedy, logits.argmax(-1), order.gather(1, pick).squeeze(1))
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1).float()
