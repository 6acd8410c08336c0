"""The embedded engine's KV cache plumbing over transformers' caches: the forward's cache
argument across releases, and the two edits continuous batching makes to a running batch's
cache: merging newcomers' rows in (`merge_caches`) and trimming columns no live row uses
(`trim_cache`). Both need transformers >= 4.56, whose caches have `.layers`
(`MERGEABLE_CACHES`); with an older one newcomers wait for the next batch.
"""

from __future__ import annotations

import torch


def _cache_kwarg() -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; accept either release."""
    import inspect

    from transformers import PreTrainedModel  # noqa: F401
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_KWARG = _cache_kwarg()
"""The name of the forward's KV-cache argument in this transformers."""


def cache_of(out):
    """The KV cache a forward returned (`out.cache` or `out.past_key_values`, per CACHE_KWARG)."""
    return getattr(out, "cache", None) if CACHE_KWARG == "cache" else out.past_key_values


def _caches_have_layers() -> bool:
    from transformers import DynamicCache

    return hasattr(DynamicCache(), "layers")


MERGEABLE_CACHES = _caches_have_layers()
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
    (`ModelRunner.forward_decode`), so left padding changes no row's positions or attention.
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
