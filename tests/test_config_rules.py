"""Every cross-field config rule fails before anything heavy, naming the field and the fix."""

import pytest

from dapo_mega.cli import main as cli_main
from dapo_mega.config import ConfigError, from_yaml, load_config, to_yaml, validate_config
from dapo_mega.run_files.identity import save_config

# (overrides, field named in the error)
BAD = [
    (["algo.clip_ratio_high=0.1"], "algo.clip_ratio_high"),
    (["algo.clip_ratio_low=1.5"], "algo.clip_ratio_low"),
    (["algo.clip_ratio_c=0.5"], "algo.clip_ratio_c"),
    (["algo.loss_agg_mode=seq-sum"], "algo.loss_agg_mode"),
    (["algo.n_samples_per_prompt=1"], "algo.n_samples_per_prompt"),
    (["algo.n_samples_per_prompt=0", "algo.dynamic_sampling=false"], "algo.n_samples_per_prompt"),
    (["algo.mini_batch_size=5"], "algo.mini_batch_size"),
    (["algo.train_batch_size=0"], "algo.train_batch_size"),
    (["algo.gen_batch_size=0"], "algo.gen_batch_size"),
    (["algo.dynamic_sampling=false", "algo.gen_batch_size=8"], "algo.gen_batch_size"),
    (["algo.max_num_gen_batches=-1"], "algo.max_num_gen_batches"),
    (["algo.max_response_length=4", "algo.overlong_buffer_length=4"], "algo.overlong_buffer_length"),
    (["algo.overlong_buffer_length=-1", "algo.overlong_buffer_enable=false"], "algo.overlong_buffer_length"),
    (["algo.max_response_length=0"], "algo.max_response_length"),
    (["algo.temperature=0"], "algo.temperature"),
    (["algo.top_p=0"], "algo.top_p"),
    (["algo.tis_cap=0"], "algo.tis_cap"),
    (["algo.off_policy_correction=seq_tis"], "algo.off_policy_correction"),
    (["algo.off_policy_correction=mis", "algo.tis_cap=2.0"], "algo.tis_cap"),
    (["algo.off_policy_correction=none", "algo.tis_cap=2.0"], "algo.tis_cap"),
    (["algo.off_policy_correction=tis"], "algo.off_policy_correction"),
    (["algo.off_policy_correction=geo_mask_tis"], "algo.off_policy_correction"),
    (["algo.off_policy_correction=icepop", "algo.use_engine_logprobs=true"], "algo.off_policy_correction"),
    (["algo.tis_cap=2.0", "algo.use_engine_logprobs=true"], "algo.off_policy_correction"),
    (["algo.mis_low=1.5"], "algo.mis_low"),
    (["algo.geo_mask_high=0.999"], "algo.geo_mask_low"),
    (["algo.icepop_low=0"], "algo.icepop_low"),
    (["algo.verifier=llm"], "algo.verifier"),
    (["eval.overlap=sometimes"], "eval.overlap"),
    (["eval.overlap=beside", "cluster.mode=colocated"], "eval.overlap"),
    (["algo.lr=0"], "algo.lr"),
    (["algo.lr_warmup_steps=-1"], "algo.lr_warmup_steps"),
    (["algo.grad_clip=-1"], "algo.grad_clip"),
    (["algo.on_nonfinite=ignore"], "algo.on_nonfinite"),
    (["data.prompt_template=chatml"], "data.prompt_template"),
    (["data.on_bad_row=warn"], "data.on_bad_row"),
    (["data.synthetic_min_digits=3", "data.synthetic_max_digits=2"], "data.synthetic_max_digits"),
    (["data.synthetic_ops=/"], "data.synthetic_ops"),
    (["data.synthetic_num_operands=1"], "data.synthetic_num_operands"),
    (["rollout.backend=vllm"], "rollout.backend"),
    (["rollout.num_engines=0"], "rollout.num_engines"),
    (["rollout.host=0.0.0.0"], "rollout.api_key"),
    (["rollout.weight_sync_bucket_mb=0"], "rollout.weight_sync_bucket_mb"),
    (["rollout.prompts_per_request=0"], "rollout.prompts_per_request"),
    (["rollout.requests_per_engine=0"], "rollout.requests_per_engine"),
    (["rollout.dtype=int8"], "rollout.dtype"),
    (["megatron.tensor_model_parallel_size=0"], "megatron.tensor_model_parallel_size"),
    (["megatron.pipeline_model_parallel_size=0"], "megatron.pipeline_model_parallel_size"),
    (["megatron.context_parallel_size=0"], "megatron.context_parallel_size"),
    (["megatron.expert_model_parallel_size=0"], "megatron.expert_model_parallel_size"),
    (["megatron.sequence_parallel=true"], "megatron.sequence_parallel"),
    (["megatron.virtual_pipeline_model_parallel_size=2"], "megatron.virtual_pipeline_model_parallel_size"),
    (["megatron.fp8.enabled=true", "megatron.transformer_impl=local"], "megatron.fp8.enabled"),
    (["megatron.fp8.format=e5m2"], "megatron.fp8.format"),
    (["megatron.fp8.recipe=mxfp8"], "megatron.fp8.recipe"),
    (["megatron.recompute_granularity=some"], "megatron.recompute_granularity"),
    (["megatron.recompute_granularity=full"], "megatron.recompute_method"),
    (["megatron.params_dtype=int8"], "megatron.params_dtype"),
    (["megatron.transformer_impl=apex"], "megatron.transformer_impl"),
    (["megatron.micro_batch_tokens=32"], "megatron.micro_batch_tokens"),
    (["cluster.mode=hybrid"], "cluster.mode"),
    (["cluster.max_staleness=-1", "cluster.mode=disaggregated"], "cluster.max_staleness"),
    (["cluster.max_staleness=1"], "cluster.max_staleness"),
    (["cluster.device=tpu"], "cluster.device"),
    (["cluster.num_learner_processes=0"], "cluster.num_learner_processes"),
    (["cluster.mode=disaggregated", "cluster.num_nodes=4", "cluster.engine_nodes=4"], "cluster.engine_nodes"),
    (["trainer.total_steps=-1"], "trainer.total_steps"),
    (["trainer.keep_last_k=0"], "trainer.keep_last_k"),
    (["trainer.wandb_mode=cloud"], "trainer.wandb_mode"),
    (["trainer.run_name=a/b"], "trainer.run_name"),
    (["eval.n_samples=0"], "eval.n_samples"),
    (["eval.top_p=2"], "eval.top_p"),
]


