"""The 32B configs hold every value that the DAPO paper or verl's recipe fixes.

Sources, cited per value below:
  [paper]  DAPO, arXiv 2503.14476 v1 (section numbers of that version);
  [verl]   verl's recipe/dapo/run_dapo_qwen2.5_32b.sh, the public reproduction (AIME 52);
  [reward] verl's verl/utils/reward_score/math_dapo.py, the recipe's reward function;
  [data]   the published DAPO-Math-17k parquet, as read.
A change to one of these numbers is a departure from the published run: it must be made
here too, with its reason, or the test fails.

Not pinned, on purpose: the system knobs of verl's script that have no counterpart here or
depend on this implementation's memory layout (Ulysses sequence parallel size, vLLM's
gpu_memory_utilization, dynamic batch sizes, offloading, test/save frequency), and the
learner / engine parallel layout (`dapo-mega plan` checks it against memory instead).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from dapo_mega.cli import main as cli_main
from dapo_mega.config import AlgoConfig, config_dir, load_config

EXPERIMENTS_32B = ["dapo_qwen2.5_32b", "dapo_qwen2.5_32b_fp8", "dapo_qwen2.5_32b_disagg",
                   "dapo_qwen2.5_32b_disagg_fp8"]

# (config field, value, source)
RECIPE = [
    ("algo.clip_ratio_low", 0.2, "[paper] §3.1 Clip-Higher ε_low; [verl] clip_ratio_low=0.2"),
    ("algo.clip_ratio_high", 0.28, "[paper] §3.1 ε_high; [verl] clip_ratio_high=0.28"),
    ("algo.clip_ratio_c", 10.0, "[verl] actor.clip_ratio_c=10.0 (dual clip for A < 0)"),
    ("algo.loss_agg_mode", "token-mean", "[paper] §3.3 token-level loss, Eq. 12; [verl] loss_agg_mode=token-mean"),
    ("algo.normalize_adv_std", True, "[paper] Eq. 9: group-normalised advantage (R - mean) / std"),
    ("algo.n_samples_per_prompt", 16, "[paper] §4.1 16 responses per prompt; [verl] n_resp_per_prompt=16"),
    ("algo.train_batch_size", 512, "[paper] §4.1 prompt batch 512; [verl] train_prompt_bsz=512"),
    ("algo.gen_batch_size", 1536, "[verl] gen_prompt_bsz=train_prompt_bsz*3"),
    ("algo.mini_batch_size", 32, "[paper] §4.1 mini-batch 512 responses = 32 prompts x 16, 16 updates per "
                                 "rollout step; [verl] train_prompt_mini_bsz=32"),
    ("algo.dynamic_sampling", True, "[paper] §3.2 dynamic sampling, Eq. 11; [verl] enable_filter_groups=True"),
    ("algo.max_num_gen_batches", 10, "[verl] max_num_gen_batches=10"),
    ("algo.max_prompt_length", 2048, "[verl] max_prompt_length=1024*2"),
    ("algo.max_response_length", 20480, "[paper] §4.1 max 20480 tokens (16384 expected + 4096 cache); "
                                        "[verl] max_response_length=1024*20"),
    ("algo.overlong_buffer_enable", True, "[paper] §3.4 soft overlong punishment, Eq. 13; "
                                          "[verl] enable_overlong_buffer=True"),
    ("algo.overlong_buffer_length", 4096, "[paper] §4.1 L_cache = 4096; [verl] overlong_buffer_len=1024*4"),
    ("algo.overlong_penalty_factor", 1.0, "[verl] overlong_penalty_factor=1.0"),
    ("algo.overlong_filter", False, "[paper] Table 1: the best run uses the soft punishment, not filtering"),
    ("algo.temperature", 1.0, "[verl] temperature=1.0 for training rollouts"),
    ("algo.top_p", 1.0, "[verl] top_p=1.0"),
    ("algo.top_k", -1, "[verl] top_k=-1"),
    ("algo.verifier", "dapo", "[reward] the recipe's reward: last 300 chars, `Answer:`, Minerva normalisation"),
    ("algo.lr", 1e-6, "[paper] §4.1 AdamW, constant lr 1e-6 after warm-up; [verl] optim.lr=1e-6"),
    ("algo.lr_warmup_steps", 20, "[paper] §4.1 linear warm-up over 20 rollout steps (verl's script: 10)"),
    ("algo.weight_decay", 0.1, "[verl] optim.weight_decay=0.1"),
    ("algo.grad_clip", 1.0, "[verl] actor.grad_clip=1.0"),
    ("data.apply_chat_template", True, "[verl] prompts rendered with the tokenizer's chat template, "
                                       "add_generation_prompt=True, for training and validation"),
    ("data.dedup", True, "[data] the published DAPO-Math-17k repeats prompts: deduplicate"),
    ("eval.n_samples", 32, "[paper] §4.1 AIME 2024 avg@32; [verl] val_kwargs.n=32"),
    ("eval.temperature", 1.0, "[paper] §4.1 evaluation temperature 1.0; [verl] val_kwargs.temperature=1.0"),
    ("eval.top_p", 0.7, "[paper] §4.1 evaluation top-p 0.7; [verl] val_top_p=0.7"),
]

# Not from the paper: how this system runs the recipe. The run starts RL from the base model
# (the paper: Qwen2.5-32B base, no supervised stage), and every timeout is what
# configs/experiment/dapo_qwen2.5_32b.yaml sets beside the estimate of `dapo-mega plan`
# (tests/plan/test_clock.py: no clock warning for any of these configs).
RUN = [
    ("trainer.sft_warmup_steps", 0, "[paper] §4.1 RL from the base model; the tiny model's warm start stays with it"),
    ("trainer.sft_on_pretrained", False, "a warm start on a pretrained model is asked for by name"),
    ("rollout.request_timeout_s", 0.0, "no total bound on one /generate: the slowest request is ~13 min"),
    ("rollout.liveness_timeout_s", 300.0, "a hung engine gives its prompts up after 5 min without a probe answer"),
    ("rollout.liveness_probe_interval_s", 10.0, "30 probes per liveness timeout"),
    ("rollout.health_timeout_s", 0.0, "derived from the model's bytes and the engine count (plan/clock.py)"),
    ("cluster.dist_timeout_s", 1800, "one learner collective: a training step ~4 min, a sync ~7 s"),
    ("cluster.driver_stall_timeout_s", 1800.0, "the driver's progress gap: the slowest request, ~13 min"),
]

# The base 32B run only: the variants change the topology on purpose (their own headers say how).
TOPOLOGY_32B = [
    ("cluster.num_nodes", 16, "[verl] NNODES=16 (16 x 8 H800 in the reproduction)"),
    ("cluster.gpus_per_node", 8, "[verl] trainer.n_gpus_per_node=8"),
    ("cluster.mode", "colocated", "[verl] the hybrid engine: rollout and training take turns on every GPU"),
    ("cluster.max_staleness", 0, "[paper] on-policy: each step samples from the current policy"),
]


def _get(cfg, dotted):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


HEADER_KINDS = ("cluster", "learners", "engines", "model", "run_name")
"""The kinds of difference a variant's file header names (`#   cluster ...`)."""


