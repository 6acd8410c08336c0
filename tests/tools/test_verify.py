"""`convert_checkpoint.py verify` (dapo_mega/weights/verify.py): a correct conversion of a bf16
checkpoint passes with the defaults, and each wrong conversion a faulty converter could leave
fails, naming where to look.

The criterion's figures are checked against numbers computed here by hand (KL from its
definition), the wrong conversions are made on the HF side (tests/helpers/wrong_conversions.py)
and the reference is transformers' own model. SmolLM2 (a trained model, 30 layers) in bf16 at
TP 3 and PP 2 is in tests/models/test_smollm2_real_model.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.wrong_conversions import WRONG_CONVERSIONS, break_checkpoint

from dapo_mega.config import ModelConfig
from dapo_mega.models.tiny import build_tiny_model_dir
from dapo_mega.weights import convert, verify
from dapo_mega.weights.verify import LogitAgreement, choose_compute_dtype, first_divergent_layer, judge


def test_agreement_figures_equal_their_definitions_by_hand():
    ref = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    other = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    a = LogitAgreement.of(ref, other)

    def kl(x, y):
        p = [math.exp(v) / sum(math.exp(w) for w in x) for v in x]
        q = [math.exp(v) / sum(math.exp(w) for w in y) for v in y]
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert a.positions == 2 and a.max_abs_diff == 1.0 and a.ref_abs_max == 2.0
    assert a.mean_abs_diff == pytest.approx(3 / 6)
    assert a.mean_kl == pytest.approx((kl([2, 0, 0], [1, 0, 0]) + kl([0, 1, 0], [0, 0, 1])) / 2, rel=1e-5)
    assert a.max_kl == pytest.approx(kl([0, 1, 0], [0, 0, 1]), rel=1e-5)
    assert a.top1_agreement == 0.5  # position 0 agrees on token 0, position 1 does not


def test_verdicts_in_fp32_and_in_bf16():
    def agreement(max_diff, ref_max, mean_kl, top1):
        return LogitAgreement(positions=10, max_abs_diff=max_diff, mean_abs_diff=0.0, ref_abs_max=ref_max,
                              mean_kl=mean_kl, max_kl=mean_kl, top1_agreement=top1)
    # fp32: relative to the largest logit, and never tighter than 1e-3 absolute
    assert judge(agreement(0.019, 20.0, 0.0, 1.0), torch.float32).passed
    assert not judge(agreement(0.021, 20.0, 0.0, 1.0), torch.float32).passed
    assert not judge(agreement(0.0011, 0.5, 0.0, 1.0), torch.float32).passed
    # bf16: the distributions, whatever max |diff| is (rounding grows with depth)
    assert judge(agreement(3.0, 30.0, 0.004, 0.97), torch.bfloat16).passed
    assert not judge(agreement(0.1, 30.0, 0.2, 0.97), torch.bfloat16).passed
    assert not judge(agreement(0.1, 30.0, 0.004, 0.8), torch.bfloat16).passed
    assert not judge(agreement(0.1, 30.0, 0.004, 0.97), torch.bfloat16, tolerance=0.001).passed


def test_compute_dtype_is_fp32_where_it_fits_else_the_stored_one_saying_why():
    gb = 10**9
    assert choose_compute_dtype("auto", torch.bfloat16, 131 * gb, 1000 * gb) == (torch.float32, None)
    dtype, note = choose_compute_dtype("auto", torch.bfloat16, 131 * gb, 100 * gb)
    assert dtype == torch.bfloat16 and "158.3 GB" in note and "100.0 GB are available" in note
    assert choose_compute_dtype("stored", torch.bfloat16, 1, 1000 * gb) == (torch.bfloat16, None)
    assert choose_compute_dtype("float32", torch.bfloat16, 131 * gb, 1 * gb) == (torch.float32, None)
    assert choose_compute_dtype("auto", torch.float32, 131 * gb, None) == (torch.float32, None)


def test_first_divergent_layer():
    ref = [torch.ones(1, 2, 4) * (i + 1) for i in range(4)]
    same = [t.clone() for t in ref]
    assert first_divergent_layer(ref, same, 1e-3) is None
    other = [t.clone() for t in ref]
    other[2] = other[2] * 1.5
    other[3] = other[3] * 2
    assert first_divergent_layer(ref, other, 1e-3) == (2, pytest.approx(0.5))


@pytest.fixture(scope="module")
def bf16_qwen(tmp_path_factory) -> Path:
    """A tiny Qwen2 checkpoint stored in bf16 (config and safetensors), as a user's would be, with
    tied embeddings (as Qwen2.5's small models), so that untying them is one of the faults."""
    from safetensors.torch import load_file, save_file

    out = build_tiny_model_dir(tmp_path_factory.mktemp("qwen_bf16"), ModelConfig(tiny_num_layers=3, tiny_tie_word_embeddings=True), seed=0,
                               architecture="qwen2")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(out / "model.safetensors")).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    return out


def test_a_correct_bf16_conversion_passes_compared_in_fp32(bf16_qwen, tmp_path):
    convert.import_hf_checkpoint(bf16_qwen, tmp_path / "meg", progress=False)
    s = verify.verify_conversion(bf16_qwen, tmp_path / "meg", seeds=(0, 1))
    assert s.passed and s.logits_passed and not s.config_differences, s.lines()
    assert s.dtype == "float32" and "stored in bfloat16, compared in float32" in s.notes
    assert s.agreement.positions > 200 and s.agreement.top1_agreement == 1.0, s.lines()
    assert s.notes[0].startswith("tokens: 4 x ") and "worked problems" in s.notes[0]


