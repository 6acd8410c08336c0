"""One GPU node (H100/H200 class): the GPU path's checks, then the 7B-shape measurements.

ONE CALL, on a node with one GPU (Python 3.12, torch 2.11 / CUDA 13, transformers, triton;
Transformer Engine and SGLang optional). From the repository root, with the megatron-core
wheel for that Python beside it (none is in this repository: fetch it where the network is
reachable, `pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.16.1`,
and carry it to the node):

    pip install --no-deps megatron_core-0.16.1-cp312-*.whl && pip install -e . --no-deps \
        && python bench/gpu_node.py --sglang-python /path/to/sglang-venv/bin/python

SGLang runs from its own venv, as `docs/cluster.md` installs it (its torch pins would replace
the learner's): `--sglang-python` (default $DAPO_MEGA_SGLANG_PYTHON) is that venv's
interpreter. The SGLang parts use it, as a run does through `rollout.engine_python`: the
server is started with it, check d's receiver unpickles the learner's payload in it (two
torch releases on each side of the hand-over, as in a colocated run), and check e's run is
given it, so its preflight also reads the NCCL each side loads (`plan.check_nccl_agreement`).
Without it, sglang in this Python is used where it imports; else the SGLang halves are
skipped, saying so. Transformer Engine is the learner's, in this Python.

It assumes: the repository's runtime dependencies already in that Python (hydra-core,
omegaconf, safetensors, aiohttp, ... as pyproject lists them; `--no-deps` keeps the node's
torch), `dapo-mega` on the PATH or `python -m dapo_mega.cli` working, nothing else using the
GPU, /tmp writable (~2 GB), no network. Takes under 10 minutes (`--budget-s`, default 570).
NOT RUNNABLE ON THE CPU: it exits 2 saying so. Its pure pieces (the part list, the verdicts,
the table, the budget, FLOPs and MFU) are tested on the CPU in tests/bench/test_gpu_node.py
and tests/test_bench_formulas.py.

The checks (issue 28 item 6), each in its own subprocess with a timeout, so that one failure
does not stop the others:

a. convert_gpu: `tools/convert_checkpoint.py import --device cuda --dtype bf16` of the tiny
   HF model (dapo_mega/models/tiny.py, built from its config) and `verify --device cuda`,
   which must pass.
b. convert_tp2: the device rule of conversion on one GPU (backends/placement.py
   `conversion_cuda_index`): `import --tp 2` (the CPU default) works on a GPU node, and
   `import --tp 2 --device cuda` is refused in one line (`error: ... Fix: ...`, exit 2)
   when the node has fewer than 2 GPUs (with 2 or more it must work).
c. eval_two_engines: the device rule of `dapo-mega eval` (`node_engine_gpus`): one TP-1
   engine gets GPU 0; two need 2 GPUs, so on one GPU both the rule and the fleet's
   `start_on_this_node("dapo-mega eval", 2)` refuse in one line before any engine starts.
d. handover_sglang: the colocated CUDA-IPC hand-over (`transport.serialize_cuda_ipc`, what
   `weights/handover.py` posts) unpickled in a second process on the same GPU through
   SGLang 0.5.23's own path when sglang imports (`normalize_serialized_named_tensor_payloads`
   as its tokenizer manager does, then `monkey_patch_torch_reductions` and
   `MultiprocessingSerializer.deserialize`, SGLang's SafeUnpickler, as
   `TpModelWorker.deserialize_own_rank` does for update_weights_from_tensor); without
   sglang, through the project's own patch (and the row says the SGLang half was skipped).
   Bytes must arrive unchanged on cuda:0.
e. train_tiny_bf16: `dapo-mega train` of the tiny model, bf16 learner on the GPU
   (megatron=gpu_bf16), 2 rollout steps, the step-1 checks on (checks.*:
   driver/weight_probe.py); the run must exit 0 and its metrics.jsonl rows carry
   `mismatch/age_0/logp_abs_mean` and `probe/logp_abs_mean` under the limits (bf16: 0.5
   nats, weight_probe.BF16_MAX_ABS_MEAN) with no probe errors. Engine: SGLang colocated
   when sglang imports, else the embedded engine (`--train-engine`), which runs on the CPU
   beside the GPU learner and gets its weights as shared-memory files
   (`placement.engine_uses_gpu`). `bench/gpu_train.py`.
f. nccl_loaded: the NCCL preflight's reading (`plan/nccl_probe.py`: the libnccl torch maps,
   by its `ncclGetVersion`) against the release NCCL prints when a communicator starts, in
   this Python and the SGLang venv's, with `torch.cuda.nccl.version()` beside it
   (`bench/gpu_nccl.py`, issue #46).
g. train_moe_bf16: check e's run (embedded engine) on the tiny Qwen3-MoE, every layer sparse,
   with routing replay and the experts in the ledger: every step's moe/* metrics (no sample
   without its experts, router agreement >= 0.9) and every ledger row's experts decoding to
   the sample's positions (`bench/gpu_moe.py`, issue #46: where the experts' gloo hand-over
   first runs beside the learner's NCCL group; world size 1 on one GPU).

Then, while the budget lasts (each skipped, saying so, when its timeout no longer fits):
the measurements at Qwen2.5-7B's shape (random weights, `--layers` of 28):

1. learner_bf16: megatron-core GPTModel through `MegatronLearner._update` (forward,
   backward, Megatron optimizer), world size 1 on NCCL, `--samples` variable-length samples
   up to `--seq-len` tokens; TE layer spec when TE imports, else the local spec.
2. learner_fp8 (TE only; tensorwise recipe): the same batch.
   MFU = model FLOPs / (seconds x peak); model FLOPs per step = 6·N·tokens + attention,
   N = non-embedding parameters + LM head (Eq. 1 of `train_flops`); peak = 989 TFLOP/s
   dense bf16 and 1979 FP8 (H100/H200 SXM). FP8 MFU is reported against both peaks.
3. handover: the hand-over of check d at the 7B shape's layer weights: GB/s of the copy-out.
4. sglang (when sglang imports): a server on an HF directory of the shape, the weight sync of
   `bench/gpu_sglang_sync.py` (needs a second GPU: a NCCL group of two processes on GPU 0
   is refused, "Duplicate GPU detected") and rollout tokens/s.

Output: ONE table (part, pass / fail / skipped, seconds, the reason of each failure or
skip), the JSON of every part at `--out`, exit 0 when no part failed, else 1.

    python bench/gpu_node.py --checks-only             the seven checks
    python bench/gpu_node.py --layers 28 --budget-s 900  the full depth, more time
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:  # the repository's package, installed or not
    sys.path.insert(0, str(REPO))

from gpu_moe import check_train_moe  # noqa: E402
from gpu_nccl import check_nccl_loaded  # noqa: E402
from gpu_train import check_train_tiny  # noqa: E402

from dapo_mega.models.shape import ModelShape  # noqa: E402
from dapo_mega.plan.memory import KNOWN_MODELS  # noqa: E402

PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}
"""Dense peak TFLOP/s of H100/H200 SXM (no sparsity)."""


QWEN25_7B: ModelShape = KNOWN_MODELS["qwen2.5-7b"]
"""Qwen2.5-7B's shape (the project's one model-shape record, from plan's table)."""