def test_default_config_is_valid():
    cfg = load_config([])
    assert cfg.algo.clip_ratio_low == 0.2 and cfg.algo.clip_ratio_high == 0.28
    assert cfg.rollout.backend == "embedded" and cfg.megatron.transformer_impl == "local"


def test_off_policy_correction_setting_tis_cap_alone_is_tis_and_contradictions_name_both_fields():
    assert load_config([]).algo.correction_mode() == "none"
    legacy = load_config(["algo.tis_cap=2.0"]).algo
    assert legacy.off_policy_correction is None and legacy.correction_mode() == "tis"
    assert load_config(["algo.off_policy_correction=tis", "algo.tis_cap=1.5"]).algo.correction_mode() == "tis"
    for mode in ("mis", "geo_mask", "icepop"):
        assert load_config([f"algo.off_policy_correction={mode}"]).algo.correction_mode() == mode
    both = load_config(["algo.off_policy_correction=geo_mask_tis", "algo.tis_cap=2.0"]).algo
    assert both.correction_mode() == "geo_mask_tis"
    with pytest.raises(ConfigError) as info:
        load_config(["algo.off_policy_correction=geo_mask", "algo.tis_cap=2.0"])
    message = str(info.value)
    assert "algo.tis_cap" in message and "algo.off_policy_correction=geo_mask" in message
    assert "Fix: set algo.tis_cap=null" in message


@pytest.mark.parametrize("overrides,field", BAD, ids=[b[1] + ":" + ",".join(b[0]) for b in BAD])
def test_rule_names_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    message = str(info.value)
    assert message.startswith(field + ":"), message
    assert "Fix:" in message


