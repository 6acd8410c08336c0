"""`dapo_mega.plan.clock`: every estimate against a hand computation, the timeout warnings, the
printed plan, and the warm start that belongs to the tiny model only."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from dapo_mega.cli import main as cli_main
from dapo_mega.config import ConfigError, check_warm_start, load_config
from dapo_mega.plan.clock import (
    ClockAssumptions,
    EngineRates,
    clock_warnings,
    engine_rates,
    engine_slots,
    engine_start_timeout_s,
    estimate_clock,
    estimate_generation,
    learner_passes,
    resolve_health_timeout_s,
    train_flops_per_step,
)
from dapo_mega.plan.memory import KNOWN_MODELS, LengthAssumption, compute_plan, total_params

PHI_32B = 32_763_876_352  # tests/plan/test_plan_memory.py counts it parameter by parameter
SHIPPED = ["dapo_qwen2.5_32b", "dapo_qwen2.5_32b_fp8", "dapo_qwen2.5_32b_disagg", "dapo_qwen2.5_32b_disagg_fp8",
           "dapo_qwen2.5_7b", "dapo_retool_qwen2.5_32b"]
REFERENCE_RATES = EngineRates(decode=4000.0, sequence=50.0, prefill=20000.0, scale=1.0)


@pytest.fixture(scope="module")
def cfg32():
    return load_config(["+experiment=dapo_qwen2.5_32b"])


def fixed(length: int, prompt: int) -> LengthAssumption:
    """Every response `length` tokens (σ → 0), so the hand computations are round numbers."""
    return LengthAssumption(response_median=length, response_sigma=1e-9, prompt_tokens=prompt)


def capped_lognormal_moment(median, sigma, cap, r):
    """E[min(X, cap)^r] by numerical integration over log x (midpoint rule): an independent
    check of the closed form in LengthAssumption.response_moment."""
    mu, n, lo, hi = math.log(median), 200_000, math.log(median) - 12 * sigma, math.log(median) + 12 * sigma
    h, total = (hi - lo) / n, 0.0
    for i in range(n):
        y = lo + (i + 0.5) * h
        density = math.exp(-((y - mu) / sigma) ** 2 / 2) / (sigma * math.sqrt(2 * math.pi))
        total += min(math.exp(y), cap) ** r * density * h
    return total


# ------------------------------------------------------------------ lengths
def test_capped_lognormal_moments_and_quantiles():
    lengths = LengthAssumption(response_median=2560, response_sigma=1.0, prompt_tokens=150)
    for r in (1, 2):
        assert lengths.response_moment(r, 20480) == pytest.approx(capped_lognormal_moment(2560, 1.0, 20480, r),
                                                                  rel=1e-4)
    # no cap in reach: the log-normal mean median * e^(σ²/2)
    assert lengths.response_moment(1, 10 ** 9) == pytest.approx(2560 * math.exp(0.5), rel=1e-9)
    # the longest of 32: P(X <= L) = 32/33 (normal CDF by erf), below the cap
    longest = lengths.longest_of(32, 20480)
    assert 0.5 * (1 + math.erf(math.log(longest / 2560) / math.sqrt(2))) == pytest.approx(32 / 33)
    assert lengths.longest_of(64, 20480) == 20480  # 2560 * e^2.16 = 22,200: capped


# ------------------------------------------------------------------ one generation phase
def test_rollout_round_of_the_32b_shape_by_hand():
    # 1536 prompts x 16 over 32 engines, 4 prompts per request, 8 requests in flight, 128 slots,
    # every response 4000 tokens, prompts 100:
    #   384 requests, 12 per engine, m = 64 samples, Q = 8 x 64 = 512 in flight, rate min(4000, 128 x 50)
    #   T_tp  = 768 x 4000 / 4000 + 768 x 100 / 20000          = 771.84
    #   W     = (512 - 128) x 4000 / 4000                       = 384
    #   T_req = 384 + 64 x 100 / 20000 + 4000 / 50              = 464.32
    #   T_ld  = 771.84 - 512 x 4000 / 4000                      = 259.84
    #   T     = max(771.84, 259.84 + 464.32 = 724.16)           = 771.84
    g = estimate_generation(1536, 16, 20480, num_engines=32, prompts_per_request=4, requests_per_engine=8,
                            slots_per_engine=128, rates=REFERENCE_RATES, lengths=fixed(4000, 100))
    assert (g.requests, g.engines_used, g.samples_per_request, g.samples_per_engine, g.in_flight_per_engine) == \
        (384, 32, 64, 768, 512)
    assert g.engine_tokens_per_s == 4000
    assert g.throughput_s == pytest.approx(771.84)
    assert g.admission_wait_s == pytest.approx(384)
    assert g.slowest_request_s == pytest.approx(464.32)
    assert g.last_dispatch_s == pytest.approx(259.84)
    assert g.duration_s == pytest.approx(771.84)


def test_tool_time_of_a_multi_turn_round_by_hand():
    # the round above with 3 tool calls of 2 s per sample, 64 at a time on the driver:
    #   k t    = 6 s each sample waits for its tools            -> T_req = 464.32 + 6 = 470.32
    #   T_tool = 1536 x 16 x 6 / 64                               = 2304   (> T_tp = 771.84: it sets T)
    g = estimate_generation(1536, 16, 20480, num_engines=32, prompts_per_request=4, requests_per_engine=8,
                            slots_per_engine=128, rates=REFERENCE_RATES, lengths=fixed(4000, 100),
                            tool_calls=3, tool_call_s=2.0, tool_slots=64)
    assert g.tool_wait_s == 6 and g.slowest_request_s == pytest.approx(470.32)
    assert g.tool_throughput_s == pytest.approx(2304) and g.duration_s == pytest.approx(2304)
    # the recipe: (16 - 1) / 2 calls of 1 s, 192 at a time; the round is the engines' still
    cfg = load_config(["+experiment=dapo_retool_qwen2.5_32b"])
    e = estimate_clock(cfg)
    ro = e.rollout_round
    assert ro.tool_calls_per_sample == 7.5 and ro.tool_throughput_s == pytest.approx(1536 * 16 * 7.5 / 192)
    assert ro.duration_s > ro.tool_throughput_s and clock_warnings(cfg, e) == []
    few = load_config(["+experiment=dapo_retool_qwen2.5_32b", "rollout.environment_kwargs.max_concurrent=32"])
    warnings = clock_warnings(few, estimate_clock(few))
    assert len(warnings) == 1 and warnings[0].startswith("the tools bound a rollout round"), warnings
    assert "max_concurrent above" in warnings[0]
    assert estimate_clock(load_config(["+experiment=dapo_qwen2.5_32b"])).rollout_round.tool_throughput_s == 0


def test_evaluation_spreads_one_request_per_engine_and_runs_below_full_batch():
    # 30 problems x 32 over 32 engines: chunks of 1 (every engine gets one), 30 engines used,
    # 32 sequences each, so the engine decodes at 32 x 50 = 1600 tokens/s, not 4000:
    #   T_tp  = 32 x 4000 / 1600 + 32 x 100 / 20000 = 80.16;  W = 0
    #   T_req = 32 x 100 / 20000 + 4000 / 50         = 80.16;  T_ld = 80.16 - 32 x 4000 / 1600 = 0.16
    #   T     = max(80.16, 0.16 + 80.16)             = 80.32
    g = estimate_generation(30, 32, 20480, num_engines=32, prompts_per_request=4, requests_per_engine=8,
                            slots_per_engine=128, rates=REFERENCE_RATES, lengths=fixed(4000, 100))
    assert (g.requests, g.engines_used, g.samples_per_request) == (30, 30, 32)
    assert g.engine_tokens_per_s == 1600 and g.admission_wait_s == 0
    assert g.slowest_request_s == pytest.approx(80.16)
    assert g.duration_s == pytest.approx(80.32)


def test_a_long_tail_request_dispatched_last_sets_the_round():
    # One engine, 8 prompts x 4, 1 prompt per request, 2 in flight, 16 slots, responses 1000,
    # prompts 0 (no prefill), and a request's longest answer capped at 1000 as well:
    #   8 requests, Q = 8, rate min(4000, 8 x 50 = 400) = 400
    #   T_tp = 32 x 1000 / 400 = 80;  T_req = 1000 / 50 = 20;  T_ld = 80 - 8 x 1000 / 400 = 60
    #   T = max(80, 60 + 20) = 80
    g = estimate_generation(8, 4, 1000, num_engines=1, prompts_per_request=1, requests_per_engine=2,
                            slots_per_engine=16, rates=REFERENCE_RATES, lengths=fixed(1000, 0))
    assert (g.throughput_s, g.slowest_request_s, g.last_dispatch_s, g.duration_s) == pytest.approx((80, 20, 60, 80))
    # a per-sequence rate of 10 tokens/s: the last request decodes for 100 s after T_ld = 60
    slow = EngineRates(decode=4000.0, sequence=10.0, prefill=20000.0, scale=1.0)
    g = estimate_generation(8, 4, 1000, num_engines=1, prompts_per_request=1, requests_per_engine=2,
                            slots_per_engine=16, rates=slow, lengths=fixed(1000, 0))
    # rate min(4000, 8 x 10) = 80: T_tp = 32000 / 80 = 400, T_ld = 400 - 8000 / 80 = 300, T_req = 100
    assert (g.throughput_s, g.last_dispatch_s, g.duration_s) == pytest.approx((400, 300, 400))


def test_engine_slots_and_rates():
    assert engine_slots(512, 536_463, 4164) == 128      # 536,463 // 4164 (KV bound)
    assert engine_slots(256, 10 ** 9, 15) == 256        # max_running_requests bound
    assert engine_slots(512, 0, 4164) == 1              # no KV room: the plan warns, the clock stays finite
    assert engine_rates(ClockAssumptions(), PHI_32B, 4) == EngineRates(4000.0, 50.0, 20000.0, 1.0)
    # a 7.6B model on 2 GPUs: (2 / 4) x (32.76e9 / 7.6e9); a rate that is set is kept as set
    phi_7b = total_params(KNOWN_MODELS["qwen2.5-7b"])
    k = 0.5 * PHI_32B / phi_7b
    rates = engine_rates(ClockAssumptions(decode_tokens_per_s_sequence=80.0), phi_7b, 2)
    assert (rates.decode, rates.sequence, rates.prefill, rates.scale) == pytest.approx((4000 * k, 80, 20000 * k, k))


# ------------------------------------------------------------------ the 32B clock, composed
def test_the_32b_clock_by_hand(cfg32):
    e = estimate_clock(cfg32)
    # responses: log-normal, median 20480 / 8 = 2560, σ 1, capped at 20480; prompts min(150, 2048 / 4)
    mean = capped_lognormal_moment(2560, 1.0, 20480, 1)
    mean2 = capped_lognormal_moment(2560, 1.0, 20480, 2)
    kv = compute_plan(cfg32).engines.kv_tokens
    slots = min(512, int(kv // (150 + mean)))
    # 371,237 KV tokens per engine by SGLang's formula (tests/plan/test_plan_memory.py) // (150 + mean)
    assert e.rollout_round.slots_per_engine == slots == 89
    # round: 12 requests of 64 per engine, 512 in flight, 4000 tokens/s
    tp = 768 * mean / 4000 + 768 * 150 / 20000
    req = (512 - slots) * mean / 4000 + 64 * 150 / 20000 + 20480 / 50
    assert e.rollout_round.throughput_s == pytest.approx(tp, rel=1e-4)
    assert e.rollout_round.slowest_request_s == pytest.approx(req, rel=1e-4)
    assert e.rollout_round.duration_s == pytest.approx(max(tp, tp - 512 * mean / 4000 + req), rel=1e-4)
    # eval: AIME 30 x 32 on 30 engines at 32 x 50 tokens/s, the longest of 32 below the cap
    longest = 2560 * math.exp(1.0 * 1.87636)  # z of 32/33: Φ(1.87636) = 0.969697 (tables)
    assert e.evaluation.slowest_request_s == pytest.approx(32 * 150 / 20000 + longest / 50, rel=1e-3)
    # training: 512 x 16 samples, 5 passes (forward+backward, full recompute, log-prob pass),
    # 2Φ per token + attention 2 x 64 layers x 5120 x E[s²], on 128 GPUs at 40% of 989 TFLOP/s
    n, p = 512 * 16, 150
    flops = 5 * (2 * PHI_32B * n * (p + mean) + 2 * 64 * 5120 * n * (p * p + 2 * p * mean + mean2))
    assert e.train_flops == pytest.approx(flops, rel=1e-4)
    assert e.train_step_s == pytest.approx(flops / (128 * 989e12 * 0.4), rel=1e-4)
    # weight sync: 2Φ bytes at 13.3 GB/s x 0.75 (the measured share of a raw broadcast)
    assert e.weight_sync_s == pytest.approx(2 * PHI_32B / (13.3e9 * 0.75))
    # engine start: 32 engines read 2Φ bytes each over 10 GB/s shared, + 60 s init + 60 s graphs; x3
    start = 60 + 2 * PHI_32B * 32 / 10e9 + 60
    assert e.engine_start_s == pytest.approx(start) and start == pytest.approx(329.69, abs=0.01)
    assert e.engine_start_timeout_s == e.health_timeout_s == pytest.approx(3 * start)
    assert e.driver_gap_s == pytest.approx(max(req, e.evaluation.slowest_request_s))
    assert e.step_s == pytest.approx(e.rollout_round.duration_s + e.train_step_s + e.weight_sync_s)


def test_learner_passes_and_tokens_per_gpu_override(cfg32):
    assert learner_passes(recompute_full=True, engine_logprobs=False) == 5
    assert learner_passes(recompute_full=False, engine_logprobs=True) == 3
    # 2 samples of 100 + 300 tokens, Φ = 1000, 2 layers of width 8, 3 passes:
    #   3 x (2 x 1000 x 2 x 400 + 2 x 2 x 8 x 2 x 400²) = 3 x (1,600,000 + 10,240,000)
    assert train_flops_per_step(2, fixed(300, 100), 4096, 1000, 2, 8, 3) == pytest.approx(35_520_000)
    e = estimate_clock(cfg32, ClockAssumptions(learner_tokens_per_s_per_gpu=1000.0))
    assert e.train_step_s == pytest.approx(e.train_tokens / (128 * 1000.0))


def test_engine_start_disaggregated_and_embedded():
    disagg = load_config(["+experiment=dapo_qwen2.5_32b_disagg"])
    # 16 engines + the learners' 4 DP replicas read at once: 60 + 2Φ x 20 / 10e9 + 60
    assert engine_start_timeout_s(disagg) == pytest.approx(3 * (120 + 2 * PHI_32B * 20 / 10e9))
    tiny = load_config([])
    assert engine_start_timeout_s(tiny) == 300.0  # the floor: the embedded engine has no graphs, 60 s init x 3 < 300
    assert resolve_health_timeout_s(tiny) == 300.0
    assert resolve_health_timeout_s(load_config(["rollout.health_timeout_s=42"])) == 42.0


def test_nemo_rl_qwen3_32b_step_is_reproduced():
    """The calibration: NeMo-RL v0.4, Qwen3-32B GRPO on 32 H100, 2,048 responses (128 prompts
    x 16), average sequence 3,206 tokens under a 4,096 cap, generation TP 4 (8 engines),
    training TP 4 / PP 4: 393 s a step (376 s later). Within 10% of that range."""
    cfg = load_config(["+experiment=dapo_qwen2.5_32b", "cluster.num_nodes=4", "rollout.num_engines=8",
                       "algo.gen_batch_size=128", "algo.train_batch_size=128", "algo.mini_batch_size=32",
                       "algo.dynamic_sampling=false", "algo.max_prompt_length=512", "algo.max_response_length=3584",
                       "algo.overlong_buffer_length=512", "megatron.tensor_model_parallel_size=4",
                       "megatron.pipeline_model_parallel_size=4", "megatron.micro_batch_tokens=4096"])
    a = ClockAssumptions(lengths=LengthAssumption(response_median=3200, response_sigma=0.3, prompt_tokens=150))
    e = estimate_clock(cfg, a)
    assert 150 + e.rollout_round.mean_response == pytest.approx(3206, rel=0.01)
    assert 0.9 * 376 <= e.step_s <= 1.1 * 393, e.step_s


# ------------------------------------------------------------------ warnings
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_configs_have_no_clock_warning(name):
    cfg = load_config([f"+experiment={name}"])
    assert clock_warnings(cfg, estimate_clock(cfg)) == []


@pytest.mark.parametrize("override, field", [
    ("rollout.request_timeout_s=600", "rollout.request_timeout_s=600 s is shorter than the slowest request"),
    ("rollout.health_timeout_s=300", "rollout.health_timeout_s=300 s is shorter than an engine's start"),
    ("cluster.dist_timeout_s=120", "cluster.dist_timeout_s=120 s is shorter than a training step"),
    ("cluster.driver_stall_timeout_s=600", "cluster.driver_stall_timeout_s=600 s is shorter than the longest wait"),
    ("trainer.wall_time_minutes=20", "trainer.wall_time_minutes=20 leaves no room for one step"),
])
def test_a_short_timeout_warns(override, field):
    cfg = load_config(["+experiment=dapo_qwen2.5_32b", override])
    warnings = clock_warnings(cfg, estimate_clock(cfg))
    assert len(warnings) == 1 and warnings[0].startswith(field), warnings


def test_request_timeout_of_600_s_is_shorter_than_the_slowest_32b_request(cfg32):
    e = estimate_clock(cfg32)
    assert e.rollout_round.slowest_request_s > 600  # estimated at 630-900 s for the 32B run
    assert 600 < e.rollout_round.slowest_request_s < 900


# ------------------------------------------------------------------ `dapo-mega plan`
def test_plan_prints_the_clock_beside_its_timeouts(capsys):
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b"]) == 0
    out = capsys.readouterr().out
    e = estimate_clock(load_config(["+experiment=dapo_qwen2.5_32b"]))
    expect = {"rollout round": (e.rollout_round.duration_s, "cluster.driver_stall_timeout_s=1800 s"),
              "slowest request": (e.rollout_round.slowest_request_s, "rollout.request_timeout_s=0 (none"),
              "evaluation": (e.evaluation.duration_s, "cluster.driver_stall_timeout_s=1800 s"),
              "training step": (e.train_step_s, "cluster.dist_timeout_s=1800 s"),
              "weight sync": (e.weight_sync_s, "cluster.dist_timeout_s=1800 s"),
              "engine start": (e.engine_start_s, "rollout.health_timeout_s=0: derived")}
    for phase, (seconds, bound) in expect.items():  # the estimate, then the timeout, on the phase's line
        line = next(line for line in out.splitlines() if line.startswith(f"  {phase} "))
        estimate = f"{seconds:,.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
        assert f" {estimate}  " in line and line.index(estimate) < line.index(bound), line
    assert "decode 4,000 tokens/s at full batch, 50 tokens/s per sequence" in out
    assert "median 2,560, sigma 1" in out and "MFU 0.4 of 989 TFLOP/s" in out
    ledger = next(line for line in out.splitlines() if line.startswith("ledger: "))
    assert "MB per step and generation round (trainer.ledger_text=head_tail;" in ledger, ledger
    assert out.rstrip().endswith("no warnings")


def test_plan_warns_and_takes_clock_assumptions(capsys):
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "rollout.request_timeout_s=600"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: clock: rollout.request_timeout_s=600 s is shorter than the slowest request" in out
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "clock.decode_tokens_per_s_sequence=25",
                     "clock.lengths.response_median=4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    clock = out["clock"]
    assert clock["rates"]["sequence"] == 25 and clock["assumptions"]["lengths"]["response_median"] == 4096
    assert out["learner_efficiency"]["assumption"]["response_median"] == 4096  # one length assumption for both
    assert clock["rollout_round"]["duration_s"] > 0
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "clock.no_such_rate=1"]) == 2
    assert "clock.no_such_rate" in capsys.readouterr().err


# ------------------------------------------------------------------ the warm start
def test_recipe_configs_do_not_warm_start_and_the_tiny_default_does(capsys):
    for name in SHIPPED:
        assert load_config([f"+experiment={name}"]).trainer.sft_warmup_steps == 0
    tiny = load_config([])
    assert (tiny.trainer.sft_warmup_steps, tiny.trainer.sft_lr) == (1200, 3e-3)
    assert cli_main(["train", "--cfg", "job", "+experiment=dapo_qwen2.5_32b"]) == 0
    assert "sft_warmup_steps: 0" in capsys.readouterr().out
    assert cli_main(["train", "--cfg", "job"]) == 0
    assert "sft_warmup_steps: 1200" in capsys.readouterr().out


def test_a_warm_start_on_a_pretrained_model_must_be_asked_for(tmp_path):
    check_warm_start(load_config([]))  # the tiny model, randomly initialised: fine
    for given in (f"model.hf_path={tmp_path}", f"model.megatron_path={tmp_path}"):
        cfg = load_config([given])  # the tiny group's 1200 steps, now on a pretrained model
        with pytest.raises(ConfigError, match=r"^trainer.sft_on_pretrained: .*sft_warmup_steps=1200.*Fix: set "
                                              r"trainer.sft_warmup_steps=0"):
            check_warm_start(cfg)
        check_warm_start(load_config([given, "trainer.sft_on_pretrained=true"]))
        check_warm_start(load_config([given, "trainer.sft_warmup_steps=0"]))
    from dapo_mega.trainer import run_training

    with pytest.raises(ConfigError, match="trainer.sft_on_pretrained"):  # before any rank or engine starts
        run_training(load_config([f"model.hf_path={tmp_path}"]))
    with pytest.raises(ConfigError, match="trainer.sft_warmup_steps"):
        load_config(["trainer.sft_warmup_steps=-1"])


def test_the_warm_start_says_what_it_does_before_it_starts(monkeypatch):
    import dapo_mega.session
    import dapo_mega.trainer as trainer

    said = []

    class Stop(Exception):
        pass

    def warm_start():
        raise Stop

    fake = SimpleNamespace(role=SimpleNamespace(say=lambda message, error=False: said.append(message)),
                           run=SimpleNamespace(state=SimpleNamespace(step=0), resumed=False),
                           warm_start=warm_start, close=lambda: None)
    monkeypatch.setattr(dapo_mega.session.Session, "start", classmethod(lambda cls, cfg: fake))
    monkeypatch.setattr(trainer, "keep_freed_memory", lambda: None)
    with pytest.raises(Stop):
        trainer.train(load_config([]))
    assert said == ["[warm start] 1200 supervised steps x 64 reference answers at lr 0.003 on tiny-qwen2 before "
                    "RL step 1 (trainer.sft_warmup_steps=0: none)"]


def test_plan_prints_the_ledger_bytes_per_step_by_text_setting(capsys):
    from dapo_mega.cli import main as cli_main

    figures = {}
    for mode in ("none", "head_tail", "full"):
        assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", f"trainer.ledger_text={mode}", "--json"]) == 0
        import json

        figures[mode] = json.loads(capsys.readouterr().out)["ledger"]["bytes_per_step"]
    # 1536 prompts x 16 samples per round; full text of ~4,000-token answers is ~100 MB
    assert figures["none"] < figures["head_tail"] < figures["full"]
    assert 1536 * 16 * 20 < figures["none"] and 50e6 < figures["full"] < 500e6


@pytest.mark.parametrize("experiment", ["dapo_qwen2.5_32b", "dapo_qwen2.5_32b_disagg", "tiny_cpu_slurm"])
def test_an_engine_start_reads_its_bound_without_running_the_planner(experiment, monkeypatch):
    from dapo_mega.plan import clock

    cfg = load_config([f"+experiment={experiment}", "rollout.health_timeout_s=0"])
    expected = estimate_clock(cfg).engine_start_timeout_s  # the plan's own figure

    def no_planner(*args, **kwargs):
        raise AssertionError("an engine start ran the whole memory planner")

    monkeypatch.setattr(clock, "compute_plan", no_planner)
    assert resolve_health_timeout_s(cfg) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["dapo_qwen2.5_32b", "dapo_qwen2.5_32b_disagg"])
@pytest.mark.parametrize("chain", [1, 5, 18, 100])
def test_a_training_link_trains_its_share_before_its_stop_signal(name, chain):
    """The link's --time minus the stop signal's lead (when the learners save and stop) still
    holds the start, the engines and its share of the steps at the clock's own step time."""
    from dapo_mega.plan.clock import training_link_limit_s

    cfg = load_config([f"+experiment={name}"])
    clock = estimate_clock(cfg).to_dict()
    limit = training_link_limit_s(clock, cfg.trainer.total_steps, chain)
    steps = math.ceil(cfg.trainer.total_steps / chain)
    training = limit - clock["stop_signal_lead_s"] - clock["assumptions"]["stage_overhead_s"] - clock["engine_start_s"]
    assert clock["stop_signal_lead_s"] > 0 and training >= steps * clock["step_s"], (training, steps, clock["step_s"])
