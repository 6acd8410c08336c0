"""Reading and writing Hugging Face safetensors checkpoints, tensor by tensor.

`HFCheckpointReader` opens a single `model.safetensors` or a sharded checkpoint with
`model.safetensors.index.json`, checks up front that every shard file the index lists
exists (a missing shard is named, with the tensors it would hold), and returns tensors
lazily with `safe_open`: only the tensor asked for is read.

`ShardedSafetensorsWriter` accepts `(name, tensor)` pairs as they stream out of
`iter_megatron_to_hf`, flushes a shard file whenever `max_shard_bytes` would be exceeded
and writes `model.safetensors.index.json` in the layout `save_pretrained` produces
(`model-00001-of-00003.safetensors`, `{"metadata": {"total_size": ...}, "weight_map": ...}`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from dapo_mega.weights.mapping import MissingHFTensorError, WeightMappingError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""transformers' default max_shard_size for save_pretrained (5 GB)."""


class HFCheckpointReader:
    """Lazy tensor access to an HF safetensors checkpoint directory.

    reader(name) -> torch.Tensor (KeyError subclass MissingHFTensorError when absent),
    `name in reader`, reader.keys(). Shard files are opened on first use and kept open.
    """

    def __init__(self, hf_dir: Path | str):
        self.hf_dir = Path(hf_dir)
        index_path = self.hf_dir / INDEX_NAME
        if index_path.exists():
            weight_map: Dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            missing: Dict[str, List[str]] = {}
            for tensor_name, file_name in weight_map.items():
                if not (self.hf_dir / file_name).exists():
                    missing.setdefault(file_name, []).append(tensor_name)
            if missing:
                listed = "; ".join(f"{f} (holds {len(t)} tensors, e.g. {sorted(t)[0]})"
                                   for f, t in sorted(missing.items()))
                raise WeightMappingError(f"{index_path}: shard file(s) listed in the index are missing: {listed}")
            self.weight_map = weight_map
        elif (self.hf_dir / SINGLE_NAME).exists():
            from safetensors import safe_open

            with safe_open(str(self.hf_dir / SINGLE_NAME), framework="pt") as f:
                self.weight_map = {k: SINGLE_NAME for k in f.keys()}
        else:
            raise WeightMappingError(f"{self.hf_dir}: no {INDEX_NAME} or {SINGLE_NAME} (only safetensors "
                                     "checkpoints are supported; re-save with safe_serialization=True)")
        self._handles: Dict[str, object] = {}

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __call__(self, name: str) -> torch.Tensor:
        file_name = self.weight_map.get(name)
        if file_name is None:
            raise MissingHFTensorError(f"tensor {name} is missing from the Hugging Face checkpoint {self.hf_dir}")
        handle = self._handles.get(file_name)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(self.hf_dir / file_name), framework="pt")
            self._handles[file_name] = handle
        return handle.get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


class ShardedSafetensorsWriter:
    """Write streamed tensors into size-bounded safetensors shards plus an index.

    `prefix` lets several writers (one per pipeline stage) share a directory; `finalize`
    returns the {tensor: temporary file} map, and `write_index` renames all temporary
    files to the HF `model-0000i-of-0000n.safetensors` names and writes the index.
    """

    def __init__(self, out_dir: Path | str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, prefix: str = "part"):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self._pending: Dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: List[str] = []
        self.weight_map: Dict[str, str] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self._pending:
            raise WeightMappingError(f"tensor {name} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # clone: the tensor may be a view into a gathered buffer that is reused.
        self._pending[name] = tensor.detach().to("cpu").contiguous().clone()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        file_name = f"{self.prefix}-{len(self._files):05d}.safetensors.tmp"
        save_file(self._pending, str(self.out_dir / file_name), metadata={"format": "pt"})
        self._files.append(file_name)
        for name in self._pending:
            self.weight_map[name] = file_name
        self._pending, self._pending_bytes = {}, 0

    def finalize(self) -> Tuple[Dict[str, str], List[str], int]:
        """Flush; returns (tensor → temporary file, temporary files in order, total bytes)."""
        self._flush()
        return dict(self.weight_map), list(self._files), self.total_bytes


def write_index(out_dir: Path | str, parts: Iterable[Tuple[Dict[str, str], List[str], int]]) -> Dict[str, str]:
    """Rename the writers' temporary files to HF shard names and write the index.

    parts: the `finalize()` results of every writer, in pipeline-stage order.
    Returns the final weight map {tensor: file}.
    """
    out = Path(out_dir)
    parts = list(parts)
    files = [f for _, fs, _ in parts for f in fs]
    total = len(files)
    rename = {f: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, f in enumerate(files)}
    for old, new in rename.items():
        os.replace(out / old, out / new)
    weight_map = {name: rename[f] for wm, _, _ in parts for name, f in wm.items()}
    index = {"metadata": {"total_size": sum(b for _, _, b in parts)},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    stale_single = out / SINGLE_NAME
    if stale_single.exists():  # an older single-file export would shadow nothing but confuse readers
        stale_single.unlink()
    return weight_map


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '10KB' / '1234' → bytes (decimal units, as transformers uses)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    for unit, mult in (("GIB", 1024**3), ("MIB", 1024**2), ("KIB", 1024), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def dtype_from_name(name: Optional[str]) -> Optional[torch.dtype]:
    """'bf16'/'bfloat16' → torch.bfloat16, 'fp32'/'float32' → torch.float32, 'fp16' …, None → None."""
    if name in (None, "", "auto"):
        return None
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r}: use bf16, fp16 or fp32")
    return table[name]
