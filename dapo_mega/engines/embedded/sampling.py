"""The embedded engine's sampler: a request's sampling parameters, one sample being
generated, and the batched draw of the next token.

Sampling follows SGLang 0.5.23 (`srt/layers/sampler.py`), per row:

    p = softmax(z / T)                      (T = temperature; T < 1e-5 means greedy)
    p' = top-k, then top-p, then min-p filtered p, renormalised
    y ~ p'
    reported logprob = log p[y]            (temperature-scaled, *before* top-k/top-p;
                                             greedy rows report log_softmax(z)[y])

Every generated token is stamped with the weight version current at the forward step that
produced it (`Sequence_.append`); runs of equal versions become SGLang's `weight_versions`
spans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

GREEDY_EPS = 1e-5
UNIFORM_BLOCK = 16
"""Uniform numbers a sequence draws from its generator at a time (`Sequence_.next_uniform`)."""


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
    routed: Optional[List["torch.Tensor"]] = None
    """A MoE engine capturing routed experts (`--enable-return-routed-experts`): per token
    position computed so far, the int32 [num_layers, top_k] experts each layer chose (zeros in
    dense layers), as SGLang's capturer keeps them; a re-prefill overwrites them."""
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
