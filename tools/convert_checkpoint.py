#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and Megatron formats, and check a conversion.

    python tools/convert_checkpoint.py import --hf-path Qwen2.5-7B --megatron-path ckpt/qwen7b [--tp 2 --pp 2] [--dtype bf16]
    python tools/convert_checkpoint.py export --megatron-path outputs/run [--hf-config-from Qwen2.5-7B] --hf-path out/hf
    python tools/convert_checkpoint.py verify --hf-path Qwen2.5-7B --megatron-path ckpt/qwen7b [--tp 2]

import   HF safetensors (single file or sharded with model.safetensors.index.json) → a
         Megatron distributed checkpoint (megatron.core.dist_checkpointing, loadable at any
         TP/PP) plus dapo_mega_model.json and the HF config/tokenizer files.
export   A converted checkpoint, a training checkpoint (`step_<N>` dir) or a run directory
         (its latest complete checkpoint) → sharded HF safetensors + index, config.json,
         generation_config.json and tokenizer files; loads with
         transformers.AutoModelForCausalLM.from_pretrained.
verify   Next-token logits of the HF model and the Megatron checkpoint on the same real text
         (worked problems in the tokenizer's chat template, or --text), one model at a time,
         in fp32 where host RAM allows (weights upcast exactly from the stored dtype): PASS
         when max |dlogit| <= 1e-3 * max(1, max |HF logit|); in the stored dtype (--compute
         stored) on mean next-token KL and top-1 agreement. Exits 1 on FAIL, naming a config
         field or the first layer that differs (dapo_mega/weights/verify.py).
--tp/--pp choose the parallel layout the conversion itself runs at: the tool spawns tp·pp
local processes. They run on the CPU (gloo, no GPU visible, also on a GPU node) unless
--device cuda: then rank r runs on GPU r of the node, and more ranks than GPUs are refused.
The result depends on neither (distributed checkpoints reshard on load; CPU and GPU runs
read and write the same checkpoints).
Supported architectures: Qwen2ForCausalLM (Qwen2 / Qwen2.5) and LlamaForCausalLM.
The logic lives in dapo_mega/weights/convert.py and verify.py; this file is only the command line.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    imp = sub.add_parser("import", help="HF safetensors -> Megatron distributed checkpoint")
    imp.add_argument("--hf-path", required=True, help="HF checkpoint directory (config.json + safetensors)")
    imp.add_argument("--megatron-path", required=True, help="output directory")
    imp.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"],
                     help="stored dtype (default: the HF config's dtype)")

    exp = sub.add_parser("export", help="Megatron (converted, training step or run dir) -> HF safetensors")
    exp.add_argument("--megatron-path", required=True,
                     help="converted checkpoint dir, checkpoints/step_<N>, checkpoints/latest, or a run directory")
    exp.add_argument("--hf-path", required=True, help="output HF directory")
    exp.add_argument("--hf-config-from", default=None,
                     help="HF directory to take config.json and tokenizer files from (default: recorded with "
                          "the checkpoint)")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (e.g. 5GB, 500MB)")
    exp.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"],
                     help="exported dtype (default: the dtype the checkpoint was stored in)")

    ver = sub.add_parser("verify", help="compare HF and Megatron next-token logits on the same tokens")
    ver.add_argument("--hf-path", required=True)
    ver.add_argument("--megatron-path", required=True)
    ver.add_argument("--compute", default="auto", choices=["auto", "stored", "fp32", "bf16", "fp16"],
                     help="dtype both forwards run in: auto (default) = fp32 where host RAM holds the HF model "
                          "in fp32 (4 bytes per parameter), else the stored dtype; stored = the checkpoint's")
    ver.add_argument("--dtype", dest="compute", choices=["fp32", "bf16", "fp16"], help=argparse.SUPPRESS)
    ver.add_argument("--tolerance", type=float, default=None,
                     help="fp32: pass when max |dlogit| <= tolerance * max(1, max |HF logit|) (default 1e-3); "
                          "bf16/fp16: the largest mean next-token KL in nats (default 0.05)")
    ver.add_argument("--text", default=None, help="compare on this text instead of the built-in worked problems")
    ver.add_argument("--seeds", type=int, nargs="+", default=[0],
                     help="draws of built-in problems (or random ids), each through both loaded models; all must pass")
    ver.add_argument("--random-tokens", nargs=2, type=int, metavar=("ROWS", "LENGTH"), default=None,
                     help="compare on random token ids instead of text")

    for p in (imp, exp):
        p.add_argument("--tp", type=int, default=1, help="tensor parallel size the conversion runs at")
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel size the conversion runs at")
    ver.add_argument("--tp", type=int, default=1, help="tensor parallel size of the Megatron forward")
    for p in (imp, exp, ver):
        p.add_argument("--ep", type=int, default=1,
                       help="expert parallel size (a mixture of experts; each rank holds num_experts / EP whole "
                            "experts); the conversion adds data-parallel ranks where TP has fewer than EP")
    for p in (imp, exp, ver):
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="where the ranks run: cpu (default: gloo, GPUs hidden) or cuda (rank r on GPU r; "
                            "at most as many ranks as the node's GPUs)")
    return parser


_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dapo_mega.config import ConfigError
    from dapo_mega.weights import convert, verify
    from dapo_mega.weights.hf_io import parse_size
    from dapo_mega.weights.mapping import WeightMappingError

    try:
        if args.command == "import":
            summary = convert.import_hf_checkpoint(args.hf_path, args.megatron_path, tp=args.tp, pp=args.pp,
                                                   dtype=_DTYPES.get(args.dtype), device=args.device, ep=args.ep)
        elif args.command == "export":
            summary = convert.export_megatron_checkpoint(
                args.megatron_path, args.hf_path, hf_config_from=args.hf_config_from, tp=args.tp, pp=args.pp,
                max_shard_bytes=parse_size(args.max_shard_size), dtype=_DTYPES.get(args.dtype), device=args.device,
                ep=args.ep)
        else:
            summary = verify.verify_conversion(
                args.hf_path, args.megatron_path, tp=args.tp, tolerance=args.tolerance,
                compute=_DTYPES.get(args.compute, args.compute), text=args.text, seeds=args.seeds,
                random_tokens=tuple(args.random_tokens) if args.random_tokens else None, device=args.device,
                ep=args.ep)
    except (WeightMappingError, ConfigError, FileNotFoundError, verify.VerifyInputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(summary.lines()))
    return 0 if summary.passed in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
