"""Training checkpoints: run-directory mechanics (run_files/checkpoints.py), and save / stop / resume of a real learner.

The resume test runs the MegatronLearner (2 gloo ranks, DP=2, distributed optimizer) in
two separate process groups: the first trains 3 steps straight and saves after step 1;
the second starts fresh, resumes from the run directory and trains steps 2–3. Losses and
final weights must match the straight run, and the restored model + optimizer state must
equal what was saved. A resume at another TP / PP continues to the straight run's weights
when the optimizer state was saved fully_reshardable, and is refused before anything is read
when it was saved dp_reshardable.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from dist_helpers import make_config, make_samples
from helpers.checkpoints import fake_checkpoint

from dapo_mega.backends.megatron import checkpoint as C
from dapo_mega.run_files import checkpoints as R
from dapo_mega.weights.spawn import spawn_gloo


def test_latest_pointer_tmp_dirs_and_dangling_latest(tmp_path):
    root = tmp_path / "checkpoints"
    assert R.find_latest_checkpoint(tmp_path) is None
    fake_checkpoint(root, 3)
    fake_checkpoint(root, 7)
    (root / "step_000009.tmp-4242" / R.MODEL_OPTIM_DIR).mkdir(parents=True)  # interrupted save
    fake_checkpoint(root, 8, complete=False)  # renamed but missing trainer state: not trusted
    assert R.find_latest_checkpoint(tmp_path).name == "step_000007"
    (root / R.LATEST_FILE).write_text("step_000003\n")
    assert R.find_latest_checkpoint(tmp_path).name == "step_000003", "latest is followed when valid"
    (root / R.LATEST_FILE).write_text("step_000011\n")  # dangling
    assert R.find_latest_checkpoint(tmp_path).name == "step_000007"
    assert R.resolve_checkpoint_dir(root / R.LATEST_FILE).name == "step_000007"
    with pytest.raises(R.CheckpointNotFoundError):
        R.resolve_checkpoint_dir(tmp_path / "other_run")


def test_prune_keeps_last_k_and_never_the_latest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        fake_checkpoint(root, step)
    (root / "step_000005.tmp-1").mkdir()
    R.write_text_atomic(root / R.LATEST_FILE, "step_000004\n")
    R.prune_checkpoints(tmp_path, keep_last_k=2)
    assert sorted(p.name for p in root.iterdir()) == [R.LATEST_FILE, "step_000003", "step_000004"]
    R.write_text_atomic(root / R.LATEST_FILE, "step_000003\n")
    R.prune_checkpoints(tmp_path, keep_last_k=1)
    assert sorted(p.name for p in root.iterdir()) == [R.LATEST_FILE, "step_000003", "step_000004"], \
        "the newest K and the checkpoint `latest` names both survive pruning"


def test_keep_every_keeps_the_multiples_beside_the_last_k(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 9):
        fake_checkpoint(root, step)
    R.write_text_atomic(root / R.LATEST_FILE, "step_000008\n")
    R.prune_checkpoints(tmp_path, keep_last_k=2, keep_every=3)
    assert [p.name for p in R.list_complete_checkpoints(tmp_path)] == \
        ["step_000003", "step_000006", "step_000007", "step_000008"]


def test_a_restart_from_a_named_step_sets_the_later_steps_aside_once(tmp_path):
    """trainer.resume_step: exactly that checkpoint (an absent one is refused, naming the
    steps there are); the later checkpoints, ledger shards, eval files and metrics move to
    set_aside/ (nothing lost); a later start with the same setting goes on from the latest."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, step)
    R.write_text_atomic(root / R.LATEST_FILE, "step_000006\n")
    for sub, name in (("ledger", "step_000003.parquet"), ("ledger", "step_000005.parquet"),
                      ("eval", "step_000006.json")):
        (tmp_path / sub).mkdir(exist_ok=True)
        (tmp_path / sub / name).write_text(name)
    (tmp_path / "metrics.jsonl").write_text('{"step": 6}\n')
    with pytest.raises(R.CheckpointNotFoundError, match=r"resume_step=3.*steps \[2, 4, 6\]"):
        R.resume_checkpoint(tmp_path, True, 3)
    assert R.resume_checkpoint(tmp_path, False, 2) is None
    assert R.resume_checkpoint(tmp_path, True, 0).name == "step_000006"
    assert R.resume_checkpoint(tmp_path, True, 2).name == "step_000002"
    kept = R.set_aside_after(tmp_path, 2, "after_step_2")
    assert kept == tmp_path / "set_aside" / "after_step_2"
    records = sorted(str(p.relative_to(kept)) for p in kept.rglob("*")
                     if p.is_file() and p.relative_to(kept).parts[0] != "checkpoints")
    assert records == ["eval/step_000006.json", "ledger/step_000003.parquet", "ledger/step_000005.parquet",
                       "metrics.jsonl"]
    assert [p.name for p in R.list_complete_checkpoints(kept)] == ["step_000004", "step_000006"]
    assert [p.name for p in R.list_complete_checkpoints(tmp_path)] == ["step_000002"]
    assert not list((tmp_path / "ledger").iterdir()) and R.find_latest_checkpoint(tmp_path).name == "step_000002"
    fake_checkpoint(root, 3)  # the restarted run saves step 3; its next start goes on from there
    R.write_text_atomic(root / R.LATEST_FILE, "step_000003\n")
    assert R.resume_checkpoint(tmp_path, True, 2).name == "step_000003"