# ============================================================================ pure helpers
def count_parameters(shape: ModelShape, include_embeddings: bool = True) -> int:
    """Parameters of a Qwen2 decoder (QKV bias, SwiGLU, RMSNorm, untied head by default).

    Per layer: Q (h·h + h), K and V (h·d_kv + d_kv each, d_kv = kv_heads·h/heads), O (h·h),
    MLP 3·h·ffn, two RMSNorms 2·h; plus the final norm h. With embeddings: the input
    embedding V·h and, untied, the LM head V·h.
    """
    h = shape.hidden_size
    kv_dim = shape.num_key_value_heads * (h // shape.num_attention_heads)
    per_layer = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h + 3 * h * shape.ffn_hidden_size + 2 * h
    total = shape.num_layers * per_layer + h
    if include_embeddings:
        total += shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return total


def train_flops(shape: ModelShape, sequence_lengths: Sequence[int]) -> float:
    """Model FLOPs of one training pass (forward + backward) over packed causal sequences.

        F = 6 · N · T  +  3 · 4 · L · h · Σ_s s²/2                                   (1)

    N = non-embedding parameters + LM head (the input embedding is a lookup), T = Σ s
    tokens. Attention: QKᵀ and AV are h·s²/2 multiply-adds each per layer under the causal
    mask (2 FLOPs per MAC), the backward pass twice the forward.
    """
    n = count_parameters(shape, include_embeddings=False) + shape.vocab_size * shape.hidden_size
    tokens = sum(sequence_lengths)
    attention = 3 * 4 * shape.num_layers * shape.hidden_size * sum(s * s / 2 for s in sequence_lengths)
    return 6.0 * n * tokens + attention


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    return flops / seconds / (peak_tflops * 1e12)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="transformer layers of the 7B shape (28 = full)")
    ap.add_argument("--seq-len", type=int, default=4096, help="longest sample (prompt + response) in tokens")
    ap.add_argument("--samples", type=int, default=32, help="samples per optimizer step")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="token budget of one micro-batch")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--rollout-prompts", type=int, default=64)
    ap.add_argument("--rollout-n", type=int, default=8)
    ap.add_argument("--rollout-tokens", type=int, default=1024)
    ap.add_argument("--skip-sglang", action="store_true", help="no SGLang server measurement")
    ap.add_argument("--sglang-python", default=os.environ.get("DAPO_MEGA_SGLANG_PYTHON", ""),
                    help="the SGLang venv's interpreter (default $DAPO_MEGA_SGLANG_PYTHON; empty: this Python "
                         "where sglang imports in it)")
    ap.add_argument("--checks-only", action="store_true", help="the seven checks, no measurement")
    ap.add_argument("--budget-s", type=float, default=570,
                    help="wall-clock budget of the whole run: measurements whose timeout no longer fits are skipped")
    ap.add_argument("--train-engine", default="auto", choices=["auto", "sglang", "embedded"],
                    help="engine of check e (auto: sglang when it imports, else the embedded engine)")
    ap.add_argument("--train-timeout-s", type=float, default=330, help=argparse.SUPPRESS)  # set per part
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "gpu_node.json"))
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)  # internal: one part per subprocess
    return ap.parse_args(argv)


