"""`convert_checkpoint.py verify`: does a Megatron checkpoint hold the HF model it came from?

Both models run on the same tokens, one after the other (the Megatron one is freed before the
HF one is loaded), and the verdict has to separate two things a logit difference can be:
rounding, which grows with depth, and a wrong mapping, which is as large as the logits.

* **The tokens are real text** by default: a few worked problems (`PROBE_DIALOGUES`, picked by
  `seed`) in the tokenizer's own chat template, every row cut to one length (no padding),
  several hundred positions in all. Random ids (`random_tokens`) give flat, low-confidence
  logits on which bf16 rounding looks worst; `text` checks a text of the user's.
* **Both sides compute in fp32 where memory allows** (`compute="auto"`, the default): a bf16 or
  fp16 checkpoint's weights upcast exactly, so both models hold the stored bytes and only fp32
  rounding separates them (none at all on the CPU, at 8 to 64 layers, see `FP32_TOLERANCE`),
  while a wrong mapping moves logits by a good part of their size: the verdict is
  max |Δlogit| <= FP32_TOLERANCE · max(1, max |HF logit|). The HF reference then needs 4 bytes
  per parameter of host RAM (`dapo-mega plan` prints it: 131 GB for Qwen2.5-32B, 65 GB in bf16).
* **In the stored dtype** (`compute="stored"`, or `auto` when fp32 does not fit) the two
  implementations round differently and max |Δlogit| grows with depth, so the verdict is on the
  next-token distributions: mean KL(HF ‖ Megatron) <= `LOW_PRECISION_KL_MAX` and top-1
  agreement >= `LOW_PRECISION_TOP1_MIN`. docs/conversion.md has the margins measured by depth.

A failure says where to look when it can tell: a config field that shapes the forward and
differs between the checkpoint's record and the HF config (rope theta, norm epsilon, tied
embeddings, ...), and the first decoder layer whose output departs from the HF model's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

from dapo_mega.backends.megatron.checkpoint import load_model_from_dist_checkpoint, resolve_megatron_source
from dapo_mega.backends.placement import CPU, conversion_world_size
from dapo_mega.weights.convert import (
    ConversionSummary,
    _build,
    _dtype_str,
    _release_freed_memory,
    _stored_dtype,
    read_hf_config_dict,
    run_on_ranks,
)
from dapo_mega.weights.hf_io import dtype_from_name

if TYPE_CHECKING:
    from dapo_mega.models.shape import HfConfigDict

FP32_TOLERANCE = 1e-3
"""Relative logit bound of an fp32 comparison (both sides fp32): max |Δlogit| <= this ·
max(1, max |HF logit|). Measured (docs/conversion.md, 2-core x86 CPU): correct conversions 0
(SmolLM2 at 8, 16 and 30 layers, a random model of 64); the closest wrong conversion, a norm
epsilon 10x too large, 6.1e-3 (6x the bound); the others 9e-3 to 1.1."""

LOW_PRECISION_KL_MAX = 0.05
"""Mean next-token KL(HF ‖ Megatron) in nats allowed when both sides compute in bf16/fp16.
Measured (docs/conversion.md): correct conversions of SmolLM2 0.0012 / 0.0013 / 0.0024 at 8 /
16 / 30 layers; its wrong conversions 0.40-9.8, except a 10x norm epsilon (0.0028: bf16 cannot
see it; fp32 can). A random model's flat distributions give wrong conversions KLs of 0.0025-0.05:
there top-1 agreement is what fails them."""

LOW_PRECISION_TOP1_MIN = 0.9
"""Share of positions whose most likely next token is the same on both sides, in bf16/fp16.
Measured: correct conversions 0.964-1.0 (SmolLM2 at 8 layers the lowest); wrong ones 0.71 and
below, except rope theta and norm epsilon on the random model (0.94-0.98)."""

FORWARD_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
                         "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias",
                         "hidden_act", "max_position_embeddings")
"""HF config fields that shape the forward: a checkpoint recorded with another value than the HF
model's was converted for another model (or by a broken conversion)."""

