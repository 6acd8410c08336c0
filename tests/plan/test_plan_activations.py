"""`dapo-mega plan`'s memory formulas against a tiny megatron-core model on the CPU.

The formulas (dapo_mega/plan/memory.py) are derived tensor by tensor from what each op keeps for
backward; here they meet what torch actually keeps, measured by means they did not compute:

* activations: every tensor autograd saves (`torch.autograd.graph.saved_tensors_hooks`),
  counted once per storage, parameters left out, attributed to the transformer layer whose
  forward was running; in forward without recompute, in forward (the checkpoints' inputs)
  and in backward (each layer recomputed) with full recompute;
* the logits peak: the bytes of every live storage after each aten op
  (a `TorchDispatchMode` that reads each storage's reference count) through the chunked
  log-prob forward and backward on the model's own logits;
* weights, gradients and optimizer state: the sizes of the parameter, main-grad and Adam
  state tensors of a learner after one update.

The local layer spec in fp32 is what runs on a CPU, so its variant of the formula is the one
checked; the Transformer Engine variant differs in named terms only (`layer_saved_bytes`).
Factors: per-layer activations, recomputed layers, logits and model state within 1%; the
kept checkpoint inputs between the formula and the formula plus the per-micro-batch inputs
it leaves out (bool mask, token ids, RoPE frequencies: negligible at 22k tokens, not here);
the peak of a whole step (forward, log-probs, backward), measured with the same dispatch
mode, between 0.8x and 1.1x the plan's activation peak (measured 0.94x without and 0.90x
with full recompute: the backward-temporaries term is an upper bound).
"""

from __future__ import annotations

from dist_helpers import run_distributed

TOKENS = 256
SHAPE = dict(tiny_hidden_size=64, tiny_intermediate_size=352, tiny_num_attention_heads=4, tiny_num_key_value_heads=2,
             tiny_num_layers=2, tiny_max_position_embeddings=1024)
CHUNK = 64  # log-prob chunk: 4 chunks over the row


def _config(recompute: bool):
    from dist_helpers import make_config

    cfg = make_config(micro_batch_tokens=TOKENS, train_batch_size=1, mini_batch_size=1, n=2)
    for name, value in SHAPE.items():
        setattr(cfg.model, name, value)
    cfg.cluster.device = "cpu"
    if recompute:
        m = cfg.megatron
        m.recompute_granularity, m.recompute_method, m.recompute_num_layers = "full", "uniform", 1
    return cfg


def _saved_bytes_by_layer(model, run):
    """{layer index or "other": bytes} of the tensors autograd saves while `run()` runs."""
    import collections

    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where = ["other"]
    saved = collections.defaultdict(dict)

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[where[0]][storage.data_ptr()] = storage.nbytes()
        return t

    hooks = []
    for i, layer in enumerate(model.decoder.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "other")))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    for h in hooks:
        h.remove()
    return {k: sum(v.values()) for k, v in saved.items()}


def measure_tiny(rank, world, architecture, ep=1):
    """Saved bytes by layer of a tiny model of `architecture` built by megatron-core (a rank's share at EP `ep`)."""
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import build_model
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = _config(recompute=False)
    cfg.megatron.expert_model_parallel_size = ep
    hf = tiny_hf_config(cfg.model, architecture=architecture)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    (model,), _ = build_model(hf, cfg.megatron, layout)
    tokens, position_ids, mask = _inputs(60)
    return _saved_bytes_by_layer(model, lambda: model(tokens, position_ids, mask))