# --------------------------------------------------------------------------- learner


def _learner(world, tp=1, pp=1, optimizer_sharding="dp_reshardable", ep=None):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config(tp=tp, pp=pp, train_batch_size=2, mini_batch_size=1, n=4, lr=1e-2)
    cfg.megatron.use_distributed_optimizer = True
    cfg.megatron.optimizer_sharding = optimizer_sharding
    cfg.algo.lr_warmup_steps = 3  # the LR schedule position must survive the resume too
    cfg.megatron.expert_model_parallel_size = ep or 1  # ep None: the dense model; a number: the mixture
    hf = tiny_hf_config(cfg.model, architecture="qwen3_moe" if ep else "qwen2")
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    return MegatronLearner(cfg, hf, layout)


def _snapshot(learner):
    """Full HF weights (every rank, gathered) and this rank's Adam state tensors."""
    import torch

    from dapo_mega.weights.stream import iter_megatron_to_hf

    weights = {n: t.clone() for n, t in iter_megatron_to_hf(learner.model_chunks, learner.info, learner.layout)}
    adam = []
    inner = learner.optimizer
    for opt in getattr(inner, "chained_optimizers", [inner]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                st = opt.optimizer.state.get(p, {})
                adam.append([st[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in st] + [p.detach().clone()]
                            + [torch.as_tensor(st.get("step", -1.0)).clone()])
    return {"weights": weights, "adam": adam, "sched": learner.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state()}


def _straight_run(rank, world, run_dir):
    import torch

    learner = _learner(world)
    losses, saved = [], None
    for step in (1, 2, 3):
        losses.append(learner.train_step(make_samples(seed=step))["loss/pg"])
        if step == 1:
            torch.manual_seed(123 + rank)  # an RNG state that must come back on resume
            C.save_checkpoint(learner, run_dir, step, {"policy_version": 1, "data_cursor": {"epoch": 0, "index": 8},
                                                       "dynamic_sampling_carry": [[1, 2], {"g": 3}],
                                                       "wandb_run_id": "abc123"}, keep_last_k=2)
            saved = _snapshot(learner)
            torch.manual_seed(999)
    # A later save that hits a full disk must leave step 1 and `latest` intact.
    original = C.save_dist_checkpoint

    def disk_full(state, ckpt_dir):
        raise OSError(errno.ENOSPC, "No space left on device")

    C.save_dist_checkpoint = disk_full
    try:
        C.save_checkpoint(learner, run_dir, 3, {"policy_version": 3}, keep_last_k=2)
        enospc = None
    except R.CheckpointSaveError as exc:
        enospc = str(exc)
    finally:
        C.save_dist_checkpoint = original
    return {"losses": losses, "saved": saved, "final": _snapshot(learner)["weights"], "enospc": enospc}


def _resumed_run(rank, world, run_dir):

    learner = _learner(world)
    state = C.load_checkpoint(learner, run_dir)
    restored = _snapshot(learner)
    losses = [learner.train_step(make_samples(seed=step))["loss/pg"] for step in range(state["step"] + 1, 4)]
    return {"state": state, "restored": restored, "losses": losses, "final": _snapshot(learner)["weights"]}


@pytest.mark.slow
def test_save_stop_resume_equals_straight_training(tmp_path):
    import torch

    run_dir = str(tmp_path / "run")
    # spawn_gloo, not dist_helpers.run_distributed: dist_checkpointing.save starts helper
    # processes, which daemonic processes may not do.
    straight = spawn_gloo(_straight_run, 2, args=(run_dir,), timeout_s=240)
    ckpts = Path(run_dir) / "checkpoints"
    assert (ckpts / R.LATEST_FILE).read_text().strip() == "step_000001"
    assert sorted(p.name for p in ckpts.iterdir()) == [R.LATEST_FILE, "step_000001"], \
        "the failed save left its tmp dir behind"
    assert "ENOSPC" in straight[0]["enospc"] and "intact" in straight[0]["enospc"]
    # An interrupted later save and a half-renamed dir must both be ignored on resume.
    (ckpts / "step_000002.tmp-31337" / R.MODEL_OPTIM_DIR).mkdir(parents=True)
    (ckpts / "step_000002.tmp-31337" / R.TRAINER_STATE_FILE).write_text("{")
    (ckpts / "step_000003").mkdir()

    resumed = spawn_gloo(_resumed_run, 2, args=(run_dir,), timeout_s=240)
    for rank in range(2):
        s, r = straight[rank], resumed[rank]
        assert r["state"]["step"] == 1 and r["state"]["policy_version"] == 1
        assert r["state"]["data_cursor"] == {"epoch": 0, "index": 8}
        assert r["state"]["dynamic_sampling_carry"] == [[1, 2], {"g": 3}]
        assert r["state"]["wandb_run_id"] == "abc123"
        saved, restored = s["saved"], r["restored"]
        assert saved["weights"].keys() == restored["weights"].keys()
        for name in saved["weights"]:
            assert torch.equal(saved["weights"][name], restored["weights"][name]), name
        assert len(saved["adam"]) == len(restored["adam"]) > 0
        for a, b in zip(saved["adam"], restored["adam"]):
            assert len(a) == len(b) == 4, "Adam moments + fp32 main param + step per shard"
            assert a[3].item() == b[3].item() == 2.0, "Adam step count (bias correction) restored"
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert restored["sched"] == saved["sched"] and saved["sched"]["num_updates"] > 0
        assert torch.equal(restored["torch_rng"], saved["torch_rng"])
        assert r["losses"] == pytest.approx(s["losses"][1:], abs=1e-6)
        for name, tensor in s["final"].items():
            assert torch.allclose(tensor, r["final"][name], atol=1e-6, rtol=0), name


# --------------------------------------------------------------------------- another layout


def _save_after_one_step(rank, world, run_dir, sharding, ep=None):
    learner = _learner(world, optimizer_sharding=sharding, ep=ep)
    learner.train_step(make_samples(seed=1))
    C.save_checkpoint(learner, run_dir, 1, {"policy_version": 1})
    learner.train_step(make_samples(seed=2))
    return _snapshot(learner)["weights"]


def _resume_and_step(rank, world, run_dir, tp, pp, load_optimizer=True, ep=None):
    learner = _learner(world, tp=tp, pp=pp, optimizer_sharding="fully_reshardable", ep=ep)
    try:
        C.load_checkpoint(learner, run_dir, load_optimizer=load_optimizer)
    except C.CheckpointLayoutError as exc:
        return {"refused": str(exc), "untouched": _snapshot(learner)["weights"]}
    learner.train_step(make_samples(seed=2))
    return {"weights": _snapshot(learner)["weights"]}


@pytest.mark.slow
def test_resume_at_another_tp_or_pp_with_fully_reshardable_optimizer_state(tmp_path):
    """Saved at DP 2 (TP 1) after one step; resumed at TP 2 and at PP 2 (DP 1), the second
    step ends at the weights of the straight run: Adam's moments and step count moved with
    the weights. A fresh optimizer instead (the weights alone) ends elsewhere: the
    comparison can tell."""
    import torch

    run_dir = str(tmp_path / "full")
    straight = spawn_gloo(_save_after_one_step, 2, args=(run_dir, "fully_reshardable"), timeout_s=240)[0]
    state = json.loads((Path(run_dir) / "checkpoints" / "step_000001" / R.TRAINER_STATE_FILE).read_text())
    assert state["optimizer_sharding"] == "fully_reshardable"
    assert state["learner_layout"] == {"tp": 1, "pp": 1, "vpp": None, "dp": 2, "ep": 1}
    for tp, pp in ((2, 1), (1, 2)):
        resumed = _union(r["weights"] for r in spawn_gloo(_resume_and_step, 2, args=(run_dir, tp, pp), timeout_s=240))
        assert resumed.keys() == straight.keys(), (tp, pp)
        for name, tensor in straight.items():
            # 1e-5: the key biases' gradient is zero up to rounding, and Adam scales that noise up
            torch.testing.assert_close(resumed[name], tensor, atol=1e-5, rtol=1e-5, msg=f"TP {tp} PP {pp}: {name}")
    fresh = _union(r["weights"] for r in spawn_gloo(_resume_and_step, 2, args=(run_dir, 2, 1, False), timeout_s=240))
    assert max((fresh[n] - straight[n]).abs().max().item() for n in straight) > 1e-3


@pytest.mark.slow
def test_a_mixture_saved_at_ep2_resumes_at_ep1_with_its_optimizer_state(tmp_path):
    """A mixture at EP 2 keeps its experts' Adam state in an expert optimizer beside the dense
    one (megatron's ChainedOptimizer); at EP 1 there is one. Saved fully_reshardable at EP 2
    after one step, resumed at EP 1 (DP 2), the second step ends at the straight run's
    weights; the weights alone (a fresh optimizer) end elsewhere."""
    import torch

    run_dir = str(tmp_path / "moe")
    straight = _union(spawn_gloo(_save_after_one_step, 2, args=(run_dir, "fully_reshardable", 2), timeout_s=240))
    state = json.loads((Path(run_dir) / "checkpoints" / "step_000001" / R.TRAINER_STATE_FILE).read_text())
    assert state["learner_layout"]["ep"] == 2
    assert any(".mlp.experts." in n for n in straight), "the tiny mixture has experts"
    resumed = _union(r["weights"] for r in spawn_gloo(_resume_and_step, 2, args=(run_dir, 1, 1, True, 1),
                                                      timeout_s=240))
    assert resumed.keys() == straight.keys()
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-5, rtol=1e-5, msg=f"EP 1: {name}")
    fresh = _union(r["weights"] for r in spawn_gloo(_resume_and_step, 2, args=(run_dir, 1, 1, False, 1),
                                                    timeout_s=240))
    assert max((fresh[n] - straight[n]).abs().max().item() for n in straight if ".experts." in n) > 1e-3


def test_optimizer_state_is_regrouped_to_the_live_chain_both_ways():
    """The state dist_checkpointing hands back when the saved and live optimizers differ in
    number (the test above runs EP 2 -> EP 1 for real): each live sub-optimizer gets its own
    param groups at the saved step, its own parameter state, the saved sharding type."""
    def common(lr, step=0.0):
        return {"optimizer": {"param_groups": [{"lr": lr, "step": step}]}, "param_state_sharding_type": "x"}

    one, two = {"p": "dense and experts"}, ({"p": "dense"}, {"p": "experts"})
    # saved at EP 2 (two parts, step 3), live at EP 1
    loaded = {0: common(1.0, 3.0), 1: common(1.0, 3.0), "param_state": one}
    out = C._regroup_optimizer_state(loaded, [common(0.5)])
    assert out == {"optimizer": {"param_groups": [{"lr": 0.5, "step": 3.0}]}, "param_state": one,
                   "param_state_sharding_type": "x"}
    # saved at EP 1, live at EP 2
    loaded = {**common(1.0, 3.0), 0: {"param_state": two[0]}, 1: {"param_state": two[1]}}
    out = C._regroup_optimizer_state(loaded, [common(0.5), common(0.25)])
    assert out[0]["param_state"] is two[0] and out[1]["param_state"] is two[1]
    assert [o["optimizer"]["param_groups"][0] for o in out.values()] == [{"lr": 0.5, "step": 3.0},
                                                                        {"lr": 0.25, "step": 3.0}]
    same = dict(common(1.0, 3.0), param_state=one)
    assert C._regroup_optimizer_state(same, [common(0.5)]) is same  # the same chain: as loaded
    with pytest.raises(C.CheckpointLayoutError, match="steps"):
        C._regroup_optimizer_state({0: common(1.0, 3.0), 1: common(1.0, 2.0), "param_state": one}, [common(0.5)])


def test_resume_at_another_tp_with_dp_reshardable_state_is_refused_before_reading(tmp_path):
    import torch

    run_dir = str(tmp_path / "dp")
    spawn_gloo(_save_after_one_step, 2, args=(run_dir, "dp_reshardable"), timeout_s=240)
    out = spawn_gloo(_resume_and_step, 2, args=(run_dir, 2, 1), timeout_s=240)
    for rank in out:
        message = rank["refused"]
        assert "saved at TP 1 / PP 1 / DP 2 with megatron.optimizer_sharding=dp_reshardable" in message
        assert "this run is TP 2 / PP 1 / DP 1" in message and "Resume at TP 1 / PP 1 (any DP)" in message
        assert "optimizer_sharding=fully_reshardable" in message and "Nothing was loaded" in message
    # nothing was read: the weights are the fresh build's, not the checkpoint's
    built = spawn_gloo(_fresh_weights, 2, args=(2, 1), timeout_s=240)[0]
    for name, tensor in built.items():
        assert torch.equal(out[0]["untouched"][name], tensor), name


def _union(per_rank):
    """One {HF name: tensor} from each rank's (a pipeline stage's rank has its own layers)."""
    merged = {}
    for weights in per_rank:
        merged.update(weights)
    return merged


def _fresh_weights(rank, world, tp, pp):
    return _snapshot(_learner(world, tp=tp, pp=pp))["weights"]
