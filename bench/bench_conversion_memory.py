"""Host memory of the HF -> Megatron conversion, per process, against the checkpoint's bytes.

    python bench/bench_conversion_memory.py [--quick]

Writes a ~1 GB fp32 Qwen2-shaped HF checkpoint (4 layers of hidden 2048, FFN 8192), then
runs `tools/convert_checkpoint.py import --tp 1` in a fresh process and reads the peak
resident memory of that process and of the ranks it starts (ru_maxrss of itself and of its
children). The figure is peak RSS / checkpoint bytes: the goal is at most 1.5 (the model
once, plus the reader's and the writer's buffers). The conversion builds the Megatron model
without random initialisation (`build_model(initialize=False)`): before, megatron's CPU
initialisation and `initialize_weights` each drew a full copy first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _write_checkpoint(out: Path, quick: bool) -> int:
    from dapo_mega.config import ModelConfig
    from dapo_mega.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(tiny_hidden_size=1024 if quick else 2048, tiny_num_layers=2 if quick else 4,
                      tiny_num_attention_heads=16, tiny_num_key_value_heads=4,
                      tiny_intermediate_size=4096 if quick else 8192, tiny_max_position_embeddings=256)
    build_tiny_model_dir(out, cfg, seed=0)
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def _peak_rss_mib(argv) -> float:
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024.0)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True,
                         cwd=REPO)
    return float(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="dapo_conv_mem_") as tmp:
        hf, meg = Path(tmp) / "hf", Path(tmp) / "meg"
        nbytes = _write_checkpoint(hf, quick)
        runs = []
        for i in range(1 if quick else 2):
            runs.append(_peak_rss_mib([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "import",
                                       "--hf-path", str(hf), "--megatron-path", f"{meg}{i}", "--tp", "1"]))
    model_mib = nbytes / 2**20
    best = min(runs)
    return {"name": "conversion_memory", "metric": f"peak RSS / checkpoint bytes, HF -> Megatron import at TP 1 "
                                                  f"({model_mib:.0f} MiB fp32 checkpoint)",
            "ours": best / model_mib, "peak_rss_mib": runs, "checkpoint_mib": model_mib,
            "baseline": 1.5, "baseline_name": "goal (model bytes x 1.5)", "ratio": 1.5 / (best / model_mib),
            "higher_is_better": False}


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