def check_variant_of_32b(base, cfg, name: str, documented: set) -> str:
    """A variant of the 32B recipe (`cfg`, configs/experiment/<name>.yaml) differs from it
    (`base`) only in `documented` fields, and its header names each kind of difference; returns
    the file's text."""
    flat_base, flat_cfg = dict(_flat(dataclasses.asdict(base))), dict(_flat(dataclasses.asdict(cfg)))
    differs = {k for k in flat_base if flat_base[k] != flat_cfg[k]}
    assert differs <= documented, f"undocumented differences: {sorted(differs - documented)}"
    text = (config_dir() / "experiment" / f"{name}.yaml").read_text()
    for kind in HEADER_KINDS:
        assert f"#   {kind}" in text, f"the {name} file does not document its {kind} difference"
    return text


def check_run_pins(cfg) -> None:
    """`cfg` keeps how this system runs the recipe (RUN)."""
    wrong = [f"{f} = {_get(cfg, f)!r}, pinned {v!r} ({why})" for f, v, why in RUN if _get(cfg, f) != v]
    assert not wrong, "\n  ".join(wrong)


@pytest.fixture(scope="module")
def configs():
    return {name: load_config([f"+experiment={name}"]) for name in EXPERIMENTS_32B + ["dapo_qwen2.5_7b"]}


@pytest.mark.parametrize("name", EXPERIMENTS_32B)
def test_32b_configs_hold_the_published_recipe(configs, name):
    cfg = configs[name]
    wrong = [f"{field} = {_get(cfg, field)!r}, published {value!r} ({source})"
             for field, value, source in RECIPE if _get(cfg, field) != value]
    assert not wrong, f"{name} departs from the DAPO recipe:\n  " + "\n  ".join(wrong)


@pytest.mark.parametrize("name", EXPERIMENTS_32B + ["dapo_qwen2.5_7b"])
def test_recipe_configs_start_from_the_base_model_with_the_planned_timeouts(configs, name):
    cfg = configs[name]
    wrong = [f"{field} = {_get(cfg, field)!r}, pinned {value!r} ({why})"
             for field, value, why in RUN if _get(cfg, field) != value]
    assert not wrong, f"{name}:\n  " + "\n  ".join(wrong)


def test_32b_topology_and_model(configs):
    cfg = configs["dapo_qwen2.5_32b"]
    wrong = [f"{field} = {_get(cfg, field)!r}, published {value!r} ({source})"
             for field, value, source in TOPOLOGY_32B if _get(cfg, field) != value]
    assert not wrong, "\n".join(wrong)
    assert cfg.model.name == "qwen2.5-32b"  # [paper] §4.1 Qwen2.5-32B base


# The paper's length, from its own numbers (notes/dapo-recipe.md "Training setup of the 32B run").
PAPER_PROMPTS_PER_STEP = 512       # [paper] §4.1 prompt batch 512
PAPER_RESPONSES_PER_PROMPT = 16    # [paper] §4.1 G = 16
PAPER_MINI_BATCH_RESPONSES = 512   # [paper] §4.1 mini-batch 512 responses
PAPER_UPDATES_TO_50 = 5000         # [paper] Figure 1: AIME 50 at ~5,000 steps, an axis of gradient
                                   # updates (its caption; a verl maintainer in verl issue 1643)
