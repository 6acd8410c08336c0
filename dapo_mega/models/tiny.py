"""The tiny synthetic Qwen2 model of the embedded CPU default, built from config (or a tiny
Qwen3 / Llama of the same sizes, for the tests of each model family).

`build_tiny_model_dir` writes a complete Hugging Face checkpoint directory (config.json,
generation_config.json, a character-level fast tokenizer, randomly initialised
model.safetensors) that transformers, the embedded engine, the Megatron learner and the
conversion tool all load as they would load Qwen2.5-32B. Nothing is downloaded.

The tokenizer maps each printable ASCII character to one token, so arithmetic such as
"12+34" is 5 tokens and a tiny model can learn it in minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path
from typing import Dict, Optional, Sequence, get_args

from dapo_mega.config import ModelConfig, TinyArchitecture

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def _byte_level(ch: str) -> str:
    """The byte-level (GPT-2 / Qwen) spelling of one character: ' ' -> 'Ġ', '\\n' -> 'Ċ'."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(ch)[0][0]


def build_char_vocab() -> Dict[str, int]:
    """Special tokens first, then one id per character of CHARACTERS (byte-level spelling)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[_byte_level(ch)] = len(vocab)
    return vocab


def build_char_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per character.

    It is byte-level like Qwen's own, because transformers loads every `qwen2` checkpoint
    through `Qwen2Tokenizer`, which re-applies the byte-level pre-tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=build_char_vocab(), merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


CHATML_TEMPLATE = ("{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %} {{ tool['function']['name'] }}"
                   "{% endfor %}</tools><|im_end|>\n{% endif %}"
                   "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen2.5's and Qwen3's chat format (ChatML) without their system default, and with the tools
(`tools=`) named in one short system turn, where Qwen's list their JSON schemas between the same
`<tools>` tags: what `model.tiny_chat_template` gives the tiny tokenizer."""

TINY_ARCHITECTURES = get_args(TinyArchitecture)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[0], router_aux_loss_coef=0.001)
"""The tiny Qwen3-MoE's routing: 8 experts, 2 per token, renormalised top-k (Qwen3-30B-A3B's
choices at 1/16 the experts), and its first layer dense (`mlp_only_layers`), so that both kinds
of layer and the rule between them are exercised; each expert's SwiGLU is half the dense
MLP's size."""
QWEN3_HEAD_DIM_FACTOR = 2
"""A tiny Qwen3's head_dim is this many times hidden / heads, so that the code paths that
must read `head_dim` rather than divide the hidden size are exercised (Qwen3-8B: 128 = 4096/32,
Qwen3-0.6B: 128 != 1024/16)."""


