"""Engines someone else started say whether they report each token's routed experts (issue #46
item 1): the Slurm engines role writes it into each engine's registry record, learners that
attach through the registry read it, and engines attached by URL are asked (GET /server_info,
where SGLang 0.5.23 and the embedded engine list `enable_return_routed_experts` among their
server arguments). The trainer asks such engines for experts, and refuses routing replay at
start where they report none."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from dapo_mega.config import ConfigError, DapoConfig, ModelConfig, RolloutConfig
from dapo_mega.engines.fleet import (
    REGISTRY_ROUTED_EXPERTS,
    EngineFleet,
    announce_engine,
    server_reports_routed_experts,
)
from dapo_mega.engines.sglang.commands import ROUTED_EXPERTS_FLAG
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.launch import SlurmTask, engine_record
from dapo_mega.models.tiny import build_tiny_model_dir
from dapo_mega.session import engine_experts_every

TASK = SlurmTask(job_id="46", proc_id=0, num_tasks=1, node_id=0, num_nodes=1, local_id=0, tasks_on_node=1,
                 node_name="node0")


@pytest.fixture(scope="module")
def moe_fleet(tmp_path_factory):
    """One embedded engine on a tiny Qwen3-MoE, started as the engines role starts its own."""
    moe_dir = build_tiny_model_dir(tmp_path_factory.mktemp("moe"), ModelConfig(tiny_num_layers=2), seed=3,
                                   architecture="qwen3_moe")
    rollout = RolloutConfig(backend="embedded", health_timeout_s=120, num_engines=1)
    with EngineFleet(rollout, str(moe_dir), tmp_path_factory.mktemp("logs"), device="cpu", num_threads=1) as fleet:
        fleet.start(1)
        yield fleet


def test_the_registry_says_which_engines_report_routed_experts(moe_fleet, tmp_path):
    engine = moe_fleet.engines[0]
    assert moe_fleet.returns_routed_experts and ROUTED_EXPERTS_FLAG in engine.argv
    record = engine_record(engine, TASK)
    assert record[REGISTRY_ROUTED_EXPERTS] is True and record["url"] == engine.url

    registry = tmp_path / "engines"
    announce_engine(registry, 0, record)
    attached = EngineFleet.from_registry(registry, moe_fleet.rollout)
    assert attached.endpoints == moe_fleet.endpoints and attached.returns_routed_experts
    # the record decides (no guess from the model): one that says no is believed
    announce_engine(registry, 0, {**record, REGISTRY_ROUTED_EXPERTS: False})
    assert not EngineFleet.from_registry(registry, moe_fleet.rollout).returns_routed_experts
    # a record without the field (an engines role of before): the engine itself is asked
    announce_engine(registry, 0, {"url": engine.url})
    assert EngineFleet.from_registry(registry, moe_fleet.rollout).returns_routed_experts


def test_an_engine_attached_by_url_is_asked(moe_fleet):
    endpoint = moe_fleet.engines[0].endpoint
    assert server_reports_routed_experts(endpoint) is True  # the embedded engine answers as SGLang does
    assert EngineFleet.attach([endpoint.url], moe_fleet.rollout).returns_routed_experts


class _StandIn(BaseHTTPRequestHandler):
    """An SGLang stand-in: /health, and its server arguments at `server.info_path`."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/health" or self.path == self.server.info_path:
            body = b"" if self.path == "/health" else json.dumps(self.server.info).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("info_path, info, expected", [
    ("/server_info", {"enable_return_routed_experts": False, "dtype": "bfloat16"}, False),
    ("/get_server_info", {"enable_return_routed_experts": True}, True),  # the older route only
    ("/server_info", {"dtype": "bfloat16"}, None),                        # says nothing: not reported
])
def test_the_server_info_answer_decides(info_path, info, expected):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    server.info_path, server.info = info_path, info
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert server_reports_routed_experts(EngineEndpoint(url)) is expected
        assert EngineFleet.attach([url], RolloutConfig(health_timeout_s=10)).returns_routed_experts is bool(expected)
    finally:
        server.shutdown()
        server.server_close()


def test_replay_with_engines_that_report_none_stops_before_any_step():
    cfg = DapoConfig()
    cfg.rollout.engine_urls = ["http://10.0.0.1:30000"]
    silent = SimpleNamespace(returns_routed_experts=False, model_path="")
    reporting = SimpleNamespace(returns_routed_experts=True, model_path="")
    assert engine_experts_every(cfg, reporting, moe=True) == cfg.checks.router_agreement_every
    assert engine_experts_every(cfg, silent, moe=True) == 0  # the agreement metric goes without: a warning
    assert engine_experts_every(cfg, reporting, moe=False) == 0
    cfg.algo.routing_replay = True
    assert engine_experts_every(cfg, reporting, moe=True) == 1
    with pytest.raises(ConfigError, match=r"rollout.engine_urls=\['http://10.0.0.1:30000'\] answer /server_info "
                                          r"without enable_return_routed_experts.*--enable-return-routed-experts"):
        engine_experts_every(cfg, silent, moe=True)