VERL_TEST_FREQ = 5                 # [verl] trainer.test_freq=5


@pytest.mark.parametrize("name", EXPERIMENTS_32B)
def test_32b_configs_run_the_papers_length_and_evaluate_as_verl(configs, name):
    """total_steps counts rollout steps: the paper's ~5,000 gradient updates at 16 per step."""
    from dapo_mega.plan.memory import checkpoints_kept_for_good

    updates_per_step = PAPER_PROMPTS_PER_STEP * PAPER_RESPONSES_PER_PROMPT // PAPER_MINI_BATCH_RESPONSES
    paper_rollout_steps = math.ceil(PAPER_UPDATES_TO_50 / updates_per_step)
    assert (updates_per_step, paper_rollout_steps) == (16, 313)
    t, algo = configs[name].trainer, configs[name].algo
    assert algo.train_batch_size // algo.mini_batch_size == updates_per_step  # the config's own updates per step
    assert t.total_steps == paper_rollout_steps, (
        f"{name}: trainer.total_steps = {t.total_steps} rollout steps = {t.total_steps * updates_per_step:,} "
        f"gradient updates; the paper ran ~{PAPER_UPDATES_TO_50:,} ({paper_rollout_steps} rollout steps)")
    assert t.eval_interval == VERL_TEST_FREQ
    # Earlier checkpoints stay to be scored again on the same hold-out: keep_every falls on saved steps.
    assert t.keep_every > 0 and t.keep_every % t.save_interval == 0, (t.keep_every, t.save_interval)
    assert checkpoints_kept_for_good(t.total_steps, t.save_interval, t.keep_every, t.keep_last_k) >= 1
    text = (config_dir() / "experiment" / "dapo_qwen2.5_32b.yaml").read_text()
    assert "5,000 / 16" in text and f"{paper_rollout_steps} rollout steps" in text  # the derivation, in the config


def test_checkpoints_kept_for_good_counts_saved_multiples_beside_the_newest():
    from dapo_mega.plan.memory import checkpoints_kept_for_good

    # saves 10, 20, ..., 310 and 313; the newest 3 are 300, 310, 313; keep_every 100 adds 100 and 200
    assert checkpoints_kept_for_good(313, 10, 100, 3) == 2
    assert checkpoints_kept_for_good(313, 10, 0, 3) == 0
    assert checkpoints_kept_for_good(313, 0, 100, 1) == 0       # saved only at the end
    assert checkpoints_kept_for_good(300, 30, 50, 1) == 1       # 150 and 300 are saved; 300 is the newest


def test_no_kl_term_and_no_critic():
    # [paper] §2.3/§3: DAPO removes the KL penalty; GRPO-style, no value model. The schema
    # has no field that could turn either back on.
    names = {f.name for f in dataclasses.fields(AlgoConfig)}
    assert not {n for n in names if "kl" in n.split("_") or "critic" in n or "value" in n.split("_")}, names


def test_warmup_is_counted_in_rollout_steps(configs):
    """20 rollout steps x 16 updates: the lr first reaches 1e-6 at update 320, not 20."""
    from dapo_mega.backends.megatron.optimizer import WarmupConstantLR

    algo = configs["dapo_qwen2.5_32b"].algo
    schedule = WarmupConstantLR.from_algo(algo)
    updates_per_step = algo.train_batch_size // algo.mini_batch_size
    assert updates_per_step == 16 and schedule.warmup_steps == 20 * 16
    assert schedule.lr_at(0) == pytest.approx(1e-6 / 320)
    assert schedule.lr_at(20 * updates_per_step - 2) < 1e-6  # still warming in rollout step 20
    assert schedule.lr_at(20 * updates_per_step - 1) == pytest.approx(1e-6)
    assert schedule.lr_at(10_000) == pytest.approx(1e-6)  # constant after


def test_7b_differs_from_32b_only_where_its_file_says(configs):
    """configs/experiment/dapo_qwen2.5_7b.yaml lists every difference; anything else is drift."""
    check_variant_of_32b(configs["dapo_qwen2.5_32b"], configs["dapo_qwen2.5_7b"], "dapo_qwen2.5_7b",
                         {"model.name", "model.hf_path", "model.megatron_path", "cluster.num_nodes",
                          "rollout.num_engines", "rollout.engine_tp_size", "megatron.tensor_model_parallel_size",
                          "megatron.pipeline_model_parallel_size", "trainer.run_name"})


def test_cfg_job_shows_the_recipe(capsys):
    """`dapo-mega train --cfg job +experiment=dapo_qwen2.5_32b`."""
    assert cli_main(["train", "--cfg", "job", "+experiment=dapo_qwen2.5_32b"]) == 0
    out = capsys.readouterr().out
    assert "apply_chat_template: true" in out
    assert "lr_warmup_steps: 20" in out
    assert "sft_warmup_steps: 0" in out  # no warm start of the toy on the 32B model
