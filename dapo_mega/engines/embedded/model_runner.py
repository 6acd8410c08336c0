"""The model the embedded engine runs: a transformers `AutoModelForCausalLM` on one device,
its forward passes with a KV cache, and its weights, updated in place.

The forward is transformers' own, so every family it loads (Qwen2, Qwen3 with its q/k
norms and head_dim, Llama with llama3 RoPE scaling) is computed as transformers computes
it; this module only left-pads, caches and copies weights. (SGLang's `ModelRunner` holds
the same two jobs: forward and weight loading.)

`model_lock` is held by every forward step (`engine.GenerationEngine`) and every weight
load or release here, so a step never sees half-loaded weights. Weights are loaded by HF
name (`load_named_tensors`) after `check_named_meta` has checked every name, dtype and
shape against the model. The parameters are views into one flat storage per dtype
(`flat_weights.FlatParameters`), so a flattened bucket sent in their order is received in place.

Names are the checkpoint's, as SGLang's `load_weights` takes them: where transformers fuses a
mixture's experts into one parameter per layer (Qwen3-MoE's `mlp.experts.gate_up_proj`
[E, 2f, h] and `mlp.experts.down_proj` [E, h, f]), each expert's `gate_proj` / `up_proj` /
`down_proj` is a view into it (`checkpoint_views`).
"""

from __future__ import annotations

import threading
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from dapo_mega.engines.embedded.flat_weights import FlatParameters
from dapo_mega.engines.embedded.kv_cache import CACHE_KWARG, cache_of
from dapo_mega.engines.embedded.sampling import Sequence_
from dapo_mega.wire.transport import ENGINE_DTYPES


class CheckpointView(NamedTuple):
    """Where a checkpoint tensor lives: `params[param][index]` (the whole parameter when None)."""

    param: str
    index: Optional[Tuple[object, ...]]
    shape: Tuple[int, ...]


_FUSED_GATE_UP = ".mlp.experts.gate_up_proj"
_FUSED_DOWN = ".mlp.experts.down_proj"


def checkpoint_views(params: Dict[str, torch.Tensor]) -> Dict[str, CheckpointView]:
    """Checkpoint name -> CheckpointView of every tensor of a transformers model's state dict;
    fused experts (gate_up_proj [E, 2f, h]: gate rows first, as transformers' forward chunks
    them; down_proj [E, h, f]) are split into their per-expert checkpoint names."""
    views: Dict[str, CheckpointView] = {}
    for name, p in params.items():
        shape = tuple(p.shape)
        if name.endswith(_FUSED_GATE_UP):
            prefix, (experts, two_f, h) = name[: -len("gate_up_proj")], shape
            f = two_f // 2
            for k in range(experts):
                views[f"{prefix}{k}.gate_proj.weight"] = CheckpointView(name, (k, slice(0, f)), (f, h))
                views[f"{prefix}{k}.up_proj.weight"] = CheckpointView(name, (k, slice(f, two_f)), (f, h))
        elif name.endswith(_FUSED_DOWN):
            prefix, (experts, h, f) = name[: -len("down_proj")], shape
            for k in range(experts):
                views[f"{prefix}{k}.down_proj.weight"] = CheckpointView(name, (k,), (h, f))
        else:
            views[name] = CheckpointView(name, None, shape)
    return views