# ============================================================================ the part list, verdicts, table
@dataclass(frozen=True)
class Part:
    """One part of the run: a check (pass / fail) or a measurement (figures)."""

    name: str
    kind: str
    """check or measure."""
    timeout_s: int
    """Bound of its subprocess (a check gets less when the budget has less left)."""
    what: str


PARTS: Tuple[Part, ...] = (
    Part("convert_gpu", "check", 200, "a) convert_checkpoint import + verify --device cuda, tiny model, bf16"),
    Part("convert_tp2", "check", 200, "b) import --tp 2: CPU default works, --device cuda on 1 GPU refused"),
    Part("eval_two_engines", "check", 60, "c) eval device rule: 1 engine on GPU 0, 2 TP-1 engines need 2 GPUs"),
    Part("handover_sglang", "check", 120, "d) colocated CUDA-IPC hand-over through SGLang's unpickling"),
    Part("train_tiny_bf16", "check", 360, "e) dapo-mega train, tiny model, bf16 GPU, 2 steps, step-1 checks"),
    Part("nccl_loaded", "check", 200, "f) ncclGetVersion of the libnccl torch maps = NCCL's at a communicator"),
    Part("train_moe_bf16", "check", 300, "g) dapo-mega train, tiny Qwen3-MoE, bf16 GPU, replay, experts in the ledger"),
    Part("learner_bf16", "measure", 150, "7B-shape learner step, bf16, MFU"),  # 59 s on an H200 (8 layers)
    Part("learner_fp8", "measure", 240, "7B-shape learner step, FP8 (Transformer Engine), MFU"),
    Part("handover", "measure", 180, "7B-shape layers through the CUDA-IPC hand-over, GB/s"),
    Part("sglang", "measure", 420, "SGLang server: weight sync GB/s (2 GPUs) and rollout tokens/s"),
)
"""Checks first (the issue's item 6), then the measurements while the budget lasts."""

MIN_CHECK_S = 30
"""A check is not started with less budget than this left (it would only time out)."""


def part_timeout(part: Part, remaining_s: float) -> Tuple[Optional[float], str]:
    """(the timeout to run `part` with, "") or (None, why it is skipped), given the budget left.

    A check runs with min(its timeout, what is left) while at least MIN_CHECK_S is left; a
    measurement only when its whole timeout fits (a cut-off measurement measures nothing)."""
    if part.kind == "check":
        if remaining_s < MIN_CHECK_S:
            return None, f"time budget: {remaining_s:.0f} s left (< {MIN_CHECK_S} s); raise --budget-s"
        return min(float(part.timeout_s), remaining_s), ""
    if remaining_s < part.timeout_s:
        return None, (f"time budget: {remaining_s:.0f} s left, the part may take {part.timeout_s} s; "
                      "raise --budget-s")
    return float(part.timeout_s), ""


PASS, FAIL, SKIPPED = "pass", "fail", "skipped"


def verdict(result: Dict[str, Any]) -> Tuple[str, str]:
    """(pass | fail | skipped, reason) of one part's result.

    `skipped` (a reason) -> skipped; `error` (the part raised, timed out or exited non-zero)
    -> fail; a check's `passed` False -> fail with its `reason` (and the telling line of its
    `log_tail`, a command's output); else pass, with its `note` (e.g. the SGLang half of a
    check skipped). A check without `passed` fails: it decided nothing."""
    if "skipped" in result:
        return SKIPPED, str(result["skipped"])
    if "error" in result:
        return FAIL, first_line(str(result["error"]))
    if result.get("passed") is False:
        reason = str(result.get("reason") or "failed (no reason given)")
        return FAIL, reason + (f": {first_line(result['log_tail'])}" if result.get("log_tail") else "")
    if result.get("kind") == "check" and result.get("passed") is not True:
        return FAIL, "the check returned no verdict"
    return PASS, str(result.get("note", ""))


def first_line(text: str, limit: int = 300) -> str:
    """The most telling line of an error text: the last `...Error: ...` line, else the last
    non-empty line, cut to `limit` characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln.split(":", 1)[0] or ln.startswith("error:")]
    line = (errors or lines or [""])[-1]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def format_table(rows: Sequence[Tuple[str, str, Optional[float], str]]) -> str:
    """The one table: part, verdict, seconds, reason (each row's reason on its line)."""
    header = ("part", "verdict", "seconds", "reason")
    cells = [(name, status.upper(), "-" if seconds is None else f"{seconds:.0f}", reason)
             for name, status, seconds, reason in rows]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(3)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]  # noqa: E731
    rule = "-" * (sum(widths) + 6 + max(len("reason"), *(len(r[3]) for r in cells)))
    return "\n".join([line(header), rule, *(line(r) for r in cells)])