PROBE_DIALOGUES: Tuple[Tuple[str, str], ...] = (
    ("Tom has 3 apples and buys 4 more. How many apples does he have now?",
     "Tom starts with 3 apples. Buying 4 more gives 3 + 4 = 7.\nAnswer: 7"),
    ("A box holds 6 eggs. How many eggs are in 2 boxes?",
     "Each box holds 6 eggs, so 2 boxes hold 2 * 6 = 12 eggs.\nAnswer: 12"),
    ("What is the sum of the first five positive integers?",
     "1 + 2 + 3 + 4 + 5 = 15, or n(n+1)/2 with n = 5, which is 15.\nAnswer: 15"),
    ("Solve for x: 2x + 6 = 14.",
     "Subtract 6 from both sides: 2x = 8. Divide by 2: x = 4.\nAnswer: 4"),
    ("A train travels 60 km in 1.5 hours. What is its average speed?",
     "Average speed is distance over time: 60 / 1.5 = 40 km per hour.\nAnswer: 40"),
    ("How many ways can 3 different books be arranged on a shelf?",
     "The first place has 3 choices, the second 2, the last 1: 3 * 2 * 1 = 6.\nAnswer: 6"),
    ("What is the remainder when 100 is divided by 7?",
     "7 * 14 = 98, and 100 - 98 = 2, so the remainder is 2.\nAnswer: 2"),
    ("The angles of a triangle are 50 and 60 degrees. What is the third angle?",
     "The angles of a triangle add up to 180 degrees: 180 - 50 - 60 = 70.\nAnswer: 70"),
    ("If a shirt costs $20 and is discounted by 25%, what is the new price?",
     "25% of 20 is 5, so the price drops to 20 - 5 = 15 dollars.\nAnswer: 15"),
    ("What is the greatest common divisor of 48 and 36?",
     "48 = 2^4 * 3 and 36 = 2^2 * 3^2, so the gcd is 2^2 * 3 = 12.\nAnswer: 12"),
    ("Sara had 10 stickers and gave 3 to her friend. How many stickers does she have left?",
     "She gave away 3 of her 10 stickers: 10 - 3 = 7 remain.\nAnswer: 7"),
    ("What is the area of a rectangle 7 cm long and 5 cm wide?",
     "The area of a rectangle is length times width: 7 * 5 = 35 square centimetres.\nAnswer: 35"),
)
"""Worked problems, as the model sees DAPO's (a question, then a solution ending in `Answer:`)."""

PROBE_ROWS = 4
"""Dialogues per verify (rows of the batch): with SmolLM2's template about 4 x 80 positions."""


class VerifyInputError(ValueError):
    """The tokens verify was asked to use cannot be made (a text the tokenizer cannot read, ...)."""


# --------------------------------------------------------------------------- the tokens


def probe_token_ids(hf_path: Path | str, hf_cfg: HfConfigDict, text: Optional[str] = None, seed: int = 0,
                    rows: int = PROBE_ROWS, random_tokens: Optional[Tuple[int, int]] = None) -> Tuple[torch.Tensor, str]:
    """The token ids both models read, [rows, length], and a line saying what they are.

    `random_tokens` = (rows, length): ids drawn from `seed`. `text`: that text through the HF
    tokenizer. Otherwise `rows` of `PROBE_DIALOGUES` picked by `seed`, each rendered by the
    tokenizer's chat template (a plain "question\\nsolution" without one) and cut to the
    shortest row's length, and to the model's context. Without a usable tokenizer (none loads,
    it encodes the probe text to fewer than 2 ids, or its ids pass the model's vocabulary) the
    worked problems fall back to `rows` x FALLBACK_RANDOM_LENGTH random ids, and the line says
    why; `text` then stops with VerifyInputError naming the fix."""
    context = int(hf_cfg.get("max_position_embeddings") or 4096)
    if random_tokens is not None:
        return _random_ids(hf_cfg, seed, random_tokens, context)
    tokenizer, problem = _load_tokenizer(hf_path)
    if text is not None:
        if tokenizer is None:
            raise VerifyInputError(f"{hf_path}: {problem}, so --text cannot be read. Fix: add the tokenizer's files "
                                   "to the HF directory, or pass --random-tokens ROWS LENGTH instead of --text")
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :context]
        if ids.shape[1] < 2:
            raise VerifyInputError(f"--text gives {ids.shape[1]} token(s); give a longer text (0 from any text: "
                                   f"{hf_path} has no tokenizer vocabulary; add its tokenizer files or pass "
                                   "--random-tokens ROWS LENGTH)")
        too_large = _ids_beyond_vocab(ids.flatten().tolist(), hf_cfg)
        if too_large:
            raise VerifyInputError(f"{hf_path}: --text {too_large}. Fix: the tokenizer of this model, or "
                                   "--random-tokens ROWS LENGTH")
        return ids, f"tokens: 1 x {ids.shape[1]} of the given text"
    if tokenizer is not None:
        ids, line, problem = _worked_problem_ids(tokenizer, hf_cfg, seed, rows, context)
        if ids is not None:
            return ids, line
    ids, line = _random_ids(hf_cfg, seed, (rows, FALLBACK_RANDOM_LENGTH), context)
    return ids, (f"{line}: {hf_path} has no usable tokenizer ({problem}); add its tokenizer files to compare "
                 "on real text")