class ModelRunner:
    """One HF model and tokenizer: forward with a KV cache, weights loaded, released, resumed."""

    def __init__(self, model_path: str, dtype: str = "float32", weight_version: str = "default",
                 enable_weights_cpu_backup: bool = False, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=ENGINE_DTYPES[dtype]).to(
            self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model_path = model_path
        self.weight_version = str(weight_version)
        self.enable_weights_cpu_backup = enable_weights_cpu_backup
        self.tied_embeddings = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.params: Dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        self.views: Dict[str, CheckpointView] = checkpoint_views(self.params)
        """Checkpoint name -> where it lives in `params` (module docstring)."""
        self._param_shapes = {name: view.shape for name, view in self.views.items()}
        self.flat = FlatParameters(self.params, {k: tuple(v.shape) for k, v in self.params.items()})
        self.flat.plan(list(self.params))  # the HF state-dict order, until a sync sends another
        with torch.no_grad():
            self.flat.allocate("current")
        self.weights_released = False
        self.routing: Optional[Routing] = None
        """Records each forward's routed experts, once `enable_expert_capture` found a mixture of experts."""
        # model_lock: held by every forward step and every weight load / release.
        self.model_lock = threading.RLock()

    # ------------------------------------------------------------------ forward
    def forward_prefill(self, rows: List[Sequence_]):
        """Left-padded prefill of prompt + output so far. Returns (last logits [B,V], cache, mask [B,T]).

        Rows with the same tokens (the n samples of one prompt) are computed once and their
        cache rows copied, as SGLang's prefix cache shares a prompt's KV among its samples.
        """
        unique: Dict[Tuple[int, ...], int] = {}
        inverse = [unique.setdefault(tuple(r.prompt_ids + r.output_ids), len(unique)) for r in rows]
        logits, cache, mask, experts = self._prefill_tokens([list(s) for s in unique])
        if experts is not None:  # every position of each row, recomputed: SGLang's capturer overwrites too
            for row, u in zip(rows, inverse):
                n = len(row.prompt_ids) + len(row.output_ids)
                row.routed = list(experts[u, experts.shape[1] - n:])
        if len(unique) < len(rows):
            index = torch.tensor(inverse, dtype=torch.long)
            cache.batch_select_indices(index.to(self.device))
            logits, mask = logits[index.to(logits.device)], mask[index]
        return logits, cache, mask

    def _prefill_tokens(self, seqs: List[List[int]]):
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), cache_of(out), mask, self._experts(len(seqs), width)

    def enable_expert_capture(self) -> bool:
        """--enable-return-routed-experts: a mixture of experts records its routers' choices from
        now on (hooks on them; a dense model has none). Whether it does."""
        self.routing = Routing.of(self.model)
        return self.routing is not None

    def _experts(self, batch: int, width: int) -> Optional[torch.Tensor]:
        """[batch, width, num_layers, top_k] int32 experts of each position (`Routing.experts`)."""
        return None if self.routing is None else self.routing.experts(batch, width)

    def prompt_logprobs(self, ids: Sequence[int], start: int) -> List[Optional[float]]:
        """SGLang's `input_token_logprobs` values of `ids[start:]` with logprob_start_len=`start`:
        None for the first, then log softmax(z)[t] of each later token given the ones before
        (no temperature: SGLang 0.5.23 scores prompt tokens with the raw log-softmax,
        `layers/logprob_processor.py`). One forward under `model_lock`: the weights held now."""
        with self.model_lock, torch.no_grad():
            if self.weights_released:
                raise RuntimeError("weights are released; call /resume_memory_occupation first")
            tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=tokens, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits[start:-1], dim=-1).gather(1, tokens[0, start + 1:, None]).squeeze(1)
        return [None] + [float(v) for v in logp.cpu()]

    def forward_decode(self, rows: List[Sequence_], cache, mask: torch.Tensor):
        """One decode step of every row's last token. Returns (logits [B,V], cache, mask [B,T+1])."""
        ids = torch.tensor([[r.output_ids[-1]] for r in rows], dtype=torch.long)
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
        pos = mask.sum(-1, keepdim=True) - 1
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, logits_to_keep=1,
                         **{CACHE_KWARG: cache})
        experts = self._experts(len(rows), 1)
        if experts is not None:
            for row, e in zip(rows, experts):
                if row.routed is not None:
                    row.routed.append(e[0])
        return out.logits[:, -1].float(), cache_of(out), mask

    # ------------------------------------------------------------------ weights
    def check_named_meta(self, names: Sequence[str], dtypes: Sequence[str],
                         shapes: Sequence[Sequence[int]]) -> Optional[str]:
        """None if every (name, dtype, shape) can be loaded, else a message naming the first bad one."""
        from dapo_mega.wire.transport import parse_dtype

        if not (len(names) == len(dtypes) == len(shapes)):
            return f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length"
        seen = set()
        for name, dtype, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str) or name not in self._param_shapes:
                return f"unknown parameter name {name!r} (not in the model's HF state dict)"
            if name in seen:
                return f"parameter {name!r} appears twice"
            seen.add(name)
            try:
                dt = parse_dtype(dtype)
            except ValueError as exc:
                return f"parameter {name!r}: {exc}"
            if not dt.is_floating_point:
                return f"parameter {name!r}: dtype {dtype} is not a floating-point dtype"
            if not isinstance(shape, (list, tuple)) or tuple(int(s) for s in shape) != self._param_shapes[name]:
                return f"parameter {name!r}: shape {shape} != model shape {list(self._param_shapes[name])}"
        return None

    def load_named_tensors(self, named: Sequence[Tuple[str, torch.Tensor]],
                           weight_version: Optional[str] = None) -> None:
        """Copy tensors into the model by HF name (cast to the model dtype), then set the version.

        `lm_head.weight` of a tied model is skipped, as SGLang's Qwen2/Qwen3/Llama `load_weights`
        does: the tied matrix is loaded through `model.embed_tokens.weight`.
        """
        with self.model_lock:
            if self.weights_released:
                raise RuntimeError("weights are released; call /resume_memory_occupation first")
            with torch.no_grad():
                for name, tensor in named:
                    if self.tied_embeddings and name == "lm_head.weight":
                        continue
                    self.tensor(name).copy_(tensor.to(self.device))
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def get_weight(self, name: str) -> torch.Tensor:
        """A float32 host copy of one parameter, taken under the model lock (a sync or a release
        never shows half of it)."""
        if name not in self.views:
            raise KeyError(f"unknown parameter name {name!r}")
        if self.tied_embeddings and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        with self.model_lock:
            if self.weights_released:
                raise RuntimeError("weights are released; call /resume_memory_occupation first")
            return self.tensor(name).detach().to(device="cpu", dtype=torch.float32, copy=True)

    def tensor(self, name: str) -> torch.Tensor:
        """The live tensor of checkpoint name `name` (a view where transformers fuses it)."""
        view = self.views[name]
        t = self.params[view.param]
        return t if view.index is None else t[view.index]

    def release_weights(self) -> None:
        """Free the parameter storage (SGLang's release of the `weights` tag).

        Without --enable-weights-cpu-backup the contents are lost, as in SGLang: after
        resume the learner must push weights (update_weights_from_tensor) before generating.
        """
        with self.model_lock:
            if self.weights_released:
                return
            self.flat.release(keep_backup=self.enable_weights_cpu_backup)
            self.weights_released = True

    def resume_weights(self) -> None:
        """Allocate the parameters again (their flat layout as before release): the backup's
        contents, else zeros."""
        with self.model_lock:
            if not self.weights_released:
                return
            self.flat.resume()
            # Tied parameters share one tensor object; re-tie after reallocating.
            if self.tied_embeddings:
                self.model.tie_weights()
            self.weights_released = False


