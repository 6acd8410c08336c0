"""Colocated weight hand-over: no NCCL group with the engines.

The learner rank on each engine TP rank's GPU makes that rank's payload from a bucket the
stage's source broadcast over the learners' own group; each engine's poster sends one
request with a payload per TP rank. On a CPU the payloads are shared-memory files (the
embedded engine's format); the flow — stages in turn, cross-stage broadcast, gather to the
poster, version on the last bucket — is the GPU one. Checked here with PP 2 learners (gloo)
and two embedded engines whose posters are ranks of different stages: both engines end
bit-identical to the learner's HF export.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from dist_helpers import run_distributed
from test_sync_learner_engines import _engine_view, assert_engines_serve_export, trained_learner

from dapo_mega.backends.megatron.layout import ParallelLayout
from dapo_mega.backends.placement import ClusterShape, place
from dapo_mega.config import RolloutConfig, load_config
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.weights.handover import HandoverPlan


def test_plan_of_each_rank_follows_the_placement():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b"])  # engine 6 on node 3 GPUs 0-3 = learner ranks 24-27
    placement = place(cfg, ClusterShape.from_config(cfg, use_gpu=True))
    ipc = {e.index: e.ipc_ranks for e in placement.engines}
    assert HandoverPlan.for_rank(24, ipc).holds == [(6, 0)] and HandoverPlan.for_rank(24, ipc).posts == [6]
    assert HandoverPlan.for_rank(27, ipc).holds == [(6, 3)] and HandoverPlan.for_rank(27, ipc).posts == []
    every = [h for rank in range(128) for h in HandoverPlan.for_rank(rank, ipc).holds]
    assert sorted(every) == [(e, t) for e in range(32) for t in range(4)]  # each engine TP rank once
    layout = ParallelLayout.from_config(cfg.megatron, world_size=128)
    assert [layout.stage_source_rank(s) for s in (0, 1)] == [lp.rank for lp in placement.weight_sources()]
    with pytest.raises(ValueError, match="engine 3 has no learner rank"):
        HandoverPlan.for_rank(0, {3: ()})


def _learner_handover(rank, world, tp, pp, model_dir, engine_urls, ipc_ranks, export_dir):
    from dapo_mega.weights.convert import export_learner_to_hf
    from dapo_mega.weights.handover import HandoverPlan, sync_colocated_learner_weights
    from dapo_mega.weights.sync import WeightSyncer

    learner, layout = trained_learner(world, tp, pp, model_dir)
    plan = HandoverPlan.for_rank(rank, ipc_ranks)
    posters = {e: WeightSyncer([engine_urls[e]], mode="colocated", timeout_s=120) for e in plan.posts}
    driver = WeightSyncer(engine_urls, mode="colocated", timeout_s=120) if rank == 0 else None
    stats = sync_colocated_learner_weights(driver, posters, learner.model_chunks, learner.info, layout, "9", plan,
                                           bucket_bytes=20_000, device=torch.device("cpu"))
    export_learner_to_hf(learner.model_chunks, learner.info, layout, export_dir)
    for syncer in [*posters.values(), driver]:
        if syncer is not None:
            syncer.close()
    return plan.posts, None if stats is None else (stats.num_tensors, stats.num_buckets)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models(5)


def test_pp2_handover_into_two_engines_bit_identical_to_export(model_dir, tmp_path):
    from safetensors.torch import load_file

    with EngineFleet(RolloutConfig(), str(model_dir), tmp_path / "logs", num_threads=1) as fleet:
        urls = [e.url for e in fleet.start(2)]
        export_dir = tmp_path / "export"
        # engine 0 "on rank 0's GPU" (stage 0), engine 1 on rank 1's (stage 1): engine 1 gets
        # stage 0's weights from rank 1, through the learners' broadcast
        results = run_distributed(_learner_handover, 2, args=(1, 2, str(model_dir), urls, {0: (0,), 1: (1,)},
                                                              str(export_dir)), timeout_s=400)
        assert [posts for posts, _ in results] == [[0], [1]]
        exported = {}
        for shard in export_dir.glob("*.safetensors"):
            exported.update(load_file(str(shard)))
        assert sum(s[0] for _, s in results if s is not None) == len(exported)
        assert all(s is not None and s[1] > 1 for _, s in results), "each stage sent several buckets"
        assert_engines_serve_export(urls, model_dir, exported, "9")


def _handover_with_a_dead_engine(rank, world, tp, pp, model_dir, engine_urls, ipc_ranks, dead_url):
    from dapo_mega.weights.handover import HandoverPlan, drop_dead_posters, sync_colocated_learner_weights
    from dapo_mega.weights.sync import WeightSyncer

    learner, layout = trained_learner(world, tp, pp, model_dir)
    plan = HandoverPlan.for_rank(rank, ipc_ranks)
    posters = {e: WeightSyncer([engine_urls[e]], mode="colocated", timeout_s=120) for e in plan.posts}
    driver = WeightSyncer(engine_urls, mode="colocated", timeout_s=120) if rank == 0 else None
    # what PolicySync.drop_dead_engines does on every rank once the rollout manager found it dead
    dropped = drop_dead_posters(posters, [dead_url])
    if driver is not None:
        driver.drop_engines([dead_url])
    sync_colocated_learner_weights(driver, posters, learner.model_chunks, learner.info, layout, "4", plan,
                                   bucket_bytes=20_000, device=torch.device("cpu"))
    for syncer in [*posters.values(), driver]:
        if syncer is not None:
            syncer.close()
    return dropped, sorted(posters)


def test_handover_goes_on_without_an_engine_found_dead(model_dir, tmp_path):
    """The rank that posts for a dead engine stops posting; every other engine still gets
    the whole update (without the drop, that rank's post fails and the hand-over raises on
    every rank)."""
    with EngineFleet(RolloutConfig(), str(model_dir), tmp_path / "logs", num_threads=1) as fleet:
        urls = [e.url for e in fleet.start(2)]
        fleet.kill(1)
        results = run_distributed(_handover_with_a_dead_engine, 2,
                                  args=(1, 2, str(model_dir), urls, {0: (0,), 1: (1,)}, urls[1]), timeout_s=400)
        assert results == [([], [0]), ([urls[1]], [])]
        weights, version, sample = asyncio.run(_engine_view(urls[0], ["lm_head.weight"]))
        assert version == "4" and sample.versions == ["4"]


def _handover_into_dead_engines(rank, world, model_dir, urls, ipc_ranks, dead_driver):
    """Both engines dead: at the driver's pause (`dead_driver`), else at rank 1's post. What
    each rank raises (a rank left waiting in a collective fails the run's timeout instead)."""
    from dapo_mega.weights.handover import HandoverPlan, sync_colocated_learner_weights
    from dapo_mega.weights.sync import EngineLostError, WeightSyncer

    learner, layout = trained_learner(world, 1, 2, model_dir)
    plan = HandoverPlan.for_rank(rank, ipc_ranks)
    posters = {e: WeightSyncer([urls[e]], mode="colocated", timeout_s=30) for e in plan.posts}
    driver = WeightSyncer(urls if dead_driver else [], mode="colocated", timeout_s=30) if rank == 0 else None
    try:
        sync_colocated_learner_weights(driver, posters, learner.model_chunks, learner.info, layout, "9", plan,
                                       bucket_bytes=20_000, device=torch.device("cpu"))
    except EngineLostError as exc:
        return "lost", sorted(exc.lost)
    except Exception as exc:  # noqa: BLE001 - the test names what was raised
        return type(exc).__name__, str(exc)
    finally:
        for syncer in [*posters.values(), driver]:
            if syncer is not None:
                syncer.close()
    return "no error", []


@pytest.mark.parametrize("where", ["pause", "post"])
def test_an_engine_lost_in_the_hand_over_is_lost_on_every_rank(where, model_dir, tmp_path):
    """An engine gone at the driver's pause (rank 0 only calls it) or at one rank's post is an
    EngineLostError on every rank, naming it, which `PolicySync.push` drops and syncs again
    past: not rank 0 alone raising while rank 1 waits at the barrier, nor a plain
    WeightSyncError that `push` does not catch (issue #37, item 2)."""
    with EngineFleet(RolloutConfig(), str(model_dir), tmp_path / "logs", num_threads=1) as fleet:
        urls = [e.url for e in fleet.start(1)]
        fleet.kill(0)
        results = run_distributed(_handover_into_dead_engines, 2,
                                  args=(str(model_dir), urls, {0: (1,)}, where == "pause"), timeout_s=300)
    assert results == [("lost", urls), ("lost", urls)], results