def exit_code(rows: Sequence[Tuple[str, str, Optional[float], str]]) -> int:
    """0 when no part failed (skipped parts say why in the table), else 1."""
    return 1 if any(status == FAIL for _, status, _, _ in rows) else 0


def judge_refusal(returncode: int, stderr: str, must_say: Sequence[str]) -> Tuple[bool, str]:
    """A command refused by the device rule: exit 2, no traceback, exactly one `error:` line
    naming the fix and holding every string of `must_say`."""
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    if returncode != 2:
        return False, f"exit {returncode}, not 2 (the refusal): {first_line(stderr)}"
    if "Traceback" in stderr:
        return False, f"a traceback instead of a one-line refusal: {first_line(stderr)}"
    if len(errors) != 1:
        return False, f"{len(errors)} 'error:' lines, not one: {stderr[-500:]!r}"
    missing = [s for s in (*must_say, "Fix:") if s not in errors[0]]
    if missing:
        return False, f"the refusal does not say {missing}: {errors[0]}"
    return True, errors[0]


def sample_lengths(num: int, max_len: int, seed: int = 0) -> List[tuple]:
    """(prompt, response) lengths like DAPO math rollouts: prompts 1/8..1/4, responses
    1/4..3/4 of max_len (deterministic)."""
    import random

    rng = random.Random(seed)
    return [(rng.randint(max_len // 8, max_len // 4), rng.randint(max_len // 4, 3 * max_len // 4))
            for _ in range(num)]


def _model_config(shape: ModelShape, max_len: int):
    from dapo_mega.config import ModelConfig

    return ModelConfig(name="qwen2.5-7b-shape", tiny_hidden_size=shape.hidden_size, tiny_num_layers=shape.num_layers,
                       tiny_num_attention_heads=shape.num_attention_heads,
                       tiny_num_key_value_heads=shape.num_key_value_heads,
                       tiny_intermediate_size=shape.ffn_hidden_size,
                       tiny_tie_word_embeddings=shape.tie_word_embeddings,
                       tiny_max_position_embeddings=max(max_len, 4096))


# ============================================================================ parts (GPU)
def time_learner_updates(cfg, hf_config, samples, repeats: int, impl: str, fp8: bool) -> Dict[str, Any]:
    """`repeats` timed optimizer updates of `samples` (after one warm-up) through
    `MegatronLearner._update`, world size 1 (rank 0 on its device by the device rule, CPU
    without a GPU); "seconds" is their total. The same update as bench_learner's Megatron side."""
    from functools import partial

    import torch

    sys.path.insert(0, str(BENCH_DIR))
    from bench_learner import _layout_stats, _loss_denominators, _rank_device, _sync
    from timing import time_alternating

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.distributed import free_port

    cfg.megatron.transformer_impl = impl
    cfg.megatron.fp8.enabled = fp8
    if fp8:
        cfg.megatron.fp8.recipe = "tensorwise"
    layout = ParallelLayout.from_config(cfg.megatron, 1, hf_config).initialize(
        init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, cuda_device=_rank_device(0, 1))
    try:
        learner = MegatronLearner(cfg, hf_config, layout)
        micro = learner._micro_batches(samples, list(range(len(samples))))
        learner._write_old_log_probs(micro)
        loss_func = partial(learner._policy_loss_func, *_loss_denominators(samples))

        def update():
            return learner._update(micro, loss_func, lr=None)

        update()  # warm-up: allocations, kernels
        seconds = time_alternating({"update": update}, repeats, sync=_sync)["update"]
        info = {"layer_spec": learner.info.layer_spec, "params_dtype": learner.info.params_dtype,
                "fp8": learner.info.fp8, **_layout_stats(micro)}
    finally:
        torch.distributed.destroy_process_group()
        layout.destroy()
    return {"seconds": sum(seconds), "update_seconds": seconds, **info}


def part_learner(args, precision: str) -> Dict[str, Any]:
    """One learner variant (bf16 or fp8), world size 1 on NCCL, through bench_learner's timing."""
    import random

    import torch

    from dapo_mega.algo.train_sample import TrainSample
    from dapo_mega.backends.megatron.model import transformer_engine_import_error
    from dapo_mega.config import DapoConfig
    from dapo_mega.models.tiny import tiny_hf_config

    te_error = transformer_engine_import_error()
    te = te_error is None
    if precision == "fp8" and not te:
        return {"skipped": f"Transformer Engine does not import ({te_error}): no FP8 run"}
    shape = replace(QWEN25_7B, num_layers=args.layers)
    cfg = DapoConfig()
    cfg.model = _model_config(shape, args.seq_len)
    cfg.megatron.params_dtype = "bf16"
    cfg.megatron.micro_batch_tokens = max(args.micro_batch_tokens, args.seq_len)
    cfg.algo.lr, cfg.algo.lr_warmup_steps = 1e-6, 0
    hf_config = tiny_hf_config(cfg.model, vocab_size=shape.vocab_size)
    rng = random.Random(0)
    lengths = sample_lengths(args.samples, args.seq_len)
    samples = [TrainSample(prompt_ids=[rng.randrange(3, shape.vocab_size) for _ in range(p)],
                           response_ids=[rng.randrange(3, shape.vocab_size) for _ in range(r)],
                           advantage=1.0 if i % 2 else -1.0) for i, (p, r) in enumerate(lengths)]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    t0 = time.perf_counter()
    out = time_learner_updates(cfg, hf_config, samples, args.repeats, impl="transformer_engine" if te else "local",
                               fp8=precision == "fp8")
    flops = args.repeats * train_flops(shape, [p + r for p, r in lengths])
    timed = out.pop("seconds")  # the `repeats` timed steps only
    out.update(precision=precision, layers=args.layers, parameters=count_parameters(shape),
               tokens_per_step=sum(p + r for p, r in lengths), timed_seconds=timed,
               step_seconds=timed / args.repeats, model_tflops_per_step=flops / args.repeats / 1e12,
               mfu_vs_bf16_peak=mfu(flops, timed, PEAK_TFLOPS["bf16"]),
               seconds=time.perf_counter() - t0, max_memory_gib=torch.cuda.max_memory_allocated() / 2**30)
    if precision == "fp8":
        out["mfu_vs_fp8_peak"] = mfu(flops, timed, PEAK_TFLOPS["fp8"])
    if not te:
        out["note"] = "Transformer Engine not installed: local layer spec in bf16"
    return out


def _write_model_dir(shape: ModelShape, out: Path) -> Path:
    """An HF directory of the shape with random bf16 weights (and the char tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo_mega.models.tiny import build_char_tokenizer, tiny_hf_config

    config = tiny_hf_config(_model_config(shape, 8192), vocab_size=shape.vocab_size)
    config.dtype = "bfloat16"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    build_char_tokenizer().save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def part_sglang(args) -> Dict[str, Any]:
    """Start an SGLang server on a 7B-shaped model, sync into it, time a rollout."""
    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.engines.sglang.client import EngineClient

    shape = replace(QWEN25_7B, num_layers=args.layers)
    result: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_node_model_") as tmp:
        t0 = time.perf_counter()
        model_dir = _write_model_dir(shape, Path(tmp) / "model")
        rollout_cfg = RolloutConfig(backend="sglang", mem_fraction_static=0.6, max_running_requests=512,
                                    health_timeout_s=600, request_timeout_s=900,
                                    engine_python=sglang_python(args) or "")
        fleet = EngineFleet(rollout_cfg, str(model_dir), Path(tmp), device="cuda")
        try:
            started = time.perf_counter()
            engine = fleet.start_on_this_node("bench/gpu_node.py", 1)[0]  # GPU 0 by the device rule
            url = engine.url
            result["server_start_seconds"] = time.perf_counter() - started
            t = time.perf_counter()
            import torch

            if torch.cuda.device_count() < 2:  # the syncer's NCCL rank would share GPU 0 with the server
                sync = None
                result["weight_sync"] = {"skipped": "one GPU: a NCCL group with the server on its GPU is refused "
                                                    "(Duplicate GPU detected); part 5 measures the hand-over"}
            else:
                from dapo_mega.backends.placement import gpu_block

                sync = subprocess.run([sys.executable, str(BENCH_DIR / "gpu_sglang_sync.py"), "--url", url,
                                       "--model-path", str(model_dir), "--gpu", str(gpu_block(1, 1)[0])],
                                      capture_output=True, text=True, timeout=600)  # the block after the engine's
            if sync is None:
                pass
            elif sync.returncode != 0:
                result["weight_sync"] = {"error": sync.stderr[-2000:]}
            else:
                text = sync.stdout[sync.stdout.index("{"):]
                report = json.loads(text)
                report["seconds"] = time.perf_counter() - t
                report["gbps"] = report["runs"][-1]["gbps"]
                result["weight_sync"] = report

            async def rollout():
                prompts = [[(7 * i + j) % 1000 + 3 for j in range(256)] for i in range(args.rollout_prompts)]
                params = {"n": args.rollout_n, "max_new_tokens": args.rollout_tokens, "temperature": 1.0,
                          "ignore_eos": True}
                async with EngineClient(engine) as client:
                    await client.generate(prompts[:1], {**params, "n": 1, "max_new_tokens": 8})  # warm-up
                    start = time.perf_counter()
                    out = await client.generate(prompts, params)
                    return time.perf_counter() - start, sum(len(s.token_ids) for s in out)

            seconds, tokens = asyncio.run(rollout())
            result["rollout"] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                                 "prompts": args.rollout_prompts, "n": args.rollout_n,
                                 "max_new_tokens": args.rollout_tokens}
        finally:
            fleet.close(grace_s=60)
        result["seconds"] = time.perf_counter() - t0
    return result


HANDOVER_RECEIVER = """
import json, sys, time, torch
via_sglang = sys.argv[1] == "sglang"
payload = sys.stdin.read()
t0 = time.perf_counter()
if via_sglang:  # SGLang 0.5.23's own path of update_weights_from_tensor
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    raw = normalize_serialized_named_tensor_payloads([payload])  # the tokenizer manager's step
    monkey_patch_torch_reductions()  # TpModelWorker.deserialize_own_rank: the UUID back to this index
    named = MultiprocessingSerializer.deserialize(raw[0])  # its SafeUnpickler
else:
    import base64, pickle
    from dapo_mega.wire import transport
    transport.patch_torch_reductions()  # the project's copy of SGLang's patch
    named = pickle.loads(base64.b64decode(payload))
kept = [(n, t.clone()) for n, t in named]  # what an engine's load does: copy out of the sender's memory
torch.cuda.synchronize()
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "tensors": len(kept), "device": str(kept[0][1].device),
                  "checksum": float(sum(t.double().sum().item() for _, t in kept)),
                  "bytes": sum(t.numel() * t.element_size() for _, t in kept)}))