def _worked_problem_ids(tokenizer, hf_cfg: HfConfigDict, seed: int, rows: int,
                        context: int) -> Tuple[Optional[torch.Tensor], str, str]:
    """(ids, the line saying what they are, "") of `rows` worked problems, or (None, "", why
    this tokenizer cannot give them)."""
    order = torch.randperm(len(PROBE_DIALOGUES), generator=torch.Generator().manual_seed(seed)).tolist()
    picked = [PROBE_DIALOGUES[i] for i in order[:rows]]
    try:
        encoded = [_render(tokenizer, question, answer) for question, answer in picked]
    except Exception as exc:  # noqa: BLE001 - a template or vocabulary that cannot render the probe
        return None, "", f"the tokenizer cannot render the probe text: {str(exc)[:200]}"
    length = min(min(len(e) for e in encoded), context)
    if length < 2:
        return None, "", f"the tokenizer encodes the probe text to {length} token(s)"
    problem = _ids_beyond_vocab([i for e in encoded for i in e[:length]], hf_cfg)
    if problem:
        return None, "", f"the tokenizer {problem}"
    templated = "chat template" if getattr(tokenizer, "chat_template", None) else "plain text (no chat template)"
    return torch.tensor([e[:length] for e in encoded], dtype=torch.long), \
        f"tokens: {len(encoded)} x {length} of worked problems in the {templated} (seed {seed})", ""


FALLBACK_RANDOM_LENGTH = 64
"""Positions per row of the random ids verify falls back to when the HF directory has no
usable tokenizer (4 x 64: as many positions as the worked problems give)."""


def _random_ids(hf_cfg: HfConfigDict, seed: int, shape: Tuple[int, int], context: int) -> Tuple[torch.Tensor, str]:
    g = torch.Generator().manual_seed(seed)
    b, s = shape
    return torch.randint(0, hf_cfg["vocab_size"], (b, min(s, context)), generator=g), \
        f"tokens: {b} x {min(s, context)} random ids (seed {seed})"


def _load_tokenizer(hf_path: Path | str):
    """(the HF directory's tokenizer, None) or (None, why there is none). transformers builds a
    tokenizer with an empty vocabulary for a directory holding only a model's config, so a
    tokenizer that loads is not yet one that reads text: `probe_token_ids` checks its ids."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(hf_path)), ""
    except Exception as exc:  # noqa: BLE001 - any failure to build one means: no tokenizer to read text with
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"the tokenizer does not load: {first[:200]}"


def _ids_beyond_vocab(ids: Sequence[int], hf_cfg: HfConfigDict) -> str:
    """Why these ids cannot index the model's embedding ("" when they can)."""
    vocab = int(hf_cfg["vocab_size"])
    largest = max(ids, default=-1)
    return (f"gives token id {largest}, beyond the model's vocab_size {vocab} (a tokenizer of another model?)"
            if largest >= vocab else "")


def _render(tokenizer, question: str, answer: str) -> List[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}], tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(f"{question}\n{answer}")["input_ids"]


# --------------------------------------------------------------------------- the comparison


