"""A colocated engine's memory is released once and resumed once, by the process that released it.

The libraries behind a colocated engine end it on a broken memory contract: torch_memory_saver
exits on a second pause, SGLang's scheduler dies of a resume of memory it did not release
(`offload_tags.remove`), a write into paused weights is an illegal memory access. The embedded
engine keeps that contract (with --enable-memory-saver, as colocated fleets start it), and the
driver's ledger (`weights/engine_memory.py`) keeps the engines alive through a restart at the
same address while the learner trains (issue #37, item 2). The SGLang case runs the real server:
what the stand-in copies is seen there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import pytest
from sglang_venv import sglang_python_or_skip

from dapo_mega.config import RolloutConfig
from dapo_mega.distributed import free_port
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.process import announce_engine, engine_incarnations
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.weights.engine_memory import EngineMemory
from dapo_mega.weights.sync import WeightSyncer
from dapo_mega.wire import transport


# ---------------------------------------------------------------- the ledger, alone
def test_the_ledger_releases_each_engine_once_and_resumes_only_what_it_released():
    memory = EngineMemory()
    assert memory.to_release(["a", "b"]) == ["a", "b"]
    memory.mark_released(["a", "b"], {"a": "pid 1", "b": "pid 2"})
    assert memory.to_release(["a", "b", "c"]) == ["c"]          # never a second pause
    # b restarted at its address while released: its new process holds its memory
    assert memory.to_resume(["a", "b", "c"], {"a": "pid 1", "b": "pid 9"}) == (["a"], ["b"])
    # unknown incarnations (attached by URL) are taken as the same process
    assert memory.to_resume(["a", "b"], {}) == (["a", "b"], [])
    memory.forget(["a", "b"])
    assert memory.to_resume(["a", "b"], {}) == ([], [])


# ---------------------------------------------------------------- the engines
def start(kind: str, model_dir: Path, log_dir: Path, port: int, memory_saver: bool = True) -> EngineFleet:
    if kind == "sglang":
        rollout = RolloutConfig(backend="sglang", engine_python=str(sglang_python_or_skip()), dtype="float32",
                                base_port=port, health_timeout_s=240,
                                extra_server_args=["--max-total-tokens", "2048"])
    else:
        rollout = RolloutConfig(backend="embedded", base_port=port, health_timeout_s=120)
    fleet = EngineFleet(rollout, str(model_dir), log_dir, device="cpu", memory_saver=memory_saver, num_threads=1)
    fleet.start(1)
    return fleet


def call(endpoint, name: str, *args):
    async def go():
        async with EngineClient(endpoint) as client:
            return await getattr(client, name)(*args)
    return asyncio.run(go())


def exited(fleet: EngineFleet, timeout_s: float = 60.0) -> int:
    """The engine's exit status once it ended (bounded)."""
    proc = fleet.get(0).proc
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is not None, "the engine did not exit"
    return proc.returncode


def write_one_tensor(endpoint, model_dir: Path) -> None:
    """One checkpoint tensor through /update_weights_from_tensor, in a weight-update session."""
    from safetensors.torch import load_file

    name, tensor = next(iter(load_file(str(model_dir / "model.safetensors")).items()))
    handle = transport.write_shm_bucket([(name, tensor)])
    try:
        async def go():
            async with EngineClient(endpoint) as client:
                await client.begin_weight_update()
                await client.update_weights_from_tensor(
                    [base64.b64encode(json.dumps(handle).encode()).decode()], "shared_memory_json")
        asyncio.run(go())
    finally:
        transport.remove_shm_bucket(handle)


def log_of(fleet: EngineFleet) -> str:
    return fleet.get(0).log_path.read_text(errors="replace")


@pytest.mark.parametrize("case", ["second release", "write while released", "resume never released"])
def test_the_embedded_engine_ends_where_the_memory_saver_would(case, tiny_model_dir, tmp_path):
    fleet = start("embedded", tiny_model_dir, tmp_path / "logs", free_port())
    try:
        endpoint = fleet.endpoints[0]
        if case != "resume never released":
            assert call(endpoint, "release_memory_occupation") is None
        with pytest.raises(Exception):
            if case == "second release":
                call(endpoint, "release_memory_occupation")
            elif case == "write while released":
                write_one_tensor(endpoint, tiny_model_dir)
            else:
                call(endpoint, "resume_memory_occupation")
        assert exited(fleet) == 1
        wanted = {"second release": "Cannot pause allocation that is not active",
                  "write while released": "illegal memory access",
                  "resume never released": "KeyError: 'kv_cache'"}[case]
        assert wanted in log_of(fleet), log_of(fleet)[-2000:]
    finally:
        fleet.close()


@pytest.mark.parametrize("kind", ["embedded", pytest.param("sglang", marks=pytest.mark.slow)])
def test_an_engine_restarted_while_released_is_not_resumed_and_a_plain_resume_would_end_it(kind, tiny_model_dir,
                                                                                         tmp_path):
    """Released for the learner's step, the engine is killed and the engines role starts it again
    at its port and announces it (new pid). The syncer's resume leaves it alone (and names it);
    the engine released with it is resumed; a second release never reaches either. Then the
    same resume sent plainly, as before the ledger, ends the new process (SGLang: KeyError in
    its scheduler)."""
    registry = tmp_path / "engines"
    port = free_port()
    fleet = start(kind, tiny_model_dir, tmp_path / "logs", port)
    try:
        endpoint = fleet.endpoints[0]

        def announce() -> None:
            engine = fleet.get(0)
            announce_engine(registry, 0, {"url": engine.url, "pid": engine.pid, "time": time.time()})
        announce()
        syncer = WeightSyncer([endpoint], mode="colocated", timeout_s=60,
                              incarnations=lambda: engine_incarnations(RolloutConfig(engine_registry=str(registry))))
        try:
            syncer.release_engine_memory()
            syncer.release_engine_memory()  # asked twice: the engine is released once
            assert fleet.get(0).alive()
            assert syncer.resume_engine_memory() == []  # the same process: resumed
            syncer.release_engine_memory()
            fleet.restart(0)  # killed during the learner's step, started again at its port
            announce()
            assert fleet.get(0).url == endpoint.url
            assert syncer.resume_engine_memory() == [endpoint.url]
            time.sleep(1.0)
            assert fleet.get(0).alive() and call(endpoint, "health"), log_of(fleet)[-2000:]
        finally:
            syncer.close()
        with pytest.raises(Exception):
            call(endpoint, "resume_memory_occupation")  # what the driver sent before the ledger
        assert exited(fleet) != 0
        assert "KeyError" in log_of(fleet), log_of(fleet)[-3000:]
    finally:
        fleet.close()


def test_incarnations_come_from_the_registry_and_a_record_being_written_is_skipped(tmp_path):
    announce_engine(tmp_path, 0, {"url": "http://127.0.0.1:5/", "pid": 7, "time": 1.5})
    (tmp_path / "engine-1.json").write_text('{"url": "http://127.0.0.1:6"')  # half a file
    assert engine_incarnations(RolloutConfig(engine_registry=str(tmp_path))) == {"http://127.0.0.1:5": "pid 7 at 1.5"}
    assert engine_incarnations(RolloutConfig()) == {}
    assert json.loads((tmp_path / "engine-0.json").read_text())["pid"] == 7