"""


def sglang_python(args) -> Optional[str]:
    """The interpreter SGLang runs in here: `--sglang-python` when it finds sglang, else this
    Python when sglang imports in it, else None (the SGLang halves are skipped)."""
    from dapo_mega.plan.preflight import python_has_sglang

    for python in (args.sglang_python, sys.executable):
        if python and python_has_sglang(python):
            return python
    return None


def handover_round_trip(shape: ModelShape, via_sglang: bool, receiver_python: str = sys.executable
                        ) -> Dict[str, Any]:
    """The colocated weight path on one GPU: this process (the learner) builds the CUDA-IPC
    payload of the project's hand-over (`transport.serialize_cuda_ipc`: torch's reductions
    patched to name the GPU by UUID) for the shape's layer tensors; a second process on the
    same GPU (the engine's side) unpickles it (through SGLang's own functions when
    `via_sglang`, in `receiver_python`: the SGLang venv's interpreter, whose torch may differ from
    this one's) and copies each tensor out; the bytes must arrive unchanged (checksum), and
    GB/s is what the copy-out sustains."""
    import torch

    from dapo_mega.wire import transport

    h, ffn = shape.hidden_size, shape.ffn_hidden_size
    kv = shape.num_key_value_heads * (h // shape.num_attention_heads)
    gen = torch.Generator(device="cuda").manual_seed(0)
    named = []
    for layer in range(shape.num_layers):
        for name, dims in (("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
                           ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
                           ("mlp.gate_proj.weight", (ffn, h)), ("mlp.up_proj.weight", (ffn, h)),
                           ("mlp.down_proj.weight", (h, ffn))):
            named.append((f"model.layers.{layer}.{name}",
                          torch.randn(dims, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    payload = transport.serialize_cuda_ipc(named)
    serialize_s = time.perf_counter() - t0
    proc = subprocess.run([receiver_python, "-c", HANDOVER_RECEIVER, "sglang" if via_sglang else "project"],
                          input=payload, capture_output=True, text=True, timeout=150, cwd=REPO,
                          env=repo_env())
    if proc.returncode != 0:
        return {"error": f"receiver ({'sglang' if via_sglang else 'project'}) exit {proc.returncode}: "
                         f"{proc.stderr[-3000:]}"}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = float(sum(t.double().sum().item() for _, t in named))
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    return {"tensors": len(named), "bytes": nbytes, "serialize_seconds": serialize_s, "payload_chars": len(payload),
            "receive_seconds": got["seconds"], "gbps": nbytes / got["seconds"] / 1e9,
            "bytes_unchanged": got["bytes"] == nbytes and got["checksum"] == expected,
            "receiver_device": got["device"], "unpickled_by": "sglang" if via_sglang else "project"}


def part_handover(args) -> Dict[str, Any]:
    """Measurement: the hand-over of `--layers` layers of the 7B shape."""
    python = sglang_python(args)
    return handover_round_trip(replace(QWEN25_7B, num_layers=args.layers), via_sglang=python is not None,
                               receiver_python=python or sys.executable)


# ============================================================================ the checks (GPU)
def repo_env() -> Dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (what was there kept:
    wheels carried to the node may live on it)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


def _tool(*argv: str, timeout_s: float = 150) -> subprocess.CompletedProcess:
    """`tools/convert_checkpoint.py ARGV` in a fresh process."""
    return subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), *argv],
                          capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                          env=repo_env())


def _tiny_hf_dir(root: Path) -> Path:
    from dapo_mega.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(root / "hf", seed=0)


def check_convert_gpu(args) -> Dict[str, Any]:
    """a) import and verify of the tiny model with the ranks on the GPU (bf16)."""
    with tempfile.TemporaryDirectory(prefix="gpu_node_convert_") as tmp:
        hf = _tiny_hf_dir(Path(tmp))
        mg = str(Path(tmp) / "megatron")
        imp = _tool("import", "--hf-path", str(hf), "--megatron-path", mg, "--device", "cuda", "--dtype", "bf16")
        if imp.returncode != 0:
            return {"passed": False, "reason": f"import --device cuda: exit {imp.returncode}: "
                                               f"{first_line(imp.stderr + imp.stdout)}"}
        ver = _tool("verify", "--hf-path", str(hf), "--megatron-path", mg, "--device", "cuda")
        summary = [ln for ln in ver.stdout.splitlines() if ln.strip()][-4:]
        if ver.returncode != 0:
            return {"passed": False, "verify": summary,
                    "reason": f"verify --device cuda: exit {ver.returncode}: {first_line(ver.stderr + ver.stdout)}"}
        return {"passed": True, "verify": summary}


def check_convert_tp2(args) -> Dict[str, Any]:
    """b) `import --tp 2` on this node: the CPU default works; --device cuda works with >= 2
    GPUs and is refused in one line with fewer."""
    import torch

    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory(prefix="gpu_node_tp2_") as tmp:
        hf = _tiny_hf_dir(Path(tmp))
        cpu = _tool("import", "--hf-path", str(hf), "--megatron-path", str(Path(tmp) / "cpu"), "--tp", "2")
        if cpu.returncode != 0:
            return {"passed": False, "reason": f"import --tp 2 (CPU default) on a GPU node: exit {cpu.returncode}: "
                                               f"{first_line(cpu.stderr + cpu.stdout)}"}
        cuda = _tool("import", "--hf-path", str(hf), "--megatron-path", str(Path(tmp) / "cuda"), "--tp", "2",
                     "--device", "cuda")
    if gpus >= 2:
        ok = cuda.returncode == 0
        return {"passed": ok, "gpus": gpus, "reason": "" if ok else
                f"import --tp 2 --device cuda on {gpus} GPUs: exit {cuda.returncode}: {first_line(cuda.stderr)}"}
    ok, said = judge_refusal(cuda.returncode, cuda.stderr, ["need 2 GPUs", f"has {gpus}"])
    return {"passed": ok, "gpus": gpus, "refusal": said, "reason": "" if ok else f"--device cuda --tp 2: {said}"}


def check_eval_two_engines(args) -> Dict[str, Any]:
    """c) `dapo-mega eval`'s device rule on this node, through the function and the fleet."""
    import torch

    from dapo_mega.backends.placement import DeviceRuleError, node_engine_gpus
    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.fleet import EngineFleet

    gpus = torch.cuda.device_count()
    one = node_engine_gpus(RolloutConfig(backend="sglang", num_engines=1), gpus, "dapo-mega eval")
    if one != [(0,)]:
        return {"passed": False, "reason": f"one TP-1 engine got GPUs {one}, not [(0,)]"}
    two = RolloutConfig(backend="sglang", num_engines=2, engine_tp_size=1)
    if gpus >= 2:
        got = node_engine_gpus(two, gpus, "dapo-mega eval")
        return {"passed": got == [(0,), (1,)], "gpus": gpus, "reason": f"two engines got {got}"}
    refusals = []
    try:
        node_engine_gpus(two, gpus, "dapo-mega eval")
        return {"passed": False, "reason": "node_engine_gpus placed two TP-1 engines on one GPU"}
    except DeviceRuleError as exc:
        refusals.append(str(exc))
    with tempfile.TemporaryDirectory(prefix="gpu_node_eval_") as tmp:
        fleet = EngineFleet(two, str(Path(tmp) / "no_model"), Path(tmp), device="cuda")
        try:
            fleet.start_on_this_node("dapo-mega eval", 2)
            started = len(fleet.engines)
            fleet.close(grace_s=10)
            return {"passed": False, "reason": f"the fleet started {started} engines for two on one GPU"}
        except DeviceRuleError as exc:
            refusals.append(str(exc))
        started = len(fleet.engines)
    bad = [r for r in refusals if "\n" in r or "need 2 GPUs" not in r or "Fix:" not in r]
    ok = not bad and started == 0
    return {"passed": ok, "gpus": gpus, "refusal": refusals[-1],
            "reason": "" if ok else f"refusal not one line naming 2 GPUs and the fix ({bad}), or "
                                    f"{started} engines started"}