@dataclass
class LogitAgreement:
    """How close two models' logits over the same positions are (reference first)."""

    positions: int
    max_abs_diff: float
    mean_abs_diff: float
    ref_abs_max: float
    """max |reference logit|: the scale the fp32 bound is relative to."""
    mean_kl: float
    """Mean over positions of KL(p_ref ‖ p_other) of the next-token distributions, in nats."""
    max_kl: float
    top1_agreement: float
    """Share of positions where both sides' most likely next token is the same."""

    @classmethod
    def of(cls, ref: torch.Tensor, other: torch.Tensor) -> "LogitAgreement":
        """`ref`, `other`: [..., vocab] logits of the same positions."""
        ref, other = ref.float().reshape(-1, ref.shape[-1]), other.float().reshape(-1, other.shape[-1])
        diff = (ref - other).abs()
        log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
        return cls(positions=ref.shape[0], max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
                   ref_abs_max=ref.abs().max().item(), mean_kl=kl.mean().item(), max_kl=kl.max().item(),
                   top1_agreement=(ref.argmax(-1) == other.argmax(-1)).float().mean().item())

    def line(self) -> str:
        return (f"logits max |diff| = {self.max_abs_diff:.3e}  mean |diff| = {self.mean_abs_diff:.3e}  "
                f"(max |HF logit| {self.ref_abs_max:.2f})  next-token KL mean {self.mean_kl:.2e} max "
                f"{self.max_kl:.2e}  top-1 agreement {self.top1_agreement:.3f} over {self.positions} positions")


@dataclass
class Verdict:
    passed: bool
    criterion: str
    """The rule applied, with its numbers: printed with PASS or FAIL."""


def judge(agreement: LogitAgreement, compute_dtype: torch.dtype, tolerance: Optional[float] = None) -> Verdict:
    """fp32 compute: max |Δ| <= tolerance · max(1, max |ref|) (tolerance default FP32_TOLERANCE).
    bf16 / fp16 compute: mean KL <= LOW_PRECISION_KL_MAX and top-1 agreement >=
    LOW_PRECISION_TOP1_MIN (`tolerance`, when given, replaces the KL bound)."""
    if compute_dtype == torch.float32:
        tol = FP32_TOLERANCE if tolerance is None else tolerance
        bound = tol * max(1.0, agreement.ref_abs_max)
        return Verdict(agreement.max_abs_diff <= bound,
                       f"fp32: max |diff| {agreement.max_abs_diff:.3e} <= {tol:.0e} x max(1, max |HF logit|) = "
                       f"{bound:.3e}")
    kl_max = LOW_PRECISION_KL_MAX if tolerance is None else tolerance
    ok = agreement.mean_kl <= kl_max and agreement.top1_agreement >= LOW_PRECISION_TOP1_MIN
    return Verdict(ok, f"{_dtype_str(compute_dtype)}: mean KL {agreement.mean_kl:.2e} <= {kl_max:.0e} and top-1 "
                       f"agreement {agreement.top1_agreement:.3f} >= {LOW_PRECISION_TOP1_MIN}")


def first_divergent_layer(ref_layers: Sequence[torch.Tensor], other_layers: Sequence[torch.Tensor],
                          rel_tol: float) -> Optional[Tuple[int, float]]:
    """(index, relative difference) of the first hidden state whose max |Δ| exceeds
    `rel_tol` · max |ref|; index 0 is the embedding's output, i the output of decoder layer i-1."""
    for i, (a, b) in enumerate(zip(ref_layers, other_layers)):
        rel = (a.float() - b.float()).abs().max().item() / max(a.float().abs().max().item(), 1e-12)
        if rel > rel_tol:
            return i, rel
    return None


def layer_hint(ref_layers: Sequence[torch.Tensor], other_layers: Sequence[torch.Tensor],
               compute_dtype: torch.dtype) -> str:
    """Where a failed comparison departs first, in the HF model's names."""
    rel_tol = 1e-3 if compute_dtype == torch.float32 else 0.25
    hit = first_divergent_layer(ref_layers, other_layers, rel_tol)
    if hit is None:
        return ("every layer's output agrees with the HF model's: look at the final norm and the output layer "
                "(model.norm.weight, lm_head.weight or the tied embedding)")
    index, rel = hit
    if index == 0:
        return f"the embedding's output differs already (relative {rel:.2e}): look at model.embed_tokens.weight"
    return (f"the first layer whose output differs is {index - 1} (relative {rel:.2e}, layers before it agree): "
            f"look at model.layers.{index - 1}.*")


