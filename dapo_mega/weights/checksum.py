"""Checksums of weights, as SGLang's `/weights_checker` (action `checksum`) computes them.

A log-prob probe cannot tell an engine that kept the previous weights from one that got the
new ones when a step moves the weights less than the two implementations' numerical noise
(at 32B and lr 1e-6 it does). A checksum of every tensor can: after each sync the engine
reports one per tensor it holds, the learner computed one per tensor it sent, and any
difference names the tensor.

The hash is SGLang 0.5.23's CPU `tensor_hash` (`sglang.srt.managers.mm_utils`): the first 8
bytes of the SHA-256 of the tensor's contiguous bytes, as 16 hex digits; the per-rank and
per-engine digests are its `overall_checksum` (SHA-256 over the names in sorted order, each
followed by its checksum) and the SHA-256 of the ranks' digests. The embedded engine answers
with these, by HF name; `tests/weights/test_checksum.py` holds them to SGLang's own functions.
"""

from __future__ import annotations

import hashlib
import re
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's CPU tensor hash of `tensor`'s bytes (dtype and values; not its shape)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def overall_checksum(checksums: Mapping[str, str]) -> str:
    """SGLang's `overall_checksum`: one digest of a rank's per-tensor checksums."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def engine_checksum(rank_digests: Iterable[str]) -> str:
    """SGLang's `per_engine_checksum`: the SHA-256 of its ranks' digests, in rank order."""
    h = hashlib.sha256()
    for digest in rank_digests:
        h.update(digest.encode())
    return h.hexdigest()


HF, SGLANG_TP1 = "hf", "sglang_tp1"
"""How an engine holds the tensors it is sent: by HF name (the embedded engine), or as SGLang
0.5.23 holds a dense model at TP 1 (q/k/v fused into `qkv_proj`, gate/up into `gate_up_proj`,
each the concatenation of its parts in that order; a freshly loaded real server's checksums
are these, tests/engines/test_conformance.py). The trainer compares embedded engines only:
after a sync in a disaggregated SGLang run every tensor differed, not yet understood."""

_FUSED = (  # (pattern of a part, the fused name's template, the parts in SGLang's order)
    (re.compile(r"^(?P<p>.+)\.self_attn\.(?P<part>[qkv])_proj\.(?P<s>weight|bias)$"), "{p}.self_attn.qkv_proj.{s}",
     ("q", "k", "v")),
    (re.compile(r"^(?P<p>.+)\.mlp\.(?P<part>gate|up)_proj\.(?P<s>weight)$"), "{p}.mlp.gate_up_proj.{s}",
     ("gate", "up")),
)
VOCAB_PADDING = 64
"""SGLang pads its vocabulary tensors to a multiple of this (`pad_vocab_size`): rows whose
contents no sender knows, so a padded embedding or output layer is not compared."""


def record_checksums(named_tensors: Iterable[Tuple[str, torch.Tensor]], into: Dict[str, str],
                     dtype: Optional[torch.dtype] = None, layout: str = HF) -> Iterator[Tuple[str, torch.Tensor]]:
    """Pass a weight stream through, keeping in `into` the checksum of each tensor as the engine
    will hold it: cast to `dtype` (the engine's parameter dtype) when given, and in `layout`
    (HF, or SGLANG_TP1: the fused tensors' checksums once all their parts went by)."""
    parts: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        held = tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
        fused = _fused_name(name) if layout == SGLANG_TP1 else None
        if fused is None:
            padded = layout == SGLANG_TP1 and name.endswith(("embed_tokens.weight", "lm_head.weight")) \
                and held.shape[0] % VOCAB_PADDING
            if not padded:
                into[name] = tensor_checksum(held)
        else:
            fused_name, part, order = fused
            group = parts.setdefault(fused_name, {})
            group[part] = held.detach().cpu()
            if len(group) == len(order):
                into[fused_name] = tensor_checksum(torch.cat([group[p] for p in order]))
                del parts[fused_name]
        yield name, tensor


def _fused_name(name: str) -> Optional[Tuple[str, str, Tuple[str, ...]]]:
    for pattern, template, order in _FUSED:
        m = pattern.match(name)
        if m:
            return template.format(p=m["p"], s=m["s"]), m["part"], order
    return None


def reported_checksums(reply: Mapping) -> Dict[str, str]:
    """The per-tensor checksums of a `/weights_checker` checksum reply, merged over its ranks
    (an engine of TP 1: one rank)."""
    merged: Dict[str, str] = {}
    for rank in reply.get("ranks") or []:
        merged.update(rank.get("checksums") or {})
    return merged


def differing_tensors(expected: Mapping[str, str], reported: Mapping[str, str]) -> List[str]:
    """Names the learner sent whose checksum the engine reports differently or not at all
    (tensors the engine holds beyond them, a tied output layer or buffers, are not compared)."""
    return sorted(name for name, value in expected.items() if reported.get(name) != value)
