"""Weight checksums (dapo_mega/wire/checksum.py) as SGLang 0.5.23's /weights_checker makes
them, and the verdict that names an engine holding other bytes than the learner sent
(driver/weight_probe.py). The conformance suite compares them with the real server's reply."""

import torch

from dapo_mega.driver.weight_probe import judge_checksums
from dapo_mega.wire.checksum import (
    SGLANG_TP1,
    HeldAs,
    differing_tensors,
    engine_checksum,
    gpu_tensor_checksum,
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
    out = list(record_checksums(iter([("a", a), ("b", b)]), into, HeldAs(torch.bfloat16)))
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
    out = list(record_checksums(iter(t.items()), into, HeldAs(torch.float32, SGLANG_TP1)))
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


GPU_HASH_REFERENCE = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"  # triton's interpreter runs SGLang's kernels on the CPU
import torch, triton
from safetensors.torch import load_file
from sglang.kernels.ops.memory import gpu_tensor_hash as g

def sglang_hash(t):  # gpu_tensor_hash's own steps, without its is_cuda asserts
    tb = t.contiguous().reshape(-1).view(torch.uint8)
    pad = (4 - (tb.numel() & 3)) & 3
    if pad:
        tb = torch.cat([tb, torch.zeros(pad, dtype=torch.uint8)])
    u32, seed = tb.view(torch.uint32), 0x243F6A88
    n = u32.numel()
    partials = torch.empty(triton.cdiv(n, 8192), dtype=torch.uint64)
    g.hash_tiles32_kernel_blocked[(partials.numel(),)](
        u32, partials, n, seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
        FM_C1=g.FMIX32_C1, FM_C2=g.FMIX32_C2, POS_A=g.POS_C1, POS_B=g.POS_C2, TILE=8192, BLOCK=256, USE_CG=True)
    cur = partials
    while cur.numel() > 1:
        nxt = torch.empty(triton.cdiv(cur.numel(), 1024), dtype=torch.uint64)
        g.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, cur.numel(), CHUNK=1024)
        cur = nxt
    return f"{g._final_splitmix64(int(cur.item()) & ((1 << 64) - 1)):016x}"

print(json.dumps({name: sglang_hash(t) for name, t in load_file(sys.argv[1]).items()}))
"""


def test_the_gpu_hash_is_sglangs_triton_kernel(tmp_path):
    """What SGLang 0.5.23 reports for weights on a GPU (`gpu_tensor_hash`, a triton kernel) is
    what the learner computes with torch ops (`gpu_tensor_checksum`): SGLang's own kernels, run
    by triton's interpreter in the SGLang venv, on tensors of 1 to 4 tiles, of several dtypes
    and of byte counts that are not multiples of 4 (zero-padded). One bit flipped changes it."""
    import json
    import subprocess

    from safetensors.torch import save_file
    from sglang_venv import sglang_python_or_skip

    g = torch.Generator().manual_seed(0)
    tensors = {"f32_3_tiles": torch.randn(3 * 8192 + 5, generator=g),
               "bf16_odd": torch.randn(4099, generator=g).to(torch.bfloat16),
               "u8_7_bytes": torch.arange(7, dtype=torch.uint8), "f32_2d": torch.randn(64, 33, generator=g)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    proc = subprocess.run([str(sglang_python_or_skip()), "-c", GPU_HASH_REFERENCE, str(tmp_path / "t.safetensors")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sglang = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {name: gpu_tensor_checksum(t) for name, t in tensors.items()} == sglang
    assert gpu_tensor_checksum(tensors["f32_3_tiles"], chunk_tiles=1) == sglang["f32_3_tiles"]  # chunked passes
    flipped = tensors["bf16_odd"].clone()
    flipped.view(torch.int16)[100] ^= 1
    assert gpu_tensor_checksum(flipped) != sglang["bf16_odd"]


def test_checksums_follow_the_dtype_the_engines_report_and_stop_where_they_do_not_agree(monkeypatch):
    """An engine attached by URL may hold another dtype than this config would start (a real
    SGLang run's engines were fp32, the config's `auto` bf16: every tensor "differed" and the
    run stopped). The learner hashes in the dtype the engines report (`/server_info`); where
    they report different dtypes, or `auto`, checksums are off, said once, and the probe
    judges (issue #37 item 4)."""
    from dapo_mega.config import load_config
    from dapo_mega.driver.policy_sync import PolicySync
    from dapo_mega.engines.sglang.client import EngineClient
    from dapo_mega.engines.sglang.endpoint import EngineEndpoint
    from dapo_mega.wire.checksum import CPU_HASH, HF

    reports = {}

    async def server_info(client):
        return {"dtype": reports[client.url]}
    monkeypatch.setattr(EngineClient, "server_info", server_info)
    said = []
    role = type("Role", (), {"say": lambda self, message, error=False: said.append(message)})()
    sync = PolicySync(load_config(["rollout.dtype=bfloat16"]), layout=None, role=role)
    engines = [EngineEndpoint("http://127.0.0.1:5"), EngineEndpoint("http://127.0.0.1:6")]
    reports.update({"http://127.0.0.1:5": "float32", "http://127.0.0.1:6": "float32"})
    sync.engine_dtype = sync._engines_dtype(engines)
    assert sync.held_as() == HeldAs(torch.float32, HF, CPU_HASH) and not said
    reports["http://127.0.0.1:6"] = "bfloat16"
    sync.engine_dtype = sync._engines_dtype(engines)
    assert sync.held_as() is None and "checksums not compared" in said[0] and "bfloat16" in said[0]


def test_a_mixture_on_sglang_is_left_to_the_probe():
    """SGLang fuses each layer's experts (`w13_weight`, `w2_weight`), which the learner's
    per-expert tensors do not hash to: a mixture's checksums on SGLang are not compared (every
    expert would look missing and stop the run at step 1); the embedded engine keeps them."""
    from dapo_mega.config import load_config
    from dapo_mega.driver.policy_sync import PolicySync
    from dapo_mega.wire.checksum import CPU_HASH, HF, SGLANG_TP1

    role = type("Role", (), {"say": lambda self, message, error=False: None})()
    sglang = PolicySync(load_config(["rollout.backend=sglang", "cluster.device=cpu"]), layout=None, role=role)
    sglang.engine_dtype = "float32"
    assert sglang.held_as(mixture=False) == HeldAs(torch.float32, SGLANG_TP1, CPU_HASH)
    assert sglang.held_as(mixture=True) is None
    embedded = PolicySync(load_config([]), layout=None, role=role)
    embedded.engine_dtype = "float32"
    assert embedded.held_as(mixture=True) == HeldAs(torch.float32, HF, CPU_HASH)
