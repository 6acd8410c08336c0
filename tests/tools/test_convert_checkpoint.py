"""HF ⇄ Megatron conversion against transformers: exact round trips at TP 1/2 and PP 2,
logits equal to HF's, exported directories that load and generate, and named errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_mega.config import ModelConfig
from dapo_mega.models.tiny import build_tiny_model_dir
from dapo_mega.weights import convert, verify
from dapo_mega.weights import mapping as M
from dapo_mega.weights.hf_io import INDEX_NAME, HFCheckpointReader

REPO = Path(__file__).resolve().parents[2]


def _assert_same_tensors(src: Path, dst: Path) -> None:
    a, b = HFCheckpointReader(src), HFCheckpointReader(dst)
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        assert torch.equal(a(name), b(name)), name


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("qwen2"), seed=0, architecture="qwen2")


def test_import_tp1_export_tp2_exact_logits_and_generate(qwen_dir, tmp_path):
    meg, out = tmp_path / "meg", tmp_path / "hf"
    imported = convert.import_hf_checkpoint(qwen_dir, meg, tp=1, progress=False)
    assert imported.num_tensors == 27 and not imported.notes
    meta = json.loads((meg / convert.MODEL_META_FILE).read_text())
    assert meta["model_info"]["padded_vocab_size"] == 128 and meta["hf_config"]["vocab_size"] == 99
    # Export at TP 2 (the checkpoint reshards on load) into several small shards.
    exported = convert.export_megatron_checkpoint(meg, out, tp=2, max_shard_bytes=150_000, progress=False)
    index = json.loads((out / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1 and exported.num_tensors == 27
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    _assert_same_tensors(qwen_dir, out)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("12+34=", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=5, do_sample=False)
    reference = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).generate(
        ids, max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 5) and torch.equal(gen, reference)

    verified = verify.verify_conversion(qwen_dir, meg, tp=1, tolerance=1e-4)
    assert verified.passed and verified.max_abs_diff < 1e-4, verified.lines()


def test_import_tp2_export_tp1_exact(qwen_dir, tmp_path):
    meg, out = tmp_path / "meg", tmp_path / "hf"
    convert.import_hf_checkpoint(qwen_dir, meg, tp=2, progress=False)
    convert.export_megatron_checkpoint(meg, out, tp=1, progress=False)
    _assert_same_tensors(qwen_dir, out)


@pytest.mark.slow
def test_llama_tied_import_pp2_export_pp2_and_verify_tp2(tmp_path):
    cfg = ModelConfig(tiny_tie_word_embeddings=True)
    src = build_tiny_model_dir(tmp_path / "llama", cfg, seed=3, architecture="llama")
    assert "lm_head.weight" not in HFCheckpointReader(src).keys()
    meg, out = tmp_path / "meg", tmp_path / "hf"
    convert.import_hf_checkpoint(src, meg, pp=2, progress=False)
    convert.export_megatron_checkpoint(meg, out, pp=2, max_shard_bytes=100_000, progress=False)
    _assert_same_tensors(src, out)
    verified = verify.verify_conversion(src, meg, tp=2, tolerance=1e-4)
    assert verified.passed, verified.lines()


def test_missing_shard_unsupported_arch_and_shape_mismatch_are_named(qwen_dir, tmp_path):
    sharded = tmp_path / "sharded"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(qwen_dir).save_pretrained(sharded, max_shard_size="100KB")
    (sharded / "config.json").write_text((qwen_dir / "config.json").read_text())
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(M.WeightMappingError, match=shards[-1].name):
        convert.import_hf_checkpoint(sharded, tmp_path / "m1", progress=False)

    bad_arch = tmp_path / "mistral"
    bad_arch.mkdir()
    cfg = json.loads((qwen_dir / "config.json").read_text())
    (bad_arch / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(M.UnsupportedArchitectureError, match="MistralForCausalLM"):
        convert.import_hf_checkpoint(bad_arch, tmp_path / "m2", progress=False)

    # A checkpoint whose config promises 3 KV heads while the tensors hold 2.
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for f in qwen_dir.iterdir():
        (wrong / f.name).write_bytes(f.read_bytes())
    (wrong / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 1}))
    with pytest.raises(M.WeightMappingError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        convert.import_hf_checkpoint(wrong, tmp_path / "m3", progress=False)


@pytest.mark.slow
def test_cli_verify_fails_with_exit_code_1_on_different_weights(qwen_dir, tmp_path):
    other = build_tiny_model_dir(tmp_path / "other", seed=1)
    meg = tmp_path / "meg"
    tool = [sys.executable, str(REPO / "tools" / "convert_checkpoint.py")]
    ok = subprocess.run(tool + ["import", "--hf-path", str(qwen_dir), "--megatron-path", str(meg)],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "import:" in ok.stdout and "tensors: 27" in ok.stdout
    bad = subprocess.run(tool + ["verify", "--hf-path", str(other), "--megatron-path", str(meg)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "FAIL" in bad.stdout, bad.stdout + bad.stderr[-2000:]