def forward_config_differences(hf_cfg: HfConfigDict, recorded: Optional[HfConfigDict]) -> List[str]:
    """Fields of FORWARD_CONFIG_FIELDS whose value the checkpoint recorded differently."""
    if not recorded:
        return []
    return [f"{name}: the checkpoint was converted with {recorded.get(name)!r}, the HF model has {hf_cfg.get(name)!r}"
            for name in FORWARD_CONFIG_FIELDS if recorded.get(name) != hf_cfg.get(name)]


# --------------------------------------------------------------------------- memory


def available_host_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo, within a cgroup v2 memory limit where one is set."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def fp32_reference_bytes(hf_path: Path | str, stored: torch.dtype) -> int:
    """Host RAM of the HF reference in fp32: its safetensors bytes scaled from the stored dtype."""
    stored_bytes = torch.tensor([], dtype=stored).element_size()
    return sum(p.stat().st_size for p in Path(hf_path).glob("*.safetensors")) * 4 // stored_bytes


def choose_compute_dtype(compute: str, stored: torch.dtype, fp32_bytes: int,
                         available: Optional[int]) -> Tuple[torch.dtype, Optional[str]]:
    """(dtype both forwards run in, a note when `auto` could not take fp32). `compute`: auto
    (fp32 when 1.2x its bytes + 1 GB fit `available`), stored, or a dtype name."""
    if compute == "stored":
        return stored, None
    if compute != "auto":
        return dtype_from_name(compute), None
    if stored == torch.float32:
        return stored, None
    need = int(1.2 * fp32_bytes) + 2**30
    if available is not None and need > available:
        return stored, (f"fp32 needs ~{need / 1e9:.1f} GB of host RAM, {available / 1e9:.1f} GB are available: "
                        f"compared in {_dtype_str(stored)} on the next-token distributions")
    return torch.float32, None


# --------------------------------------------------------------------------- verify


@dataclass
class VerifySummary(ConversionSummary):
    """`verify`'s report: the conversion summary plus what decided it."""

    agreement: Optional[LogitAgreement] = None
    """The worst draw's figures (the largest mean KL)."""
    logits_passed: Optional[bool] = None
    """The logit criterion alone (every draw), before the config comparison."""
    config_differences: List[str] = field(default_factory=list)
    hint: Optional[str] = None
    """Where a failure departs first (`layer_hint`)."""


def verify_conversion(hf_path: Path | str, megatron_path: Path | str, tp: int = 1, tolerance: Optional[float] = None,
                      compute: str = "auto", text: Optional[str] = None, seeds: Sequence[int] = (0,),
                      random_tokens: Optional[Tuple[int, int]] = None, device: str = CPU,
                      ep: int = 1) -> VerifySummary:
    """Compare the HF model with the Megatron checkpoint (see the module docstring).

    `compute`: auto (fp32 where memory allows, else the stored dtype), stored, or fp32 / bf16 /
    fp16. `seeds`: one draw of probe tokens each (`probe_token_ids`), all through the same two
    loaded models; every draw must pass. The Megatron model is built from the config the
    checkpoint recorded (as training builds it), the HF one from `hf_path`. `tp`: the Megatron
    forward's tensor parallelism (spawned ranks on `device`), `ep` its expert parallelism (a
    mixture of experts: every rank runs the probes, the experts' tokens cross the EP group); the
    HF reference runs on the CPU of rank 0.
    """
    start = time.time()
    hf_cfg = read_hf_config_dict(hf_path)
    src = resolve_megatron_source(megatron_path)
    recorded = src["meta"].get("hf_config")
    stored = _stored_dtype(src["meta"]) or torch.float32
    run_dtype, memory_note = choose_compute_dtype(compute, stored, fp32_reference_bytes(hf_path, stored),
                                                  available_host_bytes())
    probes = [probe_token_ids(hf_path, hf_cfg, text=text, seed=seed, random_tokens=random_tokens)
              for seed in (seeds if text is None else seeds[:1])]
    results = run_on_ranks(_verify_worker, conversion_world_size(tp, 1, ep),
                           (str(hf_path), str(src["ckpt_dir"]), recorded or hf_cfg, tp,
                            [ids for ids, _ in probes], run_dtype, device, ep), device)
    draws = results[0]
    verdicts = [judge(agreement, run_dtype, tolerance) for agreement, _, _ in draws]
    worst = max(range(len(draws)), key=lambda i: (not verdicts[i].passed, draws[i][0].mean_kl))
    agreement, ref_layers, meg_layers = draws[worst]
    differences = forward_config_differences(hf_cfg, recorded)
    logits_passed = all(v.passed for v in verdicts)
    notes = [probes[worst][1] + (f"; the worst of {len(draws)} draws" if len(draws) > 1 else ""),
             f"stored in {_dtype_str(stored)}, compared in {_dtype_str(run_dtype)}", agreement.line(),
             f"criterion: {verdicts[worst].criterion} ({'holds' if verdicts[worst].passed else 'fails'})"]
    notes += [memory_note] if memory_note else []
    notes += [f"config differs: {d}" for d in differences]
    passed = logits_passed and not differences
    hint = None if passed else layer_hint(ref_layers, meg_layers, run_dtype)
    notes += [hint] if hint else []
    return VerifySummary(action="verify", source=str(hf_path), destination=str(megatron_path), tp=tp, pp=1, ep=ep,
                         dtype=_dtype_str(run_dtype), max_abs_diff=agreement.max_abs_diff,
                         mean_abs_diff=agreement.mean_abs_diff, passed=passed, notes=notes,
                         seconds=time.time() - start, agreement=agreement, logits_passed=logits_passed,
                         config_differences=differences, hint=hint)


