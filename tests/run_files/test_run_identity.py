"""A run's identity in its directory: a unique run id kept across resumes, and one change at
a time (a resume that changes what shapes the data or the update stops, unless allowed by
name; an allowed change is kept in the history). End to end with the real trainer:
tests/trainer/test_trainer_resume.py."""

import dataclasses
import json

import pytest
from helpers.checkpoints import fake_checkpoint

from dapo_mega.config import AlgoConfig, ConfigError, DapoConfig, TrainerConfig
from dapo_mega.records.curves import plot_curves
from dapo_mega.records.ledger_report import config_changes_line
from dapo_mega.run_files.identity import (
    ABSENT,
    ConfigChange,
    ConfigChangeRefused,
    compare_configs,
    config_dict,
    history_of_current_run,
    read_config_history,
    read_run_id,
    run_id_of_path,
    settle_run_dir,
)

OLD = {"algo": {"verifier": "dapo", "lr": 1e-6}, "data": {"prompt_template": "raw"},
       "trainer": {"total_steps": 10, "allow_changes": []}}


def _with(tree, **dotted):
    out = json.loads(json.dumps(tree))
    for path, value in dotted.items():
        group, name = path.split("__")
        out[group][name] = value
    return out


def test_no_change_and_free_changes_pass():
    assert compare_configs(OLD, OLD) == []
    changes = compare_configs(OLD, _with(OLD, trainer__total_steps=20))
    assert changes == [ConfigChange("trainer.total_steps", 10, 20, shapes_training=False)]


def test_a_guarded_change_is_refused_naming_the_field_and_both_values():
    with pytest.raises(ConfigChangeRefused) as info:
        compare_configs(OLD, _with(OLD, algo__verifier="math_verify", trainer__total_steps=20))
    message = str(info.value)
    assert message.startswith("algo.verifier:")
    assert 'algo.verifier "dapo" -> "math_verify"' in message
    assert "trainer.allow_changes=[algo.verifier]" in message and "total_steps" not in message
    with pytest.raises(ConfigChangeRefused) as info:  # every refused field is named, in one message
        compare_configs(OLD, _with(_with(OLD, algo__verifier="math_verify"), data__prompt_template="dapo"))
    assert 'data.prompt_template "raw" -> "dapo"' in str(info.value)
    assert "trainer.allow_changes=[algo.verifier,data.prompt_template]" in str(info.value)


def test_an_allowed_change_passes_by_field_or_group():
    new = _with(OLD, algo__verifier="math_verify")
    change = ConfigChange("algo.verifier", "dapo", "math_verify", shapes_training=True)
    assert compare_configs(OLD, new, ["algo.verifier"]) == [change]
    assert compare_configs(OLD, new, ["algo"]) == [change]
    with pytest.raises(ConfigChangeRefused):
        compare_configs(OLD, _with(new, algo__lr=1e-5), ["algo.verifier"])


def test_an_allowed_name_must_be_a_field():
    with pytest.raises(ConfigError, match="trainer.allow_changes: algo.verifer is no config field"):
        compare_configs(OLD, OLD, ["algo.verifer"])


def test_a_field_one_config_lacks_compares_as_absent():
    old = {"algo": {"verifier": "dapo"}, "trainer": {"gone": 1}}
    changes = compare_configs(old, {"algo": {"verifier": "dapo", "lr": 1.0}, "trainer": {}}, ["algo.lr"])
    assert changes == [ConfigChange("algo.lr", ABSENT, 1.0, True), ConfigChange("trainer.gone", 1, ABSENT, False)]


# ---------------------------------------------------------------------------- the run directory
def _cfg(tmp_path, run_name="run", **algo):
    return DapoConfig(algo=AlgoConfig(**algo), trainer=TrainerConfig(output_dir=str(tmp_path), run_name=run_name))


def test_fresh_runs_get_different_ids_and_a_resume_keeps_its_id(tmp_path):
    first = settle_run_dir(_cfg(tmp_path / "a", run_name="seed1"))
    second = settle_run_dir(_cfg(tmp_path / "b", run_name="seed1"))
    assert first.run_id != second.run_id
    assert first.run_id.startswith("seed1-") and not first.resumed
    run_dir = tmp_path / "a" / "seed1"
    assert read_run_id(run_dir) == first.run_id
    fake_checkpoint(run_dir / "checkpoints", 3)
    resumed = settle_run_dir(_cfg(tmp_path / "a", run_name="seed1"))
    assert (resumed.run_id, resumed.resumed, resumed.resume_step, resumed.changes) == (first.run_id, True, 3, [])
    assert run_id_of_path(run_dir / "checkpoints" / "step_000003") == first.run_id
    # a rank spawned by the parent that settled a fresh run inherits its id
    assert settle_run_dir(_cfg(tmp_path / "b", run_name="seed1"), inherited_run_id=second.run_id).run_id == \
        second.run_id


