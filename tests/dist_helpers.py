"""Run a function in N gloo processes for tests.

    results = run_distributed(fn, world_size=2, args=(x,), timeout_s=120)

`fn(rank, world_size, *args)` runs in every process with the env:// variables set (code
under test initialises torch.distributed from them, as `ParallelLayout.initialize` does).
A thin wrapper of the package's own `dapo_mega.weights.spawn.spawn_gloo`, which the
conversion tool uses too; `fn` must be importable (a module-level function of a test module).

`make_config` and `make_samples`: the small learner configuration and samples the learner
tests share.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from dapo_mega.weights.spawn import spawn_gloo


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), timeout_s: float = 180.0) -> List[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned gloo processes; results by rank."""
    return spawn_gloo(fn, world_size, args=args, timeout_s=timeout_s)


def make_config(tp=1, pp=1, micro_batch_tokens=32, train_batch_size=2, mini_batch_size=1, n=4, lr=1e-2):
    from dapo_mega.config import DapoConfig

    cfg = DapoConfig()
    cfg.model.tiny_num_layers = 2
    m = cfg.megatron
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = tp, pp
    m.micro_batch_tokens = micro_batch_tokens
    m.transformer_impl = "local"
    a = cfg.algo
    a.train_batch_size, a.mini_batch_size, a.n_samples_per_prompt = train_batch_size, mini_batch_size, n
    a.lr, a.lr_warmup_steps, a.grad_clip = lr, 0, 1.0
    a.temperature = 0.7
    return cfg


def make_samples(seed: int = 0, num: int = 8, vocab: int = 90):
    """Variable-length prompts/responses with +/- advantages (2 groups of 4)."""
    import random

    from dapo_mega.algo.train_sample import TrainSample

    rng = random.Random(seed)
    samples = []
    for i in range(num):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        samples.append(TrainSample(prompt_ids=prompt, response_ids=response, advantage=(1.0 if i % 2 == 0 else -1.0)))
    return samples
