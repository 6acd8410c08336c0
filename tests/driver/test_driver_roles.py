"""Rank roles: the driver computes and broadcasts, another learner rank receives (2 gloo ranks)."""

from types import SimpleNamespace

from dist_helpers import run_distributed
from helpers_driver import group

from dapo_mega.config import DapoConfig
from dapo_mega.driver.roles import DriverRole, LearnerRankRole
from dapo_mega.driver.run_state import RunState
from dapo_mega.engines.book import EngineBook
from dapo_mega.rollout.source import RolloutBatch


def _roles(rank: int, world_size: int, run_dir: str):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        cfg = DapoConfig()
        if rank == 0:
            book = EngineBook(["http://127.0.0.1:9"])
            book.mark_dead("http://127.0.0.1:9", "ConnectionRefused")
            manager = SimpleNamespace(book=book)
            role = DriverRole(cfg, RunState(run_dir, cfg.trainer), SimpleNamespace(manager=manager), None, [], None)
            batch = RolloutBatch(step=1, groups=[group("a", [1.0, -1.0]), group("b", [1.0, 1.0, -1.0])])
        else:
            role, batch = LearnerRankRole(), RolloutBatch(step=1)
        samples = role.train_samples(batch)
        dead = role.engine_changes().dead
        evaluated = role.evaluate()  # every rank: the others wait for the driver's evaluation to end
        return {"is_driver": role.is_driver, "dead": dead, "evaluate": evaluated,
                "samples": [(s.prompt_ids, s.response_ids, round(s.advantage, 6)) for s in samples],
                "checkpoint": role.checkpoint_state() if rank else None}
    finally:
        dist.destroy_process_group()


def test_driver_broadcasts_what_other_ranks_receive(tmp_path):
    driver, other = run_distributed(_roles, world_size=2, args=(str(tmp_path),), timeout_s=120)
    assert driver["is_driver"] and not other["is_driver"]
    assert len(driver["samples"]) == 5 and other["samples"] == driver["samples"]
    assert driver["samples"][0][2] > 0 > driver["samples"][1][2]      # advantages computed on the driver
    assert other["dead"] == driver["dead"] == {"http://127.0.0.1:9": "ConnectionRefused"}
    assert other["evaluate"] == {} and other["checkpoint"] == {}       # nothing of its own
    assert driver["evaluate"] == {}                                    # no held-out problems


def test_learner_rank_role_alone_is_a_null_object():
    role = LearnerRankRole()
    assert role.next_rollout_batch(3, 2) == RolloutBatch(step=3)
    assert role.train_samples(RolloutBatch(step=3)) is None           # no process group: nothing received
    for call in (lambda: role.write_ledger(3, RolloutBatch(step=3)), lambda: role.log_step(3, {}, {}),
                 lambda: role.engines_serve(3), lambda: role.start_rollouts(1), lambda: role.say("x"),
                 lambda: role.release_engine_memory(None), lambda: role.close()):
        assert call() is None


def test_driver_writes_the_ledger_with_the_configured_text_setting(tmp_path):
    """trainer.ledger_text reaches the shard the driver writes (none: no prompt or response text)."""
    from dataclasses import replace

    from dapo_mega.records.ledger import read_records

    cfg = DapoConfig()
    cfg.trainer.ledger_text = "none"
    encoder = SimpleNamespace(fingerprint=lambda: "template=raw;chat=off;tokenizer=t/vocab 9/abc")
    rollouts = SimpleNamespace(encoder=encoder, manager=SimpleNamespace(book=EngineBook()))
    role = DriverRole(cfg, RunState(str(tmp_path), cfg.trainer), rollouts, None, [], None)
    try:
        samples = [replace(s, prompt_text="prompt a") for s in group("a", [1.0, -1.0]).stamp(1, 0)]
        role.write_ledger(1, RolloutBatch(step=1, samples=samples))
    finally:
        role.gate.close()
    rows = read_records(tmp_path, steps=[1])
    assert len(rows) == 2 and all(r.response_text == "" and r.prompt_text == "" for r in rows)
    assert all(r.response_text_chars == 4 for r in rows)       # the original length is still recorded
    assert {r.encoder for r in rows} == {"template=raw;chat=off;tokenizer=t/vocab 9/abc"}