class Routing:
    """A mixture of experts' routing as the engine reports it (SGLang 0.5.23's routed-experts
    capturer: int32 [positions, num_hidden_layers, num_experts_per_tok], zeros for the layers
    without experts): the experts transformers' router of each sparse layer picked
    (`Qwen3MoeTopKRouter`'s indices, read by a forward hook, so the forward computes nothing
    else; its `output_router_logits` would also compute the load-balancing loss, which fails on
    a decode step with an attention mask)."""

    def __init__(self, model, num_layers: int, sparse_layers: List[int], top_k: int):
        self.num_layers, self.sparse_layers, self.top_k = num_layers, sparse_layers, top_k
        self.captured: Dict[int, torch.Tensor] = {}
        for layer in sparse_layers:
            model.model.layers[layer].mlp.gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def keep(_module, _inputs, output) -> None:
            self.captured[layer] = output[2].detach()  # (router logits, scores, indices)
        return keep

    @classmethod
    def of(cls, model) -> Optional["Routing"]:
        if getattr(model.config, "model_type", "") != "qwen3_moe":
            return None
        from dapo_mega.models.shape import ModelShape

        shape = ModelShape.from_hf_config(model.config.to_dict())
        return cls(model, shape.num_layers, [i for i in range(shape.num_layers) if shape.is_sparse_layer(i)],
                   shape.num_experts_per_tok)

    def experts(self, batch: int, width: int) -> torch.Tensor:
        """[batch, width, num_layers, top_k] of the last forward (the hooks' capture, then cleared)."""
        out = torch.zeros((batch, width, self.num_layers, self.top_k), dtype=torch.int32)
        for layer in self.sparse_layers:
            out[:, :, layer] = self.captured.pop(layer).to(torch.int32).cpu().view(batch, width, self.top_k)
        return out