EXPECTED_HINT = {
    "layers swapped": "model.layers.0.*",
    "k and v exchanged": "model.layers.1.*",  # the middle of 3 layers
    "matrix transposed": "model.layers.1.*",
    "rope theta": "model.layers.0.*",
    "norm epsilon": "model.layers.0.*",
    "tied embeddings untied": "lm_head.weight",
}


@pytest.mark.parametrize("how", ["layers swapped", pytest.param("k and v exchanged", marks=pytest.mark.slow),
                                 pytest.param("matrix transposed", marks=pytest.mark.slow),
                                 pytest.param("rope theta", marks=pytest.mark.slow),
                                 pytest.param("norm epsilon", marks=pytest.mark.slow),
                                 pytest.param("tied embeddings untied", marks=pytest.mark.slow)])
def test_a_wrong_conversion_fails_on_its_logits_and_says_where_to_look(how, bf16_qwen, tmp_path):
    """Each fails on the logits alone (not only on a recorded config field), and the hint names
    the first layer that departs, or the output layer when every layer agrees."""
    src = bf16_qwen
    broken = break_checkpoint(src, tmp_path / "broken", how)
    convert.import_hf_checkpoint(broken, tmp_path / "meg", progress=False)
    s = verify.verify_conversion(src, tmp_path / "meg")
    assert not s.passed and not s.logits_passed, s.lines()
    assert EXPECTED_HINT[how] in s.hint, s.lines()
    assert s.lines()[-1] == "  -> FAIL"
    if how in ("rope theta", "norm epsilon", "tied embeddings untied"):
        field = {"rope theta": "rope_parameters", "norm epsilon": "rms_norm_eps",
                 "tied embeddings untied": "tie_word_embeddings"}[how]
        assert any(d.startswith(field) for d in s.config_differences), s.config_differences


def test_every_wrong_conversion_is_tested():
    assert set(EXPECTED_HINT) == set(WRONG_CONVERSIONS)


# ---------------------------------------------------------------- a directory without a usable tokenizer


def _without_tokenizer(src: Path, dst: Path) -> Path:
    """`src`'s model files only, as `save_pretrained` of a model leaves them (no tokenizer)."""
    import shutil

    dst.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


def test_no_tokenizer_files_fall_back_to_random_ids_saying_so_in_one_line(bf16_qwen, tmp_path):
    """transformers builds a Qwen2 tokenizer with an empty vocabulary for a directory holding no
    tokenizer files (it does not raise): its probe rows are empty, and a float tensor of them
    crashed the embedding. Now: random ids, and the note says why."""
    bare = _without_tokenizer(bf16_qwen, tmp_path / "bare")
    cfg = json.loads((bare / "config.json").read_text())
    ids, line = verify.probe_token_ids(bare, cfg, seed=3)
    assert ids.dtype == torch.long and ids.shape == (verify.PROBE_ROWS, verify.FALLBACK_RANDOM_LENGTH)
    assert int(ids.max()) < cfg["vocab_size"]
    assert "random ids (seed 3)" in line and "no usable tokenizer" in line and "0 token(s)" in line, line
    assert "\n" not in line
    with pytest.raises(verify.VerifyInputError, match="--random-tokens"):
        verify.probe_token_ids(bare, cfg, text="What is 3 + 4?")


def test_a_tokenizer_whose_ids_pass_the_vocabulary_falls_back(bf16_qwen, tmp_path):
    """A tokenizer of another model (ids beyond vocab_size) would index past the embedding."""
    import shutil

    small = tmp_path / "small_vocab"
    shutil.copytree(bf16_qwen, small)
    cfg = {**json.loads((small / "config.json").read_text()), "vocab_size": 8}
    ids, line = verify.probe_token_ids(small, cfg)
    assert int(ids.max()) < 8 and "beyond the model's vocab_size 8" in line, line
    with pytest.raises(verify.VerifyInputError, match="vocab_size 8"):
        verify.probe_token_ids(small, cfg, text="What is 3 + 4?")


def test_verify_without_a_tokenizer_passes_a_correct_and_fails_a_wrong_conversion_without_a_traceback(
        bf16_qwen, tmp_path, capsys):
    """The command a user runs (tools/convert_checkpoint.py) on a `save_pretrained` directory."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import convert_checkpoint

    bare = _without_tokenizer(bf16_qwen, tmp_path / "bare")
    assert convert_checkpoint.main(["import", "--hf-path", str(bare), "--megatron-path", str(tmp_path / "meg")]) == 0
    assert convert_checkpoint.main(["verify", "--hf-path", str(bare), "--megatron-path", str(tmp_path / "meg")]) == 0
    out = capsys.readouterr().out
    assert "no usable tokenizer" in out and "PASS" in out, out
    broken = _without_tokenizer(break_checkpoint(bf16_qwen, tmp_path / "broken", "layers swapped"), tmp_path / "b2")
    assert convert_checkpoint.main(["import", "--hf-path", str(broken), "--megatron-path", str(tmp_path / "bad")]) == 0
    assert convert_checkpoint.main(["verify", "--hf-path", str(bare), "--megatron-path", str(tmp_path / "bad")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "model.layers.0" in out, out
    assert convert_checkpoint.main(["verify", "--hf-path", str(bare), "--megatron-path", str(tmp_path / "meg"),
                                    "--text", "What is 3 + 4?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--random-tokens" in err and "Traceback" not in err, err