def check_handover_sglang(args) -> Dict[str, Any]:
    """d) the colocated hand-over, the receiver unpickling through SGLang's own code."""
    python = sglang_python(args)
    sglang = python is not None
    out = handover_round_trip(replace(QWEN25_7B, num_layers=1), via_sglang=sglang,
                              receiver_python=python or sys.executable)
    if "error" in out:
        return {"passed": False, "reason": first_line(out["error"]), **out}
    ok = out["bytes_unchanged"] and out["receiver_device"] == "cuda:0"
    out.update(passed=ok, reason="" if ok else f"bytes changed ({out['bytes_unchanged']}) or on "
                                               f"{out['receiver_device']}, not cuda:0")
    if not sglang:
        out["note"] = ("SGLang half skipped: sglang does not import here; received through the project's "
                       "own patch (transport.patch_torch_reductions)")
    return out


# ============================================================================ driver
PART_FUNCTIONS: Dict[str, Callable[[argparse.Namespace], Dict[str, Any]]] = {
    "convert_gpu": check_convert_gpu, "convert_tp2": check_convert_tp2, "eval_two_engines": check_eval_two_engines,
    "handover_sglang": check_handover_sglang,
    "train_tiny_bf16": lambda a: check_train_tiny(a.train_engine, sglang_python(a), a.train_timeout_s, repo_env()),
    "nccl_loaded": lambda a: check_nccl_loaded(sys.executable, sglang_python(a)),
    "train_moe_bf16": lambda a: check_train_moe(a.train_timeout_s, repo_env()),
    "learner_bf16": lambda a: part_learner(a, "bf16"), "learner_fp8": lambda a: part_learner(a, "fp8"),
    "handover": part_handover, "sglang": part_sglang,
}


