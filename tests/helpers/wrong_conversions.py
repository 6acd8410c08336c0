"""Wrong conversions, made on purpose, for `verify` to catch.

Each `WRONG_CONVERSIONS` entry copies an HF checkpoint and breaks the copy the way a faulty
conversion would leave the Megatron side: the copy is then imported and verified against the
intact original. Weights are broken in the safetensors (layers swapped, K and V exchanged, a
matrix transposed, an output layer that never got the tied embedding's values); settings in
config.json (a wrong rope theta or norm epsilon), which the import records with the checkpoint
and the Megatron side is built from, as training builds it. Used by the tests and by
`bench/verify_margins.py`, which measures verify's margin on each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict

import torch

Tensors = Dict[str, torch.Tensor]


def _load(hf_dir: Path) -> Tensors:
    from safetensors.torch import load_file

    out: Tensors = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _save(hf_dir: Path, tensors: Tensors) -> None:
    from safetensors.torch import save_file

    for shard in hf_dir.glob("*.safetensors"):
        shard.unlink()
    (hf_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(hf_dir / "model.safetensors"),
              metadata={"format": "pt"})


def _edit_config(hf_dir: Path, edit: Callable[[dict], None]) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    edit(cfg)
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def swap_layers(t: Tensors, cfg: dict) -> None:
    """Layers 0 and 1 exchanged (a wrong layer offset in a pipeline stage)."""
    a, b = "model.layers.0.", "model.layers.1."
    for name in [n for n in t if n.startswith(a)]:
        other = b + name[len(a):]
        t[name], t[other] = t[other], t[name]


def qkv_order(t: Tensors, cfg: dict) -> None:
    """K and V rows exchanged in the middle layer (a fused QKV split in the wrong order)."""
    layer = cfg["num_hidden_layers"] // 2
    for suffix in ("weight", "bias"):
        k, v = f"model.layers.{layer}.self_attn.k_proj.{suffix}", f"model.layers.{layer}.self_attn.v_proj.{suffix}"
        if k in t:
            t[k], t[v] = t[v], t[k]


def transposed(t: Tensors, cfg: dict) -> None:
    """The middle layer's attention output projection transposed (it is square here)."""
    name = f"model.layers.{cfg['num_hidden_layers'] // 2}.self_attn.o_proj.weight"
    assert t[name].shape[0] == t[name].shape[1], f"{name} is not square: {tuple(t[name].shape)}"
    t[name] = t[name].t()


def untied(t: Tensors, cfg: dict) -> None:
    """A tied model converted as untied: the output layer holds what an uninitialised one would
    (drawn as megatron initialises, std 0.02), not the embedding."""
    emb = t["model.embed_tokens.weight"]
    t["lm_head.weight"] = torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)).mul(0.02).to(emb.dtype)
    cfg["tie_word_embeddings"] = False


def _set_rope_theta(cfg: dict, scale: float) -> None:
    if isinstance(cfg.get("rope_parameters"), dict) and "rope_theta" in cfg["rope_parameters"]:
        cfg["rope_parameters"]["rope_theta"] *= scale
    else:
        cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * scale


def rope_theta(t: Tensors, cfg: dict) -> None:
    """rope theta 100x too small (10,000 recorded for a model trained at 1,000,000)."""
    _set_rope_theta(cfg, 0.01)


def norm_eps(t: Tensors, cfg: dict) -> None:
    """RMSNorm epsilon 10x too large (megatron's default 1e-5 for Qwen2.5's 1e-6)."""
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 10


WRONG_CONVERSIONS: Dict[str, Callable[[Tensors, dict], None]] = {
    "layers swapped": swap_layers, "k and v exchanged": qkv_order, "matrix transposed": transposed,
    "rope theta": rope_theta, "norm epsilon": norm_eps, "tied embeddings untied": untied,
}


def break_checkpoint(src: Path, dst: Path, how: str) -> Path:
    """A copy of the HF checkpoint `src` at `dst`, broken as WRONG_CONVERSIONS[how] says."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = _load(dst)
    WRONG_CONVERSIONS[how](tensors, cfg)
    _save(dst, tensors)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def truncated_copy(src: Path, dst: Path, layers: int) -> Path:
    """`src` with only its first `layers` decoder layers (the same model, shallower)."""
    shutil.copytree(src, dst)
    tensors = {k: v for k, v in _load(dst).items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    _save(dst, tensors)
    _edit_config(dst, lambda cfg: cfg.update(num_hidden_layers=layers,
                                             **({"layer_types": cfg["layer_types"][:layers]}
                                                if "layer_types" in cfg else {})))
    return dst