def _peak_new_bytes(fn, existing):
    """Peak bytes of storages created while `fn()` runs (inputs in `existing` not counted): after
    every aten op, the storages still referenced from anywhere but this tracker."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Tracker(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = {t.untyped_storage().data_ptr(): (t.untyped_storage(), 0) for t in existing}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                    self.live[t.untyped_storage().data_ptr()] = (t.untyped_storage(), t.untyped_storage().nbytes())
            for key in [k for k, (s, _) in self.live.items() if torch._C._storage_Use_Count(s._cdata) <= 1]:
                del self.live[key]
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
            return out

    with Tracker() as tracker:
        fn()
    return tracker.peak


def _inputs(vocab):
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (1, TOKENS), generator=g)
    position_ids = torch.arange(TOKENS).unsqueeze(0)
    mask = torch.triu(torch.ones(TOKENS, TOKENS, dtype=torch.bool), 1).view(1, 1, TOKENS, TOKENS)
    return tokens, position_ids, mask


def _measure(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from dist_helpers import make_samples

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.backends.megatron.logprobs import chunked_log_probs_and_entropy
    from dapo_mega.backends.megatron.model import build_model
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = _config(recompute=False)
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    learner = MegatronLearner(cfg, hf, layout)
    learner.train_step(make_samples(num=2, vocab=60))  # Adam's m and v exist after the first update
    params = [p for chunk in learner.model_chunks for p in chunk.parameters()]
    state = {"params": sum(p.numel() for p in params), "param_bytes": sum(p.numel() * p.element_size() for p in params),
             "grad_bytes": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
             "optimizer_bytes": sum(t.numel() * t.element_size() for opt in getattr(
                 learner.optimizer, "chained_optimizers", [learner.optimizer]) for s in opt.optimizer.state.values()
                 for t in s.values() if torch.is_tensor(t) and t.numel() > 1)}

    (model,), _ = build_model(hf, cfg.megatron, layout)
    tokens, position_ids, mask = _inputs(60)
    labels = torch.roll(tokens, -1, dims=1)
    out = {}
    plain = _saved_bytes_by_layer(model, lambda: out.setdefault("logits", model(tokens, position_ids, mask)))

    logits = out["logits"].detach().requires_grad_(True)

    def log_prob_step():
        log_p, _ = chunked_log_probs_and_entropy(logits, labels, 0.7, hf.vocab_size, chunk_tokens=CHUNK)
        log_p.sum().backward()

    logits_peak = _peak_new_bytes(log_prob_step, [logits, labels]) + logits.numel() * logits.element_size()

    full_cfg = _config(recompute=True)
    (full,), _ = build_model(hf, full_cfg.megatron, layout)
    loss = {}
    kept = _saved_bytes_by_layer(full, lambda: loss.setdefault("sum", full(tokens, position_ids, mask).sum()))
    recomputed = _saved_bytes_by_layer(full, lambda: loss["sum"].backward())
    step_peaks = [_step_peak(m, tokens, position_ids, mask, labels, hf.vocab_size) for m in (model, full)]
    return {"state": state, "plain": plain, "logits_peak": logits_peak, "kept": kept, "recomputed": recomputed,
            "vocab_local": logits.shape[-1], "vocab": hf.vocab_size, "step_peaks": step_peaks}


def _step_peak(model, tokens, position_ids, mask, labels, vocab):
    """Peak bytes above the weights and their gradients of one forward, log-prob and backward."""
    from dapo_mega.backends.megatron.logprobs import LOGPROB_CHUNK_TOKENS, chunked_log_probs_and_entropy

    def step():
        log_p, _ = chunked_log_probs_and_entropy(model(tokens, position_ids, mask), labels, 0.7, vocab,
                                                 chunk_tokens=LOGPROB_CHUNK_TOKENS)
        log_p.sum().backward()

    step()  # the gradients exist from here on
    params = list(model.parameters())
    return _peak_new_bytes(step, params + [p.grad for p in params] + [tokens, position_ids, mask, labels])


def test_plan_memory_meets_a_tiny_model_on_the_cpu():
    from dapo_mega.models.shape import ModelShape
    from dapo_mega.models.tiny import tiny_hf_config
    from dapo_mega.plan.memory import layer_saved_bytes, learner_stages, logits_peak_bytes, stage_activation_bytes

    got = run_distributed(_measure, 1, timeout_s=240)[0]
    cfg, full_cfg = _config(recompute=False), _config(recompute=True)
    shape = ModelShape.from_hf_config(tiny_hf_config(cfg.model))
    assert shape.vocab_size == got["vocab"]

    # weights, main grads, Adam m and v (fp32 params on the CPU: no separate master copy)
    stage = learner_stages(cfg, shape, dp=1)[0]
    assert got["state"]["params"] == stage.params
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert got["state"][key] == getattr(stage, key), key

    # one layer, one micro-batch, no recompute: every saved tensor, term by term
    per_layer = sum(layer_saved_bytes(shape, TOKENS, 1, False, spec="local", element_bytes=4).values())
    for layer in range(shape.num_layers):
        assert abs(got["plain"][layer] - per_layer) <= 0.01 * per_layer, (layer, got["plain"][layer], per_layer)
    assert stage_activation_bytes(cfg, shape, 0).per_layer == per_layer

    # full recompute: forward keeps each layer's input (+ the final norm's tensors); backward
    # recomputes each layer, which saves what the layer saves without recompute
    acts = stage_activation_bytes(full_cfg, shape, 0)
    assert acts.recompute == per_layer
    measured_kept = sum(got["kept"].values())
    left_out = TOKENS * TOKENS + 8 * TOKENS + 4 * TOKENS * shape.head_dim  # bool mask, token ids, RoPE freqs
    assert acts.kept <= measured_kept <= 1.01 * (acts.kept + left_out), (measured_kept, acts.kept)
    for layer in range(shape.num_layers):
        assert abs(got["recomputed"][layer] - per_layer) <= 0.01 * per_layer, (layer, got["recomputed"][layer])

    # the whole step (forward, log-probs, backward; transient weight gradients included) against
    # the stage's activation peak: kept + max(recomputed layers + backward temporaries, logits)
    for config, measured in zip((cfg, full_cfg), got["step_peaks"]):
        planned = stage_activation_bytes(config, shape, 0).peak
        assert 0.8 * planned <= measured <= 1.1 * planned, (config.megatron.recompute_granularity, measured, planned)

    # logits: the model's fp32 logits + their gradient + the chunks of ChunkedVocabParallelLogProbs
    expected = logits_peak_bytes(TOKENS, got["vocab_local"], logits_bytes=4, chunk_tokens=CHUNK).peak
    assert abs(got["logits_peak"] - expected) <= 0.01 * expected, (got["logits_peak"], expected)