def _run_part(part: str, argv: List[str], timeout_s: float) -> Dict[str, Any]:
    """One part in a fresh process (its own session: a timeout kills what it started too,
    `dapo-mega train` and its engines); its JSON is the last line of its stdout."""
    t0 = time.perf_counter()
    extra = ["--train-timeout-s", str(max(10, int(timeout_s) - 20))] if part.startswith("train_") else []
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, *extra, "--part", part],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {timeout_s:.0f} s", "seconds": time.perf_counter() - t0}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {stderr[-3000:]}", "seconds": time.perf_counter() - t0}
    return {**json.loads(lines[-1]), "seconds": time.perf_counter() - t0}


def precondition(part: Part, args: argparse.Namespace, te_error: Optional[str], sglang: bool) -> str:
    """Why `part` cannot run here ("" when it can)."""
    if part.kind == "measure" and args.checks_only:
        return "--checks-only"
    if part.name == "learner_fp8" and te_error is not None:
        return f"Transformer Engine does not import ({te_error}); learner_bf16 used the local spec"
    if part.name == "sglang":
        if args.skip_sglang:
            return "--skip-sglang"
        if not sglang:
            return "sglang does not import: no weight sync into SGLang, no rollout tokens/s"
    return ""


def run_parts(args: argparse.Namespace, argv: List[str], te_error: Optional[str], sglang: bool,
              clock: Callable[[], float] = time.perf_counter) -> Dict[str, Dict[str, Any]]:
    """Every part of PARTS in order, each in its subprocess, within `args.budget_s`."""
    start, results = clock(), {}
    for part in PARTS:
        reason = precondition(part, args, te_error, sglang)
        timeout = None
        if not reason:
            timeout, reason = part_timeout(part, args.budget_s - (clock() - start))
        if reason:
            results[part.name] = {"kind": part.kind, "skipped": reason}
            continue
        print(f"[gpu_node] {part.name}: {part.what} (up to {timeout:.0f} s)", flush=True)
        results[part.name] = {"kind": part.kind, **_run_part(part.name, argv, timeout)}
    return results