@torch.no_grad()
def megatron_logits(chunks, info, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [b, s, vocab_size] of a one-stage Megatron model (TP gathered), on
    the model's device: the ids, positions and mask are moved to it (CPU ids into a model on a
    GPU would fail in the embedding)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(chunks[0].parameters()).device
    b, s = input_ids.shape
    input_ids = input_ids.to(device)
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    causal_mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]  # True = masked
    logits = chunks[0](input_ids, position_ids, causal_mask)
    logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., : info.shape.vocab_size].float()


def _record_outputs(modules: Sequence[torch.nn.Module], seq_first: bool) -> Tuple[List[torch.Tensor], list]:
    """Forward hooks keeping each module's output hidden states as [b, s, h] on the CPU."""
    kept: List[torch.Tensor] = []

    def hook(_module, _inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        kept.append((hidden.transpose(0, 1) if seq_first else hidden).detach().float().cpu())
    return kept, [m.register_forward_hook(hook) for m in modules]


def _verify_worker(rank: int, world_size: int, hf_path: str, ckpt_dir: str, meg_cfg: HfConfigDict, tp: int,
                   probes: List[torch.Tensor], dtype: torch.dtype, device: str, ep: int = 1):
    """Rank 0 returns, per probe, (LogitAgreement, HF hidden states, Megatron hidden states);
    other ranks None. Each model is loaded once and reads every probe."""
    if dtype == torch.float32:  # TF32 matmuls would round to 10 bits of mantissa: no fp32 comparison
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    _, chunks, info = _build(meg_cfg, tp, 1, world_size, dtype, rank, device, ep)
    load_model_from_dist_checkpoint(chunks, ckpt_dir)
    model = chunks[0]
    meg = []
    for ids in probes:
        layers, handles = _record_outputs([model.embedding, *model.decoder.layers], seq_first=True)
        meg.append((megatron_logits(chunks, info, ids).cpu(), layers))  # compared on the CPU
        for h in handles:
            h.remove()
    del chunks, model  # one model at a time: the HF one is loaded once this one is gone
    _release_freed_memory()
    if rank != 0:
        return None
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype).eval()
    out = []
    for ids, (meg_logits, meg_layers) in zip(probes, meg):
        ref_layers, handles = _record_outputs([hf_model.model.embed_tokens, *hf_model.model.layers], seq_first=False)
        with torch.no_grad():
            ref = hf_model(ids).logits.float()
        for h in handles:
            h.remove()
        out.append((LogitAgreement.of(ref, meg_logits), ref_layers, meg_layers))
    return out
