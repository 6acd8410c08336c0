"""The placement of every learner rank, engine and weight-sync group (GPU rules, checked on a CPU).

For every shipped experiment config, colocated and disaggregated, on one node and on many:
no process group holds two ranks on one GPU (NCCL: "Duplicate GPU detected"), no two
engines share a GPU, every engine has its own CUDA_VISIBLE_DEVICES, and on one node an
engine announces the address it binds. Learner coordinates are checked against
megatron-core's own RankGenerator (the reference, not our arithmetic).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_mega.backends.megatron.layout import ParallelLayout
from dapo_mega.backends.placement import (
    CUDA_IPC,
    DISTRIBUTED,
    SHARED_MEMORY,
    ClusterShape,
    Device,
    GroupMember,
    ProcessGroupPlan,
    place,
    visible_devices,
)
from dapo_mega.config import ConfigError, load_config
from dapo_mega.launch import compute_engine_slots, engine_addresses, job_shape

EXPERIMENTS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "configs" / "experiment").glob("*.yaml"))


def _layouts(name):
    """(label, overrides, num_nodes, engine_nodes) for colocated / disaggregated, one / many nodes."""
    cfg = load_config([f"+experiment={name}"])
    nodes = max(2, cfg.cluster.num_nodes)
    engine_nodes = cfg.cluster.engine_nodes or nodes // 2
    return [("colocated-1node", ["cluster.mode=colocated", "cluster.max_staleness=0", "cluster.num_nodes=1"], 1, 1),
            ("colocated-many", ["cluster.mode=colocated", "cluster.max_staleness=0", f"cluster.num_nodes={nodes}"],
             nodes, nodes),
            ("disagg-1node", ["cluster.mode=disaggregated", "cluster.max_staleness=0", "cluster.num_nodes=1",
                              "cluster.engine_nodes=0"], 1, 0),
            ("disagg-many", ["cluster.mode=disaggregated", "cluster.max_staleness=0",
                             f"cluster.num_nodes={nodes}", f"cluster.engine_nodes={engine_nodes}"], nodes, engine_nodes)]


def _placement(name, overrides, num_nodes, engine_nodes, use_gpu):
    cfg = load_config([f"+experiment={name}", *overrides])
    r = cfg.rollout
    if cfg.cluster.gpus_per_node < 2:  # tiny_cpu_slurm's one "GPU" per node: give it two
        cfg.cluster.gpus_per_node = 2
    gpus = cfg.cluster.gpus_per_node
    if num_nodes == 1:  # fit the run onto one node: engines and learners share or split its GPUs
        if cfg.cluster.mode == "colocated":
            learners, engines = gpus, max(1, gpus // r.engine_tp_size)
        else:
            learners = gpus // 2
            engines = max(1, (gpus - learners) // r.engine_tp_size)
        cfg.rollout.num_engines = engines
        cfg.cluster.num_learner_processes = learners
        m = cfg.megatron  # the model-parallel layout shrinks to the node's learner GPUs
        m.tensor_model_parallel_size = min(m.tensor_model_parallel_size, learners)
        m.pipeline_model_parallel_size = max(1, min(m.pipeline_model_parallel_size,
                                                    learners // m.tensor_model_parallel_size))
    elif cfg.cluster.mode == "disaggregated":  # the engine nodes' GPUs, no more
        cfg.rollout.num_engines = min(r.num_engines, engine_nodes * gpus // r.engine_tp_size)
    if not use_gpu:  # CPU ranks: as many as the model-parallel layout needs, per learner node
        m = cfg.megatron
        learner_nodes = num_nodes - (engine_nodes if cfg.cluster.mode == "disaggregated" and num_nodes > 1 else 0)
        cfg.cluster.num_learner_processes = (m.tensor_model_parallel_size * m.pipeline_model_parallel_size
                                             * m.context_parallel_size * learner_nodes)
    shape = ClusterShape.from_config(cfg, use_gpu, num_nodes=num_nodes, engine_nodes=engine_nodes,
                                     node_addrs=[f"10.0.0.{i + 1}" for i in range(num_nodes)])
    return cfg, place(cfg, shape)


CASES = [(name, label, overrides, n, e, gpu) for name in EXPERIMENTS for (label, overrides, n, e) in _layouts(name)
         for gpu in (True, False)]


@pytest.mark.parametrize("name,label,overrides,num_nodes,engine_nodes,use_gpu", CASES,
                         ids=[f"{c[0]}-{c[1]}-{'gpu' if c[5] else 'cpu'}" for c in CASES])
def test_every_experiment_places_without_breaking_a_rule(name, label, overrides, num_nodes, engine_nodes, use_gpu):
    cfg, placement = _placement(name, overrides, num_nodes, engine_nodes, use_gpu)
    r = cfg.rollout
    assert placement.problems() == []
    assert len(placement.engines) == r.num_engines
    # no process group holds two ranks on one GPU
    for group in placement.groups:
        gpus = [m.device for m in group.members if m.device.gpu is not None]
        assert len(gpus) == len(set(gpus)), group.name
    engines_on_gpu = use_gpu and r.backend == "sglang"  # the embedded engine runs on the CPU, beside GPU learners
    if not engines_on_gpu:
        assert all(e.gpu_ids == () for e in placement.engines)
        assert all(g.backend == "gloo" for g in placement.groups if g.kind == "weight_update")
    else:
        assert all(g.backend == "nccl" for g in placement.groups if g.kind == "weight_update")
        # no two engines share a GPU, and every engine has its own CUDA_VISIBLE_DEVICES
        devices = [d for e in placement.engines for d in e.devices]
        assert len(devices) == len(set(devices)) == r.num_engines * r.engine_tp_size
        for node in placement.engine_nodes():
            visible = [e.cuda_visible_devices() for e in placement.engines_on_node(node)]
            assert all(visible) and len(visible) == len(set(visible))
            assert all(len(v.split(",")) == r.engine_tp_size for v in visible)
        assert all(0 <= d.gpu < cfg.cluster.gpus_per_node for d in devices)
    if use_gpu:
        learner_devices = [lp.device for lp in placement.learners]
        assert len(learner_devices) == len(set(learner_devices))
        assert all(0 <= lp.device.gpu < cfg.cluster.gpus_per_node for lp in placement.learners)
    # colocated GPU engines get their weights by CUDA IPC, never through a NCCL group
    if cfg.cluster.mode == "colocated" and engines_on_gpu:
        assert placement.transport == CUDA_IPC
        assert not [g for g in placement.groups if g.kind == "weight_update"]
        for e in placement.engines:
            assert [placement.learner(rank).device for rank in e.ipc_ranks] == e.devices
    elif cfg.cluster.mode == "colocated" and num_nodes == 1:
        assert placement.transport == SHARED_MEMORY
    else:
        assert placement.transport == DISTRIBUTED
        pp = cfg.megatron.pipeline_model_parallel_size
        groups = [placement.weight_update_group(s) for s in range(pp)]
        assert all(g is not None and g.world_size == 1 + r.num_engines * r.engine_tp_size for g in groups)
        assert [g.members[0].index for g in groups] == [lp.rank for lp in placement.weight_sources()]
    # one node: every engine announces exactly the address it binds (loopback)
    if num_nodes == 1:
        assert all(e.bind_host == e.announce_host == "127.0.0.1" for e in placement.engines)
    else:
        assert all(e.announce_host == f"10.0.0.{e.node + 1}" for e in placement.engines)


def test_learner_coordinates_follow_megatron_rank_order():
    from megatron.core.parallel_state import RankGenerator

    tp, cp, dp, pp = 2, 2, 3, 2
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    layout = ParallelLayout(world_size=tp * cp * dp * pp, tp=tp, cp=cp, dp=dp, pp=pp)
    for axis, index in (("tp", 0), ("cp", 1), ("dp", 2), ("pp", 3)):
        for ranks in gen.get_ranks(axis):
            coords = [layout.coordinates_of(rank) for rank in ranks]
            # along one axis only that coordinate changes, through 0..size-1 in rank order
            assert [c[index] for c in coords] == list(range(len(ranks)))
            others = {tuple(v for i, v in enumerate(c) if i != index) for c in coords}
            assert len(others) == 1


def test_32b_colocated_hands_weights_over_on_each_gpu():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b"])  # 16 nodes x 8, TP8 PP2 learners, 32 engines x TP4
    placement = place(cfg, ClusterShape.from_config(cfg, use_gpu=True))
    engine = placement.engines[6]
    assert (engine.node, engine.gpu_ids, engine.cuda_visible_devices()) == (3, (0, 1, 2, 3), "0,1,2,3")
    assert engine.ipc_ranks == (24, 25, 26, 27) and engine.transport == CUDA_IPC
    assert [(lp.rank, lp.pp_rank, lp.dp_rank) for lp in placement.weight_sources()] == [(0, 0, 0), (64, 1, 0)]
    # the old rule (distributed sync as soon as engines announce a node address) put the
    # stage-0 source and engine 0's TP rank 0 on one GPU in one NCCL group
    src = placement.learner(0)
    old = ProcessGroupPlan("old_pp0", "weight_update", 0, (
        GroupMember("learner", 0, 0, src.device),
        *(GroupMember("engine", e.index, 1 + e.index * 4 + t, Device(e.node, e.gpu_ids[t]), t)
          for e in placement.engines for t in range(4))))
    assert Device(0, 0) in old.duplicate_devices()


def test_32b_disaggregated_groups_span_learner_and_engine_nodes():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b_disagg"])  # 8 learner nodes, 8 engine nodes, 16 engines
    placement = place(cfg, ClusterShape.from_config(cfg, use_gpu=True))
    assert [e.node for e in placement.engines] == [8 + i // 2 for i in range(16)]
    assert [lp.rank for lp in placement.weight_sources()] == [0, 32]  # TP8 x DP4 ranks per stage
    group = placement.weight_update_group(1)
    assert group.world_size == 65 and group.members[0].device == Device(4, 0)
    assert [m.group_rank for m in group.members] == list(range(65))
    assert placement.problems() == []


def test_engine_dp_is_refused_with_a_fix():
    with pytest.raises(ConfigError, match="rollout.engine_dp_size.*num_engines=64"):
        load_config(["+experiment=dapo_qwen2.5_32b", "rollout.engine_dp_size=2"])


def test_visible_devices_map_through_the_parents():
    assert visible_devices([2, 3]) == "2,3"
    assert visible_devices([0, 1], "4,5,6,7") == "4,5"
    assert visible_devices([1], "GPU-aa, GPU-bb") == "GPU-bb"
    with pytest.raises(ValueError, match="beyond the 2 visible"):
        visible_devices([2], "0,1")


def test_problems_name_shared_gpus():
    cfg = load_config(["+experiment=dapo_qwen2.5_7b", "cluster.mode=disaggregated", "cluster.num_nodes=1",
                       "cluster.max_staleness=0", "cluster.num_learner_processes=4", "rollout.num_engines=4"])
    problems = "\n".join(place(cfg, ClusterShape.from_config(cfg, use_gpu=True)).problems())
    assert "beyond gpus_per_node=8" in problems  # 4 learners + 4 engines x TP2 > 8 GPUs


def test_launcher_slots_and_addresses_come_from_the_placement():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b_disagg"])
    slots = compute_engine_slots(cfg, node_index=2, engine_nodes=8, use_gpu=True)
    assert [(s.index, s.gpu_ids) for s in slots] == [(4, [0, 1, 2, 3]), (5, [4, 5, 6, 7])]
    # a one-node Slurm job: engines bind loopback and announce loopback (not the node address)
    tiny = load_config(["+experiment=tiny_cpu_slurm"])
    one = {"DAPO_MEGA_NODE_ADDRS": "n1=10.0.0.7"}
    assert job_shape(tiny, 1, False, one).num_nodes == 1
    assert engine_addresses(tiny, 1, False, one, "n1") == ("127.0.0.1", "127.0.0.1")
    two = {"DAPO_MEGA_NODE_ADDRS": "n1=10.0.0.7,n2=10.0.0.8"}
    assert engine_addresses(tiny, 2, False, two, "n2") == ("10.0.0.8", "10.0.0.8")
    slot = compute_engine_slots(tiny, 1, 2, False, two)[0]
    assert (slot.index, slot.gpu_ids, slot.announce_host) == (1, [], "10.0.0.8")


def test_colocated_engines_start_with_the_memory_saver_on_their_own_gpus():
    from dapo_mega.launch import EngineSlot, engine_command_and_env, engine_rollout_config

    cfg = load_config(["+experiment=dapo_qwen2.5_32b"])  # colocated, SGLang, TP4 engines
    rollout = engine_rollout_config(cfg, api_key="k")
    slot = EngineSlot(index=7, gpu_ids=[4, 5, 6, 7])
    argv, env = engine_command_and_env(cfg, rollout, slot, "/m", 30007, "10.0.0.4", {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    # sglang 0.5.23: ExecConfig.enable_memory_saver / DeviceConfig.base_gpu_id (arg_groups/fields)
    assert "--enable-memory-saver" in argv
    assert argv[argv.index("--base-gpu-id") + 1] == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and env["DAPO_MEGA_ENGINE_INDEX"] == "7"
    _, env = engine_command_and_env(cfg, rollout, slot, "/m", 30007, "h", {"CUDA_VISIBLE_DEVICES": "GPU-0,GPU-1,GPU-2,GPU-3,GPU-4,GPU-5,GPU-6,GPU-7"})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-4,GPU-5,GPU-6,GPU-7"
    disagg = load_config(["+experiment=dapo_qwen2.5_32b_disagg"])
    argv, _ = engine_command_and_env(disagg, engine_rollout_config(disagg, "k"), slot, "/m", 1, "h", {})
    assert "--enable-memory-saver" not in argv  # disaggregated engines keep their memory
    tiny = load_config(["+experiment=tiny_cpu_slurm"])
    argv, env = engine_command_and_env(tiny, engine_rollout_config(tiny, ""), EngineSlot(0), "/m", 1, "127.0.0.1", {})
    # the embedded engine: a CPU engine that sees no GPU, wherever it runs
    assert "--enable-memory-saver" in argv and "--base-gpu-id" not in argv and env["CUDA_VISIBLE_DEVICES"] == ""
    from dapo_mega.engines.embedded.server import build_arg_parser

    build_arg_parser().parse_args(argv[3:])  # the embedded engine accepts the same command line


def test_plan_reports_the_placements_sync_groups():
    from dapo_mega.plan.memory import compute_plan, format_plan

    disagg = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b_disagg"]))
    assert disagg.sync.transport == DISTRIBUTED
    assert [(g.name, g.world_size, g.learner_ranks) for g in disagg.sync.groups] == \
        [("dapo_weight_sync_pp0", 65, [0]), ("dapo_weight_sync_pp1", 65, [32])]
    assert "dapo_weight_sync_pp1 (source rank 32 + 64 engine ranks)" in format_plan(disagg)
    colocated = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b"]))
    assert colocated.sync.transport == CUDA_IPC and len(colocated.sync.groups) == 32
    assert colocated.layout[3].engine_gpus == {6: [0, 1, 2, 3], 7: [4, 5, 6, 7]}
    broken = compute_plan(load_config(["+experiment=dapo_qwen2.5_7b", "rollout.num_engines=20"]))
    assert any(w.startswith("placement: ") and "beyond gpus_per_node=8" in w for w in broken.warnings)


@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if load_config([f"+experiment={n}"]).cluster.mode
                                  == "disaggregated"])
def test_the_syncer_forms_the_groups_the_plan_reports(name):
    """Each shipped disaggregated config, unmodified at its own node counts: the weight-update
    group a stage's source forms (`WeightSyncer.group_ranks`, what it sends every engine in
    /init_weights_update_group) is the placement's, rank for rank."""
    from dapo_mega.weights.sync import WeightSyncer

    cfg = load_config([f"+experiment={name}"])
    placement = place(cfg, ClusterShape.from_config(cfg, use_gpu=True))
    assert placement.problems() == [] and placement.transport == DISTRIBUTED
    urls = [f"http://{e.announce_host}:{30000 + e.index}" for e in placement.engines]
    syncer = WeightSyncer(urls, engine_tp_size=cfg.rollout.engine_tp_size)
    try:
        world, offsets = syncer.group_ranks()
    finally:
        syncer.close()
    for stage in range(cfg.megatron.pipeline_model_parallel_size):
        group = placement.weight_update_group(stage)
        assert group.world_size == world == 1 + cfg.rollout.num_engines * cfg.rollout.engine_tp_size
        planned = {urls[m.index]: m.group_rank for m in group.members if m.role == "engine" and m.engine_tp_rank == 0}
        assert planned == offsets
        assert group.members[0].group_rank == 0 and group.members[0].index == placement.weight_sources()[stage].rank