def table_rows(results: Dict[str, Dict[str, Any]]) -> List[Tuple[str, str, Optional[float], str]]:
    """(part, verdict, seconds, reason) of every part, in run order."""
    rows = []
    for name, result in results.items():
        status, reason = verdict(result)
        rows.append((name, status, result.get("seconds"), reason))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.part:
        out = PART_FUNCTIONS[args.part](args)
        print(json.dumps(out))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_node.py needs a CUDA GPU (H100/H200 class); nothing run on this machine.")
        return 2
    from dapo_mega.backends.megatron.model import transformer_engine_import_error

    te_error = transformer_engine_import_error()
    sglang = sglang_python(args) is not None
    t0 = time.perf_counter()
    results = run_parts(args, argv, te_error, sglang)
    rows = table_rows(results)
    report: Dict[str, Any] = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                              "torch": torch.__version__, "python": sys.version.split()[0],
                              "transformer_engine": te_error or "imports", "sglang": sglang,
                              "shape": {**asdict(QWEN25_7B), "num_layers": args.layers},
                              "parameters": count_parameters(replace(QWEN25_7B, num_layers=args.layers)),
                              "peak_tflops": PEAK_TFLOPS, "parts": results,
                              "verdicts": {name: {"verdict": s, "reason": why} for name, s, _, why in rows},
                              "total_seconds": time.perf_counter() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(format_table(rows))
    print(f"[gpu_node] {time.perf_counter() - t0:.0f} s; every part's figures: {args.out}")
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