def test_world_size_rules():
    cfg = load_config(["megatron.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"^megatron.tensor_model_parallel_size:.*world size 3"):
        validate_config(cfg, world_size=3)
    validate_config(cfg, world_size=4)
    cfg = load_config(["algo.mini_batch_size=1", "algo.n_samples_per_prompt=3"])
    with pytest.raises(ConfigError, match=r"^algo.mini_batch_size:.*2 data-parallel"):
        validate_config(cfg, world_size=2)


def test_online_wandb_needs_key(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="^trainer.wandb_mode:.*WANDB_API_KEY"):
        load_config(["trainer.wandb_mode=online"])


def test_bad_override_names_key(capsys):
    with pytest.raises(ConfigError, match="algo.nonexistent"):
        load_config(["algo.nonexistent=3"])
    with pytest.raises(ConfigError, match="algo.lr"):
        load_config(["algo.lr=abc"])
    assert cli_main(["train", "algo.lr=abc"]) == 2
    assert "algo.lr" in capsys.readouterr().err


def test_yaml_round_trip(tmp_path):
    cfg = load_config(["algo.lr=3e-6", "trainer.run_name=x"])
    path = save_config(cfg, tmp_path / "run")
    again = from_yaml(path.read_text())
    assert again == cfg
    assert "lr: 3.0e-06" in to_yaml(cfg)


def test_cli_help_and_cfg(capsys):
    assert cli_main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "algo.clip_ratio_high = 0.28" in out and "Clip-Higher" in out
    assert cli_main(["train", "--cfg", "job", "algo.lr=5e-6"]) == 0
    assert "lr: 5.0e-06" in capsys.readouterr().out


def test_each_component_validates_its_own_rules_and_validate_config_composes_them(monkeypatch):
    from dapo_mega.config import AlgoConfig, ClusterConfig, DapoConfig, DataConfig, MegatronConfig, ModelConfig

    with pytest.raises(ConfigError, match=r"^algo.loss_agg_mode: unknown 'seq-sum'. Fix: use token-mean, "):
        AlgoConfig(loss_agg_mode="seq-sum").validate()
    with pytest.raises(ConfigError, match=r"^data.on_bad_row:"):
        DataConfig(on_bad_row="warn").validate()
    with pytest.raises(ConfigError, match=r"^cluster.mode:"):
        ClusterConfig(mode="hybrid").validate()
    with pytest.raises(ConfigError, match=r"^model.tiny_num_key_value_heads:"):
        ModelConfig(tiny_num_attention_heads=4, tiny_num_key_value_heads=3).validate()
    ModelConfig(hf_path="/some/model", tiny_num_key_value_heads=3).validate()  # tiny fields unused then
    with pytest.raises(ConfigError, match=r"^megatron.tensor_model_parallel_size:.*cluster.num_learner_processes=3"):
        MegatronConfig(tensor_model_parallel_size=3).check_world_size(1)
    assert MegatronConfig(tensor_model_parallel_size=2).check_world_size(8) == 4

    cfg = DapoConfig()
    cfg.algo.max_response_length, cfg.algo.overlong_buffer_length = 16, 4
    cfg.megatron.micro_batch_tokens = 4096
    seen = []
    for name in ("model", "algo", "data", "rollout", "megatron", "cluster", "trainer", "eval"):
        part = getattr(cfg, name)
        monkeypatch.setattr(type(part), "validate", lambda self, _n=name: seen.append(_n))
    validate_config(cfg)
    assert seen == ["model", "algo", "data", "rollout", "megatron", "cluster", "trainer", "eval"]


def test_choice_fields_are_str_for_omegaconf_and_checked_against_their_literal():
    """OmegaConf 2.3 rejects Literal annotations; the value sets are Literal aliases checked in validate()."""
    import typing

    from omegaconf import OmegaConf

    from dapo_mega import config as C

    @__import__("dataclasses").dataclass
    class WithLiteral:
        mode: typing.Literal["a", "b"] = "a"

    with pytest.raises(Exception, match="Unexpected type annotation"):
        OmegaConf.structured(WithLiteral)
    assert typing.get_args(C.ClusterMode) == ("colocated", "disaggregated")
    assert typing.get_args(C.LossAggMode) == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    for value in typing.get_args(C.RolloutBackend):
        load_config([f"rollout.backend={value}"])


def test_preflight_checks_layout_model_and_data_before_anything_is_built(tmp_path):
    import torch

    from dapo_mega.plan.preflight import check_before_start

    cfg = load_config([f"trainer.output_dir={tmp_path}"])
    check_before_start(cfg, world_size=1)
    cfg = load_config([f"trainer.output_dir={tmp_path}", "megatron.tensor_model_parallel_size=2"])
    check_before_start(cfg, world_size=2)
    cfg = load_config([f"trainer.output_dir={tmp_path}", "megatron.tensor_model_parallel_size=4",
                       "model.tiny_num_key_value_heads=2"])
    with pytest.raises(ConfigError, match=r"^megatron.tensor_model_parallel_size:.*num_key_value_heads"):
        check_before_start(cfg, world_size=4)
    cfg = load_config([f"trainer.output_dir={tmp_path}", f"model.hf_path={tmp_path / 'no_model'}"])
    with pytest.raises(ConfigError, match=r"^model.hf_path:.*config.json"):
        check_before_start(cfg, world_size=1)
    cfg = load_config([f"trainer.output_dir={tmp_path}", "megatron.context_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"^megatron.context_parallel_size:.*Fix: use 1"):
        check_before_start(cfg, world_size=2)
    if not torch.cuda.is_available():  # the model provider's choice on this machine, found before the build
        cfg = load_config([f"trainer.output_dir={tmp_path}", "megatron.params_dtype=bf16"])
        with pytest.raises(ConfigError, match=r"^megatron.params_dtype: bf16 on the CPU.*Fix:"):
            check_before_start(cfg, world_size=1)
    cfg = load_config([f"trainer.output_dir={tmp_path}", f"data.train_path={tmp_path / 'x.jsonl'}"])
    with pytest.raises(ConfigError, match=r"^data.train_path:.*x.jsonl.*Fix:"):
        check_before_start(cfg, world_size=1)
    assert list(tmp_path.iterdir()) == []


def test_eval_preflight_names_missing_inputs(tmp_path, capsys):
    from dapo_mega.plan.preflight import check_eval_inputs

    check_eval_inputs(load_config([]))  # synthetic task: its held-out split
    train = tmp_path / "train.jsonl"
    train.write_text('{"id": "q", "prompt": "1+1?", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"^data.eval_path: empty.*Fix:"):
        check_eval_inputs(load_config([f"data.train_path={train}"]))
    with pytest.raises(ConfigError, match=r"^eval.checkpoint:.*nope.*Fix:"):
        check_eval_inputs(load_config([f"eval.checkpoint={tmp_path / 'nope'}"]))
    assert cli_main(["eval", f"eval.checkpoint={tmp_path / 'nope'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dapo-mega: config error: eval.checkpoint:"), err


def test_learner_world_size_is_the_launchers_when_launched(monkeypatch):
    from dapo_mega.plan.preflight import learner_world_size

    cfg = load_config(["cluster.num_learner_processes=2"])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")  # without RANK this process is not a launched rank
    assert learner_world_size(cfg) == 2
    monkeypatch.setenv("RANK", "3")
    assert learner_world_size(cfg) == 16


def test_preflight_refuses_a_resume_whose_optimizer_state_cannot_load_at_this_layout(tmp_path):
    """The checkpoint a resume would load was saved at TP 1 with dp_reshardable optimizer state:
    a TP 2 run is refused in the preflight, naming both layouts and the fixes, before anything
    is built; DP may change; fully_reshardable state, or trainer.resume=false, goes through."""
    import json

    from dapo_mega.plan.preflight import check_before_start
    from dapo_mega.run_files import checkpoints as R

    base = [f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]
    cfg = load_config(base)
    step = R.checkpoints_root(cfg.run_dir) / R.step_dir_name(3)
    (step / R.MODEL_OPTIM_DIR).mkdir(parents=True)
    (step / R.MODEL_OPTIM_DIR / "metadata.json").write_text("{}")

    def saved_with(sharding):
        (step / R.TRAINER_STATE_FILE).write_text(json.dumps({
            "step": 3, "optimizer_sharding": sharding, "learner_layout": {"tp": 1, "pp": 1, "vpp": None, "dp": 2}}))

    saved_with("dp_reshardable")
    check_before_start(cfg, world_size=1)  # DP 2 -> 1: the state reshards over DP
    tp2 = load_config(base + ["megatron.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError) as err:
        check_before_start(tp2, world_size=2)
    message = str(err.value)
    assert message.startswith("megatron.tensor_model_parallel_size") and str(step) in message
    assert "saved at TP 1 / PP 1 / DP 2" in message and "this run is TP 2 / PP 1 / DP 1" in message
    assert "Resume at TP 1 / PP 1 (any DP)" in message and "optimizer_sharding=fully_reshardable" in message
    check_before_start(load_config(base + ["megatron.tensor_model_parallel_size=2", "trainer.resume=false"]),
                       world_size=2)
    saved_with("fully_reshardable")
    check_before_start(tp2, world_size=2)
    with pytest.raises(ConfigError, match=r"^megatron.optimizer_sharding: unknown 'zero3'"):
        load_config(base + ["megatron.optimizer_sharding=zero3"]).validate()


def test_sglang_is_refused_for_a_mixture_with_dense_layers(tmp_path):
    """SGLang 0.5.23 builds every Qwen3-MoE layer sparse and drops a dense layer's MLP weights:
    the preflight names the dense layers before an engine serves another model; a model whose
    every layer is sparse (Qwen3-30B-A3B's kind) passes, and the embedded engine takes both."""
    from sglang_venv import sglang_python_or_skip

    from dapo_mega.models.tiny import build_tiny_model_dir
    from dapo_mega.plan.preflight import check_before_start

    mixed = build_tiny_model_dir(tmp_path / "mixed", architecture="qwen3_moe", with_weights=False)
    sparse = build_tiny_model_dir(tmp_path / "sparse", architecture="qwen3_moe", with_weights=False, dense_layers=[])
    base = ["rollout.backend=sglang", f"rollout.engine_python={sglang_python_or_skip()}", "model.name=tiny-qwen3-moe"]
    with pytest.raises(ConfigError, match=r"^rollout.backend: SGLang 0.5.23 .* layers \[0\] are dense"):
        check_before_start(load_config(base + [f"model.hf_path={mixed}"]), world_size=1)
    check_before_start(load_config(base + [f"model.hf_path={sparse}"]), world_size=1)
    check_before_start(load_config([f"model.hf_path={mixed}", "model.name=tiny-qwen3-moe"]), world_size=1)


def test_dp_reshardable_state_resumes_only_at_its_ep_and_fully_reshardable_at_any():
    """dp_reshardable state is a flat buffer per DP rank: at another expert parallelism a
    mixture's experts sit in other buffers, so the preflight names the way out; the
    fully_reshardable state of the same layout loads (tests/backends/megatron/
    test_checkpoint_training.py resumes one at EP 1 from EP 2)."""
    from dapo_mega.backends.megatron.checkpoint import resume_layout_problem

    layout = {"tp": 1, "pp": 1, "vpp": None, "dp": 2, "ep": 2}
    saved = {"learner_layout": layout, "optimizer_sharding": "dp_reshardable"}
    problem = resume_layout_problem(saved, dict(layout, ep=1, dp=2), "ckpt/step_000002")
    assert problem and "saved at TP 1 / PP 1 / EP 2 / DP 2" in problem and "this run is TP 1 / PP 1 / DP 2" in problem
    assert "Resume at TP 1 / PP 1 / EP 2 (any DP)" in problem and "Nothing was loaded" in problem
    assert resume_layout_problem(saved, dict(layout, ep=4), "c") is not None
    assert resume_layout_problem(saved, dict(layout, dp=4), "c") is None
    assert resume_layout_problem(dict(saved, optimizer_sharding="fully_reshardable"), dict(layout, ep=1), "c") is None
    before_ep = {"learner_layout": {"tp": 1, "pp": 1, "vpp": None, "dp": 2}, "optimizer_sharding": "dp_reshardable"}
    assert resume_layout_problem(before_ep, dict(layout, ep=1), "c") is None  # before EP was recorded: 1


def test_eval_runs_beside_the_next_step_by_default_only_when_disaggregated():
    from dapo_mega.config import eval_beside

    assert not eval_beside(load_config(["cluster.mode=colocated"]))
    assert eval_beside(load_config(["cluster.mode=disaggregated"]))
    assert not eval_beside(load_config(["cluster.mode=disaggregated", "eval.overlap=inline"]))


def test_a_chat_template_without_one_is_refused_before_any_rank_starts(tmp_path):
    """The MoE twin's first Slurm job: every rank started, then the driver's encoder found the tiny
    tokenizer had no template and the other ranks died waiting (DistNetworkError). The preflight,
    which every rank runs before a process group forms, now says it in one line."""
    from dapo_mega.models.tiny import build_tiny_model_dir
    from dapo_mega.plan.preflight import check_chat_template

    with pytest.raises(ConfigError, match=r"^data.apply_chat_template: .*Fix: model.tiny_chat_template=true"):
        check_chat_template(load_config(["data.apply_chat_template=true"]))
    check_chat_template(load_config(["data.apply_chat_template=true", "model.tiny_chat_template=true"]))
    bare = build_tiny_model_dir(tmp_path / "bare", with_weights=False)  # an HF directory, its tokenizer without one
    with pytest.raises(ConfigError, match=r"^data.apply_chat_template: true, but the tokenizer"):
        check_chat_template(load_config(["data.apply_chat_template=true", f"model.hf_path={bare}"]))
    chat = build_tiny_model_dir(tmp_path / "chat", load_config(["model.tiny_chat_template=true"]).model, with_weights=False)
    check_chat_template(load_config(["data.apply_chat_template=true", f"model.hf_path={chat}"]))
