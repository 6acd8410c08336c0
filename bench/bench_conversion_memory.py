"""Host memory of checkpoint conversion (import, export, verify), per process, against the model's bytes.

    python bench/bench_conversion_memory.py [--quick]

Writes a ~1 GB bf16 Qwen2-shaped HF checkpoint (8 layers of hidden 2048, FFN 8192; 973 MiB),
then runs `tools/convert_checkpoint.py` at TP 1 in a fresh process for each action:
`import` (HF -> Megatron), `export` (Megatron -> HF) and `verify` (logits of both), and reads
the peak resident memory of the tool's process and of every process it starts (ru_maxrss of
itself and of its children: the spawned rank and megatron's forked checkpoint writers; the
largest single process counts, not their sum). The figure is peak RSS / checkpoint bytes;
the goal is at most 1.5. `fixed_mib` is the same import on a model of a few MiB: the
interpreter with torch, megatron and transformers imported, which any conversion pays
whatever the model's size (at 32B it is ~1% of the model).

How the conversion stays near one copy of the model: the model is built in the
checkpoint's dtype without random initialisation; HF tensors are read one at a time with
plain reads (no memory map whose pages would count in RSS); megatron's writer is given no
views to clone (SwiGLU's fc1 halves); the loader's merged fc1 tensors are copied into the
parameters as they are made; export writes each tensor to disk as it comes; verify holds one
model at a time, in the checkpoint's dtype.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "convert_checkpoint.py"


def _write_checkpoint(out: Path, quick: bool, tiny: bool = False) -> int:
    """An HF directory in bf16; returns the bytes of its safetensors files."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo_mega.config import ModelConfig
    from dapo_mega.models.tiny import build_tiny_model_dir

    if tiny:
        cfg = ModelConfig()
    else:
        cfg = ModelConfig(tiny_hidden_size=1024 if quick else 2048, tiny_num_layers=2 if quick else 8,
                          tiny_num_attention_heads=16, tiny_num_key_value_heads=4,
                          tiny_intermediate_size=4096 if quick else 8192, tiny_max_position_embeddings=256)
    build_tiny_model_dir(out, cfg, seed=0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(out)  # config.json now says bfloat16
    del model
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def _peak_rss_mib(args) -> float:
    """Peak RSS (MiB) of the largest process of one tool run (itself or any process it started).

    Only the wrapper's children count: Linux carries a process's peak RSS across exec, so the
    wrapper's own figure is that of this (large) benchmark process, which started it.
    """
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0)")
    out = subprocess.run([sys.executable, "-c", code, sys.executable, str(TOOL), *args], capture_output=True,
                         text=True, check=True, cwd=REPO)
    return float(out.stdout.strip().splitlines()[-1])


def _actions(hf: Path, meg: Path, out: Path):
    return {"import": ["import", "--hf-path", str(hf), "--megatron-path", str(meg), "--tp", "1"],
            "export": ["export", "--megatron-path", str(meg), "--hf-path", str(out), "--tp", "1"],
            "verify": ["verify", "--hf-path", str(hf), "--megatron-path", str(meg), "--tp", "1"]}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return out.stdout.strip()


def run(quick: bool = False) -> dict:
    repeats = 1 if quick else 2
    with tempfile.TemporaryDirectory(prefix="dapo_conv_mem_") as tmp:
        tmp = Path(tmp)
        nbytes = _write_checkpoint(tmp / "hf", quick)
        runs = {name: [] for name in ("import", "export", "verify")}
        for i in range(repeats):
            for name, args in _actions(tmp / "hf", tmp / f"meg{i}", tmp / f"out{i}").items():
                runs[name].append(_peak_rss_mib(args))
        _write_checkpoint(tmp / "tiny", quick, tiny=True)
        fixed = _peak_rss_mib(_actions(tmp / "tiny", tmp / "tiny_meg", tmp / "tiny_out")["import"])
    model_mib = nbytes / 2**20
    rows = []
    for name, peaks in runs.items():
        best = min(peaks)
        rows.append({"name": f"conversion_memory/{name}",
                     "metric": f"peak RSS / checkpoint bytes, {name} at TP 1 ({model_mib:.0f} MiB bf16 checkpoint)",
                     "ours": best / model_mib, "peak_rss_mib": peaks, "baseline": 1.5,
                     "baseline_name": "goal (model bytes x 1.5)", "ratio": 1.5 / (best / model_mib),
                     "higher_is_better": False,
                     "ratio_without_fixed": (best - fixed) / model_mib})
    worst = max(rows, key=lambda r: r["ours"])
    return {"name": "conversion_memory",
            "metric": f"peak RSS / checkpoint bytes, worst of import/export/verify at TP 1 "
                      f"({model_mib:.0f} MiB bf16 checkpoint; {worst['name'].split('/')[1]})",
            "ours": worst["ours"], "baseline": 1.5, "baseline_name": "goal (model bytes x 1.5)",
            "ratio": 1.5 / worst["ours"], "higher_is_better": False, "checkpoint_mib": model_mib,
            "fixed_mib": fixed, "rows": rows, "commit": _commit()}


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
