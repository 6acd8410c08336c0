"""Qwen3-MoE on the Megatron learner (issue #38): transformers' `Qwen3MoeForCausalLM` converted
at expert parallelism 2 verifies against transformers' logits, exports back exactly at EP 1 (the
experts gathered from another layout), and a conversion with two experts swapped fails verify.

The tiny MoE is `models/tiny.py`'s (8 experts, 2 per token, its first layer dense). Each
conversion runs on spawned gloo ranks (EP 2 at TP 1: two data-parallel copies of the dense
layers, each holding 4 of the experts)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dapo_mega.models.tiny import build_tiny_model_dir
from dapo_mega.weights import convert, verify
from dapo_mega.weights.hf_io import HFCheckpointReader


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("qwen3_moe"), seed=3, architecture="qwen3_moe")


def _swap_experts(src: Path, dst: Path, layer: int, a: int, b: int) -> None:
    """A copy of the HF checkpoint `src` whose experts a and b of `layer` trade places."""
    shutil.copytree(src, dst)
    path = next(dst.glob("*.safetensors"))
    tensors = load_file(path)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        ka, kb = (f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in (a, b))
        tensors[ka], tensors[kb] = tensors[kb], tensors[ka]
    save_file(tensors, path, metadata={"format": "pt"})


def test_moe_converts_at_ep2_verifies_against_transformers_and_exports_exactly_at_ep1(moe_dir, tmp_path):
    meg, out = tmp_path / "meg", tmp_path / "hf"
    hf_names = sorted(HFCheckpointReader(moe_dir).keys())
    assert sum(".mlp.experts." in n for n in hf_names) == 8 * 3 and any(n.endswith("mlp.gate.weight") for n in hf_names)
    imported = convert.import_hf_checkpoint(moe_dir, meg, ep=2, progress=False)
    assert imported.ep == 2 and imported.num_tensors == len(hf_names) and not imported.notes  # every tensor used
    verified = verify.verify_conversion(moe_dir, meg, ep=2)
    assert verified.passed and verified.max_abs_diff < 1e-5, verified.lines()
    convert.export_megatron_checkpoint(meg, out, ep=1, hf_config_from=moe_dir, progress=False)
    a, b = HFCheckpointReader(moe_dir), HFCheckpointReader(out)
    assert sorted(b.keys()) == hf_names
    assert all(torch.equal(a(n), b(n)) for n in hf_names)

    swapped = tmp_path / "swapped"
    _swap_experts(moe_dir, swapped, layer=1, a=0, b=5)
    wrong = verify.verify_conversion(swapped, meg, ep=2)
    assert not wrong.passed and wrong.max_abs_diff > 1e-3, wrong.lines()