def test_a_rerun_from_scratch_is_another_run_and_keeps_the_old_config(tmp_path):
    cfg = _cfg(tmp_path)
    old = settle_run_dir(cfg)
    fake_checkpoint(cfg.run_dir / "checkpoints", 2)
    again = settle_run_dir(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume=False)))
    assert again.run_id != old.run_id and not again.resumed
    assert (cfg.run_dir / f"config.{old.run_id}.yaml").is_file()   # nothing already written is lost
    assert read_run_id(cfg.run_dir) == again.run_id


def test_a_refused_resume_writes_nothing(tmp_path):
    cfg = _cfg(tmp_path)
    identity = settle_run_dir(cfg)
    fake_checkpoint(cfg.run_dir / "checkpoints", 1)
    before = {p.name: p.read_bytes() for p in cfg.run_dir.iterdir() if p.is_file()}
    with pytest.raises(ConfigChangeRefused, match='algo.verifier "dapo" -> "math_verify"'):
        settle_run_dir(_cfg(tmp_path, verifier="math_verify"))
    assert {p.name: p.read_bytes() for p in cfg.run_dir.iterdir() if p.is_file()} == before
    assert read_run_id(cfg.run_dir) == identity.run_id


def test_an_allowed_resume_keeps_the_change_and_rewrites_the_config(tmp_path):
    cfg = _cfg(tmp_path)
    identity = settle_run_dir(cfg)
    fake_checkpoint(cfg.run_dir / "checkpoints", 4)
    new = _cfg(tmp_path, verifier="math_verify")
    new.trainer.allow_changes = ["algo.verifier"]
    resumed = settle_run_dir(new)
    assert resumed.run_id == identity.run_id
    guarded = [c for c in read_config_history(cfg.run_dir) if c["shapes_training"]]
    assert [(c["run_id"], c["step"], c["field"], c["old"], c["new"]) for c in guarded] == [
        (identity.run_id, 5, "algo.verifier", "dapo", "math_verify")]
    others = {c["field"] for c in read_config_history(cfg.run_dir) if not c["shapes_training"]}
    assert others == {"trainer.allow_changes"}
    assert "verifier: math_verify" in (cfg.run_dir / "config.yaml").read_text()
    assert config_dict(new)["algo"]["verifier"] == "math_verify"
    assert "config changes from step 5: algo.verifier \"dapo\" -> \"math_verify\" (allowed)" in \
        resumed.start_line(cfg.run_dir)
    # the same command again: nothing changes any more, nothing more is recorded
    assert settle_run_dir(new).changes == [] and len(read_config_history(cfg.run_dir)) == 2
    # the report's line and the plot's markers read the history
    line = config_changes_line(history_of_current_run(cfg.run_dir))
    assert 'step 5: algo.verifier "dapo" -> "math_verify"' in line
    (cfg.run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward_mean": 0.1 * s}) + "\n"
                                                       for s in range(1, 7)))
    assert plot_curves(cfg.run_dir).stat().st_size > 1000


def test_only_the_driver_writes(tmp_path):
    cfg = _cfg(tmp_path)
    settle_run_dir(cfg, write=False)
    assert not cfg.run_dir.exists()


def test_a_refused_resume_stops_before_learner_ranks_are_spawned(tmp_path, monkeypatch):
    """cluster.num_learner_processes > 1: the parent settles the run directory before torchrun."""
    from dapo_mega.config import load_config
    from dapo_mega.driver import learner_ranks

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(learner_ranks.subprocess, "call", lambda *a, **k: pytest.fail("ranks were spawned"))
    base = [f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "cluster.num_learner_processes=2"]
    cfg = load_config(base)
    identity = settle_run_dir(cfg)
    fake_checkpoint(cfg.run_dir / "checkpoints", 1)
    with pytest.raises(ConfigChangeRefused, match="algo.verifier"):
        learner_ranks.maybe_spawn_learners(load_config([*base, "algo.verifier=math_verify"]))
    seen = {}
    monkeypatch.setattr(learner_ranks.subprocess, "call", lambda argv, env: seen.update(env=env) or 0)
    assert learner_ranks.maybe_spawn_learners(load_config([*base, "trainer.total_steps=50"])) == 0
    assert seen["env"]["DAPO_MEGA_RUN_ID"] == identity.run_id   # the ranks keep the run's id
