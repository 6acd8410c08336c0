"""Tiny Qwen3 checkpoints for the Qwen3 tests, with RMSNorm weights that are not all ones, and
transformers' greedy decoding of one (the reference the engines are held to).

transformers initialises every RMSNorm weight to 1, so a q_norm swapped with k_norm, or a
norm weight never applied, would pass a round trip or a logits comparison unnoticed; here
each norm weight (q_norm, k_norm, the layer and final norms) is drawn around 1 instead.
"""

from __future__ import annotations

from pathlib import Path

from dapo_mega.config import ModelConfig
from dapo_mega.models.tiny import build_tiny_model_dir


def build_qwen3_dir(out_dir: Path, seed: int = 0, tie_word_embeddings: bool = False,
                    norm_scale: float = 0.3) -> Path:
    """A tiny Qwen3 (head_dim 2·hidden/heads) whose norm weights are 1 + norm_scale·N(0, 1)."""
    import torch
    from safetensors.torch import load_file, save_file

    out = build_tiny_model_dir(out_dir, ModelConfig(tiny_tie_word_embeddings=tie_word_embeddings), seed=seed,
                               architecture="qwen3")
    path = out / "model.safetensors"
    state = load_file(str(path))
    generator = torch.Generator().manual_seed(seed + 1000)
    for name in sorted(state):
        if name.endswith("norm.weight"):
            state[name] = 1.0 + norm_scale * torch.randn(state[name].shape, generator=generator)
    save_file(state, str(path), metadata={"format": "pt"})
    return out


def hf_greedy(model_dir, prompts, steps: int, state=None, architecture: str = "Qwen3ForCausalLM") -> list:
    """transformers' argmax decoding (fp32) of `model_dir` (of class `architecture`), or of its
    model with `state` loaded: per prompt, (the `steps` new token ids, their log-probs)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture, type(model).__name__
    if state is not None:
        model.load_state_dict(state, strict=True)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, logprobs = list(prompt), []
            for _ in range(steps):
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
                ids.append(int(logp.argmax()))
                logprobs.append(float(logp[ids[-1]]))
            out.append((ids[len(prompt):], logprobs))
    return out
