"""How far `verify`'s verdict is from its bounds, by depth, on correct and on wrong conversions.

    python bench/verify_margins.py [--smollm2 DIR] [--out bench/results/verify_margins.json]

Not a speed benchmark: the figures are the margins the defaults of dapo_mega/weights/verify.py
stand on (docs/conversion.md copies the table). Models, all stored in bf16 as a user's are:

* SmolLM2-135M-Instruct (a trained model, `tools/smollm2_checkpoint.py --dtype bfloat16`), whole
  (30 layers) and truncated to its first 8 and 16 layers;
* a random Qwen2-shaped model of 64 layers (hidden 128: Qwen2.5-32B's depth).

Each is imported at TP 1 and verified with both compute modes (fp32, the default where memory
allows, and bf16, the stored dtype) over three draws of probe text; then each wrong conversion
of tests/helpers/wrong_conversions.py is made from the 30- and 64-layer models and verified the
same way. A row gives the worst draw's relative max |Δlogit| (max |Δ| / max(1, max |HF logit|),
the fp32 criterion), mean next-token KL and top-1 agreement (the bf16 criterion), and the
verdict of the logit criterion.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

SEEDS = (0, 1, 2)


def bf16_copy(src: Path, dst: Path) -> Path:
    """`src` re-saved in bf16 (config says bfloat16), tokenizer files kept."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(shard)).items()}, str(shard),
                  metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}, indent=2))
    return dst


def measure(hf: Path, reference: Path, work: Path, label: str, how: str) -> list:
    from dapo_mega.weights import convert, verify

    meg = work / f"meg_{label}_{how}".replace(" ", "_")
    convert.import_hf_checkpoint(hf, meg, progress=False)
    rows = []
    for compute in ("float32", "bfloat16"):
        s = verify.verify_conversion(reference, meg, compute=compute, seeds=SEEDS)
        a = s.agreement
        rows.append({"model": label, "conversion": how, "compute": compute,
                     "rel_max_diff": a.max_abs_diff / max(1.0, a.ref_abs_max), "mean_kl": a.mean_kl,
                     "top1": a.top1_agreement, "logits_pass": s.logits_passed, "verdict": s.passed,
                     "config_differences": s.config_differences, "hint": s.hint})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", type=Path, default=None, help="a bf16 SmolLM2 HF dir (else written here)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "verify_margins.json")
    args = parser.parse_args()
    from helpers.wrong_conversions import WRONG_CONVERSIONS, break_checkpoint, truncated_copy

    from dapo_mega.config import ModelConfig
    from dapo_mega.models.tiny import build_tiny_model_dir

    rows = []
    with tempfile.TemporaryDirectory(prefix="verify_margins_") as tmp:
        work = Path(tmp)
        smol = args.smollm2
        if smol is None:
            smol = work / "smollm2"
            subprocess.run([sys.executable, str(REPO / "tools" / "smollm2_checkpoint.py"), "--dtype", "bfloat16",
                            str(smol)], check=True, cwd=REPO)
        deep = bf16_copy(build_tiny_model_dir(
            work / "deep_fp32", ModelConfig(tiny_hidden_size=128, tiny_num_layers=64, tiny_num_attention_heads=4,
                                            tiny_num_key_value_heads=2, tiny_intermediate_size=384), seed=0,
            architecture="qwen2"), work / "deep")
        models = {f"SmolLM2 {n} layers": truncated_copy(smol, work / f"smol{n}", n) for n in (8, 16)}
        models["SmolLM2 30 layers"] = smol
        models["random Qwen2 64 layers"] = deep
        for label, hf in models.items():
            rows += measure(hf, hf, work, label, "correct")
        for label in ("SmolLM2 30 layers", "random Qwen2 64 layers"):
            for how in WRONG_CONVERSIONS:
                broken = break_checkpoint(models[label], work / f"broken_{label}_{how}".replace(" ", "_"), how)
                rows += measure(broken, models[label], work, label, how)
    from timing import write_result

    write_result(args.out, {"name": "verify_margins", "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