def test_a_learner_selects_the_gpu_its_placement_gives_it():
    """The runtime's device rule (`learner_cuda_index`, what the session passes to
    `layout.initialize`): the placement's GPU, as this process numbers it; a launcher that
    disagrees with the placement is refused, naming both."""
    from dapo_mega.backends.placement import learner_cuda_index

    cfg = load_config(["+experiment=dapo_qwen2.5_32b_disagg"])  # 8 learner nodes x 8 GPUs
    placement = place(cfg, ClusterShape.from_config(cfg, use_gpu=True))
    rank_13 = placement.learner(13)
    assert rank_13.device == Device(1, 5) and rank_13.local_rank == 5
    assert learner_cuda_index(rank_13, {"LOCAL_RANK": "5"}) == 5
    assert learner_cuda_index(rank_13, {"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == 1
    assert learner_cuda_index(rank_13, {"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "3"}) == 0  # bound by its launcher
    with pytest.raises(ValueError, match="LOCAL_RANK=1.*local rank 5"):  # cyclic task distribution
        learner_cuda_index(rank_13, {"LOCAL_RANK": "1"})
    with pytest.raises(ValueError, match="GPU 5 of its node.*hides"):
        learner_cuda_index(rank_13, {"CUDA_VISIBLE_DEVICES": "0,1"})
    cpu = place(cfg, ClusterShape.from_config(cfg, use_gpu=False))
    with pytest.raises(ValueError, match="no GPU"):
        learner_cuda_index(cpu.learner(0), {})
