"""Weight checksums (dapo_mega/weights/checksum.py) as SGLang 0.5.23's /weights_checker makes
them, and the verdict that names an engine holding other bytes than the learner sent
(driver/weight_probe.py). The conformance suite compares them with the real server's reply."""

import torch

from dapo_mega.driver.weight_probe import judge_checksums
from dapo_mega.weights.checksum import (
    SGLANG_TP1,
    differing_tensors,
    engine_checksum,
    overall_checksum,
    record_checksums,
    reported_checksums,
    tensor_checksum,
)

URL = "http://127.0.0.1:30001"


def test_digests_equal_the_ones_sglang_printed():
    """Printed by SGLang 0.5.23's own functions in its CPU venv (sglang.srt.utils.weight_checker
    `_hash_tensor` and `overall_checksum`) for these inputs."""
    assert tensor_checksum(torch.arange(10, dtype=torch.float32)) == "143de3a0e0413265"
    assert overall_checksum({"b": "1", "a": "2"}) == "25e2e3f16de61005e84b8fdb80b836322bad875dd3db28842a4f914f1dcb16b8"


def test_a_checksum_sees_one_changed_bit_and_the_dtype():
    t = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    nudged = t.clone()
    nudged.view(torch.int32)[17, 3] ^= 1  # the last bit of one mantissa: what lr 1e-6 moves
    assert tensor_checksum(t) != tensor_checksum(nudged)
    assert tensor_checksum(t) == tensor_checksum(t.t().contiguous().t())  # the values, not the strides
    assert tensor_checksum(t) != tensor_checksum(t.to(torch.bfloat16))


def test_recording_passes_the_stream_through_in_the_engines_dtype():
    a, b = torch.ones(3), torch.zeros(2, dtype=torch.bfloat16)
    into = {}
    out = list(record_checksums(iter([("a", a), ("b", b)]), into, torch.bfloat16))
    assert [n for n, _ in out] == ["a", "b"] and out[0][1] is a  # unchanged, as sent
    assert into == {"a": tensor_checksum(a.to(torch.bfloat16)), "b": tensor_checksum(b)}


def test_reported_checksums_merge_ranks_and_differences_name_tensors():
    reply = {"success": True, "ranks": [{"checksums": {"x": "1", "lm_head.weight": "9"}},
                                        {"checksums": {"y": "2"}}], "per_engine_checksum": "..."}
    reported = reported_checksums(reply)
    assert reported == {"x": "1", "lm_head.weight": "9", "y": "2"}
    assert differing_tensors({"x": "1", "y": "3", "z": "4"}, reported) == ["y", "z"]  # extra held tensors ignored
    assert engine_checksum(["a", "b"]) != engine_checksum(["b", "a"])


def test_verdicts_name_the_engine_the_tensors_and_the_cause():
    sent = {f"t{i}": str(i) for i in range(8)}
    assert judge_checksums(1, URL, 4, sent, dict(sent)) is None
    stale = judge_checksums(1, URL, 4, sent, {k: "old" for k in sent})
    assert stale.startswith(f"weight checksum after the sync of policy version 4 (before step 5): engine 1 ({URL}) "
                            "holds 8 of the 8 tensors sent with other bytes")
    assert "t0, t1, t2, t3, t4 and 3 more" in stale and "kept the previous weights" in stale
    part = judge_checksums(0, URL, 4, sent, {**sent, "t3": "x"})
    assert "holds 1 of the 8 tensors" in part and ": t3;" in part and "a bucket skipped" in part
    renamed = judge_checksums(0, URL, 4, sent, {})
    assert "no tensor of that name" in renamed


def test_recording_in_sglangs_tp1_layout_fuses_qkv_and_gate_up_as_sglang_holds_them():
    """SGLang 0.5.23 at TP 1 holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`,
    each the concatenation of its parts (the conformance suite reads it from the real server);
    a vocabulary that is not a multiple of 64 is padded there with rows no sender knows, so it
    is left out; every tensor still passes through unchanged and in order."""
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(*shape, generator=g) for n, shape in {
        "model.embed_tokens.weight": (99, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8), "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.q_proj.bias": (8,), "model.layers.0.self_attn.k_proj.bias": (4,),
        "model.layers.0.self_attn.v_proj.bias": (4,), "model.layers.0.mlp.up_proj.weight": (16, 8),
        "model.layers.0.mlp.gate_proj.weight": (16, 8), "model.norm.weight": (8,),
        "lm_head.weight": (128, 8)}.items()}
    into = {}
    out = list(record_checksums(iter(t.items()), into, torch.float32, SGLANG_TP1))
    assert [n for n, _ in out] == list(t)
    layer = "model.layers.0"
    assert into == {
        f"{layer}.self_attn.qkv_proj.weight": tensor_checksum(torch.cat([t[f"{layer}.self_attn.{p}_proj.weight"]
                                                                          for p in "qkv"])),
        f"{layer}.self_attn.qkv_proj.bias": tensor_checksum(torch.cat([t[f"{layer}.self_attn.{p}_proj.bias"]
                                                                        for p in "qkv"])),
        f"{layer}.mlp.gate_up_proj.weight": tensor_checksum(torch.cat([t[f"{layer}.mlp.gate_proj.weight"],
                                                                        t[f"{layer}.mlp.up_proj.weight"]])),
        "model.norm.weight": tensor_checksum(t["model.norm.weight"]),
        "lm_head.weight": tensor_checksum(t["lm_head.weight"]),  # 128 rows: not padded
    }