def tiny_hf_config(model_cfg: ModelConfig, vocab_size: Optional[int] = None, architecture: Optional[str] = None,
                   rope_scaling: Optional[Dict[str, float]] = None, dense_layers: Optional[Sequence[int]] = None):
    """The transformers config of the tiny model (Qwen2 by default, Qwen3, Llama or Qwen3-MoE).

    `rope_scaling` (Llama only): the Llama-3 scaling fields `factor`, `low_freq_factor`,
    `high_freq_factor`, `original_max_position_embeddings` (rope_type "llama3").
    `architecture`: None takes `model.tiny_architecture`.
    `dense_layers` (Qwen3-MoE only): its `mlp_only_layers` in place of TINY_MOE's ([] for every
    layer sparse, as Qwen3-30B-A3B and what SGLang 0.5.23 serves: plan/preflight.py); None
    takes `model.tiny_moe_dense_layers`.
    """
    architecture = architecture or model_cfg.tiny_architecture
    dense_layers = model_cfg.tiny_moe_dense_layers if dense_layers is None else dense_layers
    vocab = build_char_vocab()
    common = dict(
        vocab_size=vocab_size or len(vocab),
        hidden_size=model_cfg.tiny_hidden_size,
        intermediate_size=model_cfg.tiny_intermediate_size,
        num_hidden_layers=model_cfg.tiny_num_layers,
        num_attention_heads=model_cfg.tiny_num_attention_heads,
        num_key_value_heads=model_cfg.tiny_num_key_value_heads,
        max_position_embeddings=model_cfg.tiny_max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=model_cfg.tiny_tie_word_embeddings,
        bos_token_id=vocab[BOS_TOKEN],
        eos_token_id=vocab[EOS_TOKEN],
        pad_token_id=vocab[PAD_TOKEN],
        dtype="float32",
    )
    if architecture == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if architecture == "qwen3":
        from transformers import Qwen3Config

        head_dim = QWEN3_HEAD_DIM_FACTOR * model_cfg.tiny_hidden_size // model_cfg.tiny_num_attention_heads
        return Qwen3Config(head_dim=head_dim, attention_bias=False, **common)
    if architecture == "llama":
        from transformers import LlamaConfig

        if rope_scaling:
            common["rope_parameters"] = {"rope_type": "llama3", "rope_theta": common.pop("rope_theta"),
                                         **rope_scaling}
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    if architecture == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        head_dim = QWEN3_HEAD_DIM_FACTOR * model_cfg.tiny_hidden_size // model_cfg.tiny_num_attention_heads
        routing = dict(TINY_MOE, **({} if dense_layers is None else {"mlp_only_layers": list(dense_layers)}))
        return Qwen3MoeConfig(head_dim=head_dim, attention_bias=False,
                              moe_intermediate_size=max(1, model_cfg.tiny_intermediate_size // 2), **routing, **common)
    raise ValueError(f"tiny model architecture {architecture!r}: use one of {TINY_ARCHITECTURES}")


def build_tiny_model_dir(out_dir: Path | str, model_cfg: Optional[ModelConfig] = None, seed: int = 0,
                         architecture: Optional[str] = None, with_weights: bool = True,
                         rope_scaling: Optional[Dict[str, float]] = None,
                         dense_layers: Optional[Sequence[int]] = None) -> Path:
    """Write a tiny HF checkpoint (config, tokenizer, random weights) to `out_dir`.

    Deterministic in `seed`. Returns `out_dir`. Existing files are overwritten.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_cfg = model_cfg or ModelConfig()
    hf_config = tiny_hf_config(model_cfg, architecture=architecture, rope_scaling=rope_scaling,
                               dense_layers=dense_layers)
    tokenizer = build_char_tokenizer()
    if model_cfg.tiny_chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)
    if with_weights:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        model.save_pretrained(out, safe_serialization=True)
    else:
        hf_config.save_pretrained(out)
    GenerationConfig(bos_token_id=hf_config.bos_token_id, eos_token_id=hf_config.eos_token_id,
                     pad_token_id=hf_config.pad_token_id).save_pretrained(out)
    (out / "dapo_mega_tiny.json").write_text(json.dumps({"architecture": architecture, "seed": seed}))
    return out


TINY_CACHE_ENV = "DAPO_MEGA_TINY_CACHE"
"""The folder that keeps each tiny model built (default `~/.cache/dapo_mega/tiny_models`;
"off": none). Building one imports transformers' modeling code and draws its weights, ~3 s
of a core in every fresh run; a copy takes milliseconds."""


def tiny_model_cache_dir(model_cfg: ModelConfig, seed: int) -> Optional[Path]:
    """Where the tiny model of `model_cfg` and `seed` is kept once built: a folder named by a
    hash of everything its files depend on (the model section's fields, the seed, this
    module's source, the transformers / tokenizers / torch / safetensors versions). None when
    `DAPO_MEGA_TINY_CACHE=off`."""
    import dataclasses
    import hashlib
    from importlib.metadata import version

    root = os.environ.get(TINY_CACHE_ENV, "")
    if root.lower() == "off":
        return None
    fields = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k.startswith("tiny_")}
    key = json.dumps({"fields": fields, "seed": seed, "source": Path(__file__).read_text(),
                      "versions": [version(p) for p in ("transformers", "tokenizers", "torch", "safetensors")]},
                     sort_keys=True)
    base = Path(root) if root else Path.home() / ".cache" / "dapo_mega" / "tiny_models"
    return base / hashlib.sha256(key.encode()).hexdigest()[:20]


def _publish(built: Path, final: Path) -> None:
    """Rename the directory `built` to `final`, or remove `built` when another process put one
    there first (every process builds the same deterministic files)."""
    try:
        os.rename(built, final)  # fails where another process put a directory there first
    except OSError:
        shutil.rmtree(built, ignore_errors=True)


def build_tiny_model_in_place(model_dir: Path, model_cfg: ModelConfig, seed: int) -> Path:
    """The tiny model's HF files at `model_dir`, built once however many processes ask at the
    same time (every learner rank may get here before process groups exist, and the Slurm
    prepare step too): each builds the same deterministic files into its own directory and the
    first rename wins; the others drop theirs. The files come from the cache
    (`tiny_model_cache_dir`) when it holds them, and go there when it does not. Returns
    `model_dir`."""
    model_dir = Path(model_dir)
    tmp = model_dir.with_name(f"{model_dir.name}.tmp-{os.getpid()}")
    cached = tiny_model_cache_dir(model_cfg, seed)
    if cached is not None and (cached / "dapo_mega_tiny.json").is_file():
        shutil.copytree(cached, tmp)
    else:
        build_tiny_model_dir(tmp, model_cfg, seed=seed)
        if cached is not None:
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                staging = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
                shutil.copytree(tmp, staging)
                _publish(staging, cached)
            except OSError:  # a read-only or full home: the run goes on without the cache
                pass
    _publish(tmp, model_dir)
    return model_dir
