"""Peak memory of the learner's log-prob + entropy computation: chunked against whole-row.

    python bench/bench_logprobs_memory.py [--quick]

One packed row's vocab-parallel logits [1, N, V_local] (bf16, as the model returns them),
log p(labels) and entropy forward, then backward of sum(log p): the work of one micro-batch
of the learner's loss. `ours` is `chunked_log_probs_and_entropy` (the learner's code path);
the baseline is the whole-row path the learner used before, which is also what the same
math costs without chunking: an fp32 cast, the padded-vocabulary mask, a copy for megatron's
`vocab_parallel_cross_entropy` (forward and backward) and the entropy's temporaries. Each
side runs in its own fresh process and reports its peak resident memory (ru_maxrss) minus
the resident memory after the logits were made; repeats give the spread. Lower is better.
At the 32B run's shape (N = 22,528, V_local = 152,064 / TP 8 = 19,008) one fp32 copy of the
row is 1.6 GiB; the quick size keeps the same vocabulary slice with fewer positions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from statistics import mean, pstdev

V_LOCAL = 19008          # Qwen2.5's 152,064-token vocabulary over TP 8
VOCAB = V_LOCAL - 40     # this slice holds a few padded rows, as the last TP rank's does


def _measure(kind: str, tokens: int) -> float:
    """Child process: the extra peak RSS (MiB) of one forward + backward of `kind`."""
    code = f"""
import resource, torch
from unittest import mock
torch.manual_seed(0)
logits = torch.randn(1, {tokens}, {V_LOCAL}, dtype=torch.bfloat16).mul_(3).requires_grad_(True)  # no fp32 temporary
labels = torch.randint(0, {VOCAB}, (1, {tokens}))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if "{kind}" == "chunked":
    from dapo_mega.backends.megatron.logprobs import chunked_log_probs_and_entropy
    logp, ent = chunked_log_probs_and_entropy(logits, labels, 1.0, {VOCAB})
else:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    ce = "megatron.core.tensor_parallel.cross_entropy"
    with mock.patch(ce + ".get_tensor_model_parallel_rank", return_value=0), \\
            mock.patch(ce + ".get_tensor_model_parallel_world_size", return_value=1), \\
            mock.patch(ce + ".get_tensor_model_parallel_group", return_value=None), \\
            mock.patch("torch.distributed.all_reduce", lambda *a, **k: None):
        scaled = logits.float() / 1.0
        scaled = scaled.masked_fill(torch.arange({V_LOCAL}) >= {VOCAB}, -1.0e9)
        logp = -vocab_parallel_cross_entropy(scaled.clone(), labels)
        with torch.no_grad():
            m = scaled.max(dim=-1).values
            shifted = scaled - m.unsqueeze(-1)
            e = shifted.exp()
            ent = e.sum(-1).log() - (e * shifted).sum(-1) / e.sum(-1)
            del shifted, e
logp.sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - base) / 1024.0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> dict:
    tokens = 2048 if quick else 8192
    repeats = 2 if quick else 3
    ours = [_measure("chunked", tokens) for _ in range(repeats)]
    base = [_measure("whole_row", tokens) for _ in range(repeats)]
    row_mib = tokens * V_LOCAL * 4 / 2**20
    return {"name": "logprobs_memory", "metric": f"extra peak RSS (MiB), one {tokens}-token row x {V_LOCAL} vocab "
                                                f"slice, forward + backward (fp32 row = {row_mib:.0f} MiB)",
            "ours": min(ours), "baseline": min(base), "baseline_name": "whole-row fp32 (megatron cross-entropy)",
            "ratio": min(base) / max(min(ours), 1e-9), "higher_is_better": False,
            "ours_runs": ours, "baseline_runs": base,
            "spread": {"ours_mean": mean(ours), "ours_std": pstdev(ours), "baseline_mean": mean(base),
                       "baseline_std": pstdev(base)}}


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
