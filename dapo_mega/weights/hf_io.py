"""Reading and writing Hugging Face safetensors checkpoints, tensor by tensor.

`HFCheckpointReader` opens a single `model.safetensors` or a sharded checkpoint with
`model.safetensors.index.json`, checks up front that every shard file the index lists
exists (a missing shard is named, with the tensors it would hold), and returns tensors
lazily: only the tensor asked for is read, with plain reads (no memory map).

`ShardedSafetensorsWriter` accepts `(name, tensor)` pairs as they stream out of
`iter_megatron_to_hf`, writes each to disk as it comes, closes a shard file whenever
`max_shard_bytes` would be exceeded and writes `model.safetensors.index.json` in the layout `save_pretrained` produces
(`model-00001-of-00003.safetensors`, `{"metadata": {"total_size": ...}, "weight_map": ...}`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from dapo_mega.weights.mapping import MissingHFTensorError, WeightMappingError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""transformers' default max_shard_size for save_pretrained (5 GB)."""


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors_header(path: Path | str) -> Tuple[int, Dict[str, dict]]:
    """(offset of the data section, {tensor: {"dtype", "shape", "data_offsets"}}) of one file.

    The format: 8 bytes little-endian header length N, N bytes of JSON, then the data;
    `data_offsets` are relative to the data section.
    """
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def _read_into(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill `out` (contiguous) with the bytes at `offset` of `path`, by plain reads."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise WeightMappingError(f"{path}: file ends inside a tensor (truncated shard?)")
            done += n


class HFCheckpointReader:
    """Lazy tensor access to an HF safetensors checkpoint directory.

    reader(name) -> torch.Tensor (KeyError subclass MissingHFTensorError when absent),
    `name in reader`, reader.keys(), reader.shape(name). Each call reads that one tensor
    with plain file reads into a fresh tensor: nothing is memory-mapped, so the file's
    pages stay in the page cache and never count in this process's resident memory
    (safetensors' `safe_open` maps the whole shard; a conversion that read every tensor
    through it carried the checkpoint's bytes once more in its RSS).
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
            self.weight_map = {k: SINGLE_NAME for k in read_safetensors_header(self.hf_dir / SINGLE_NAME)[1]}
        else:
            raise WeightMappingError(f"{self.hf_dir}: no {INDEX_NAME} or {SINGLE_NAME} (only safetensors "
                                     "checkpoints are supported; re-save with safe_serialization=True)")
        self._headers: Dict[str, Tuple[int, Dict[str, dict]]] = {}

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _entry(self, name: str) -> Tuple[Path, int, dict]:
        file_name = self.weight_map.get(name)
        if file_name is None:
            raise MissingHFTensorError(f"tensor {name} is missing from the Hugging Face checkpoint {self.hf_dir}")
        if file_name not in self._headers:
            self._headers[file_name] = read_safetensors_header(self.hf_dir / file_name)
        data_start, header = self._headers[file_name]
        if name not in header:
            raise MissingHFTensorError(f"tensor {name}: the index names {file_name}, which does not hold it")
        return self.hf_dir / file_name, data_start, header[name]

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._entry(name)[2]["shape"])

    def __call__(self, name: str) -> torch.Tensor:
        path, data_start, entry = self._entry(name)
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise WeightMappingError(f"tensor {name} in {path}: unsupported safetensors dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        out = torch.empty(entry["shape"], dtype=dtype)
        if out.numel() * out.element_size() != end - begin:
            raise WeightMappingError(f"tensor {name} in {path}: {end - begin} bytes for shape {entry['shape']}")
        _read_into(path, data_start + begin, out)
        return out

    def close(self) -> None:
        self._headers.clear()


_SAFETENSORS_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}
_COPY_CHUNK = 16 * 2**20


class ShardedSafetensorsWriter:
    """Write streamed tensors into size-bounded safetensors shards plus an index.

    Each tensor's bytes go to disk as it arrives (into the open shard's data file), so the
    writer holds no tensor: memory stays at one tensor whatever the shard size. A shard is
    closed by writing its header and then the data file behind it (a safetensors file is
    header first, and the header is only known once the shard is complete).

    `prefix` lets several writers (one per pipeline stage) share a directory; `finalize`
    returns the {tensor: temporary file} map, and `write_index` renames all temporary
    files to the HF `model-0000i-of-0000n.safetensors` names and writes the index.
    """

    def __init__(self, out_dir: Path | str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, prefix: str = "part"):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self._entries: Dict[str, dict] = {}
        self._data = None
        self._pending_bytes = 0
        self._files: List[str] = []
        self.weight_map: Dict[str, str] = {}
        self.total_bytes = 0

    def _shard_name(self) -> str:
        return f"{self.prefix}-{len(self._files):05d}.safetensors.tmp"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self._entries:
            raise WeightMappingError(f"tensor {name} written twice")
        code = _SAFETENSORS_CODES.get(tensor.dtype)
        if code is None:
            raise WeightMappingError(f"tensor {name}: dtype {tensor.dtype} cannot be stored in safetensors here")
        nbytes = tensor.numel() * tensor.element_size()
        if self._entries and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if self._data is None:
            self._data = open(self.out_dir / (self._shard_name() + ".data"), "wb")
        host = tensor.detach().to("cpu").contiguous()
        self._data.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
        self._entries[name] = {"dtype": code, "shape": list(host.shape),
                               "data_offsets": [self._pending_bytes, self._pending_bytes + nbytes]}
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._entries:
            return
        file_name = self._shard_name()
        data_path = Path(self._data.name)
        self._data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # safetensors pads its header to 8 bytes, so tensors stay aligned
        with open(self.out_dir / file_name, "wb") as out, open(data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, _COPY_CHUNK)
        data_path.unlink()
        self._files.append(file_name)
        for name in self._entries:
            self.weight_map[name] = file_name
        self._entries, self._data, self._pending_bytes = {}, None, 0

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
