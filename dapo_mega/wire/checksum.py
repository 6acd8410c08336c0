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
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's CPU tensor hash of `tensor`'s bytes (dtype and values; not its shape)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


_M32, _M64 = 0xFFFFFFFF, (1 << 64) - 1
_FMIX32 = (0x85EBCA6B, 0xC2B2AE35)
_POS = (0x27D4EB2D, 0x165667B1)
GPU_HASH_SEED = 0x243F6A88
GPU_HASH_TILE_WORDS = 8192


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * _FMIX32[0]) & _M32
    x = x ^ (x >> 13)
    x = (x * _FMIX32[1]) & _M32
    return x ^ (x >> 16)


def _fmix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _FMIX32[0]) & _M32
    x ^= x >> 13
    x = (x * _FMIX32[1]) & _M32
    return x ^ (x >> 16)


def gpu_tensor_checksum(tensor: torch.Tensor, chunk_tiles: int = 2048) -> str:
    """SGLang's hash of a tensor on a GPU (`sglang.kernels.ops.memory.gpu_tensor_hash`, what its
    `/weights_checker` reports for CUDA weights), computed with torch ops on the tensor's own
    device, so a learner on GPUs can compare what it sent with a GPU engine's report. The bytes
    as little-endian uint32 words (zero-padded); for each tile of 8192 words two sums of
    murmur-mixed words keyed by the word's global index, each xor'ed with the byte count and
    mixed again, form one uint64; the tiles' uint64s add up mod 2^64, and splitmix64 ends it.
    Held to SGLang's triton kernel (run by triton's interpreter) in tests/weights/test_checksum.py."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    n = raw.numel() // 4
    if n == 0:
        return f"{0:016x}"
    seed1, seed2 = GPU_HASH_SEED & _M32, ((GPU_HASH_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (n * 4) & _M32
    tile = GPU_HASH_TILE_WORDS
    total = 0
    step = tile * chunk_tiles  # words per pass: bounds the int64 temporaries
    for start in range(0, n, step):
        end = min(n, start + step)
        b = raw[4 * start:4 * end].to(torch.int64).view(-1, 4)
        words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
        idx = torch.arange(start, end, dtype=torch.int64, device=raw.device) & _M32  # uint32, as the kernel's
        sums = []
        for pos, seed, rot in ((_POS[0], seed1, 15), (_POS[1], seed2, 13)):
            rotl = ((idx << rot) | (idx >> (32 - rot))) & _M32
            key = (((idx * pos) + seed) & _M32) ^ rotl
            mixed = _fmix32(words ^ key)
            tiles = torch.zeros((end - start + tile - 1) // tile, dtype=torch.int64, device=raw.device)
            tiles.index_add_(0, torch.arange(end - start, device=raw.device) // tile, mixed)  # < 2^45 a tile
            sums.append((tiles & _M32).tolist())
        for h1, h2 in zip(*sums):
            total += (_fmix32_int(h1 ^ nbytes) << 32) | _fmix32_int(h2 ^ nbytes)
    x = total & _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return f"{x:016x}"


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
each the concatenation of its parts in that order; a real server's checksums are these, freshly
loaded and after a sync: tests/engines/test_conformance.py). At TP > 1 each SGLang rank holds
shards of its own cut: not compared (the probe judges those engines)."""
CPU_HASH, GPU_HASH = "cpu", "gpu"
"""The hash an engine reports: SGLang's of a CPU tensor (SHA-256, `tensor_checksum`; the
embedded engine's too) or of a CUDA tensor (its triton kernel, `gpu_tensor_checksum`)."""


@dataclass(frozen=True)
class HeldAs:
    """How an engine holds and hashes the tensors it is sent: what the learner must hash to
    compare (`record_checksums`)."""

    dtype: Optional[torch.dtype] = None
    """The engine's parameter dtype (None: as sent)."""
    layout: str = HF
    kernel: str = CPU_HASH

    def checksum(self, tensor: torch.Tensor) -> str:
        return gpu_tensor_checksum(tensor) if self.kernel == GPU_HASH else tensor_checksum(tensor)

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
                     held: HeldAs = HeldAs()) -> Iterator[Tuple[str, torch.Tensor]]:
    """Pass a weight stream through, keeping in `into` the checksum of each tensor as the engine
    will hold and hash it (`held`): cast to its dtype, in its layout (HF, or SGLANG_TP1: the
    fused tensors' checksums once all their parts went by), by its hash kernel."""
    dtype, layout = held.dtype, held.layout
    parts: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        kept = tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
        fused = _fused_name(name) if layout == SGLANG_TP1 else None
        if fused is None:
            padded = layout == SGLANG_TP1 and name.endswith(("embed_tokens.weight", "lm_head.weight")) \
                and kept.shape[0] % VOCAB_PADDING
            if not padded:
                into[name] = held.checksum(kept)
        else:
            fused_name, part, order = fused
            group = parts.setdefault(fused_name, {})
            group[part] = kept.detach() if held.kernel == GPU_HASH else kept.detach().cpu()
            if len(group) == len(order):
                into[fused_name] = held.checksum(torch.cat([group[p] for p in order]))
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
