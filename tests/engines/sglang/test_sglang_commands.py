"""Command lines the launcher builds, read by the real parsers: SGLang 0.5.23's
`ServerArgs` and sglang-router 0.3.2's `RouterArgs` (run in the SGLang venv, see
tests/engines/test_conformance.py; without it they skip, saying why, and fail under CI=true),
and the embedded engine's own parser. What the client sends to a server is checked by the
conformance suite.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ci_lane import lane_unavailable
from sglang_venv import sglang_python_or_skip

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.sglang.commands import build_engine_command, build_router_command

REPO = Path(__file__).resolve().parents[3]

PARSE_SERVER = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
print(json.dumps({k: v for k, v in vars(p.parse_args(json.loads(sys.argv[1]))).items()
                  if isinstance(v, (str, int, float, bool, type(None), list))}))
"""

PARSE_ROUTER = """
import argparse, dataclasses, json, sys
from sglang_router.router_args import RouterArgs
p = argparse.ArgumentParser()
RouterArgs.add_cli_args(p)
args = RouterArgs.from_cli_args(p.parse_args(json.loads(sys.argv[1])))
print(json.dumps({k: getattr(args, k) for k in ("worker_urls", "host", "port", "policy", "api_key")}))
"""


def parse_in_sglang_venv(code: str, argv, module: str) -> dict:
    python = sglang_python_or_skip()
    check = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True)
    if check.returncode != 0:
        lane_unavailable(f"{module} is not installed in {python} (tools/setup_sglang_cpu.sh installs it)")
    out = subprocess.run([str(python), "-c", code, json.dumps(list(argv))], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sglang_parses_the_server_command_as_meant():
    cfg = RolloutConfig(backend="sglang", engine_tp_size=4, engine_dp_size=1, mem_fraction_static=0.6,
                        api_key="k", dtype="auto", max_running_requests=64)
    argv = build_engine_command(cfg, "/models/qwen", port=30001, weight_version="5", python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    args = parse_in_sglang_venv(PARSE_SERVER, argv[3:], "sglang.srt.server_args")
    assert (args["model_path"], args["port"], args["tp_size"], args["dp_size"]) == ("/models/qwen", 30001, 4, 1)
    assert (args["mem_fraction_static"], args["weight_version"], args["api_key"]) == (0.6, "5", "k")
    assert (args["dtype"], args["max_running_requests"], args["host"]) == ("bfloat16", 64, "127.0.0.1")


def test_a_cpu_sglang_engine_sizes_its_kv_pool_from_the_runs_need_read_by_sglangs_parser(tmp_path):
    """On a CPU SGLang sizes its pool as mem_fraction_static of the host's free memory (21.8 GB
    resident for the tiny model on a 24 GiB host): the fleet caps it at the run's need, every
    running request at its longest with the margin, by hand: 64 x (100 + 300) x 1.25 = 32,000;
    a value in rollout.extra_server_args wins; GPUs and the embedded engine get no cap. A CPU
    engine sleeps when idle (tests/engines/test_conformance.py measures that it takes no core)."""
    from dapo_mega.engines.fleet import EngineFleet

    cfg = RolloutConfig(backend="sglang", max_running_requests=64)
    fleet = EngineFleet(cfg, str(tmp_path), device="cpu", context_tokens=400)
    argv = fleet.command(30001)
    args = parse_in_sglang_venv(PARSE_SERVER, argv[3:], "sglang.srt.server_args")
    assert (args["max_total_tokens"], args["device"], args["sleep_on_idle"]) == (32_000, "cpu", True)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))  # no run: the model's context
    argv = EngineFleet(cfg, str(tmp_path), device="cpu").command(30001)
    assert argv[argv.index("--max-total-tokens") + 1] == "20480"  # 64 x 256 x 1.25
    mine = RolloutConfig(backend="sglang", max_running_requests=64, extra_server_args=["--max-total-tokens", "4096"])
    argv = EngineFleet(mine, str(tmp_path), device="cpu", context_tokens=400).command(30001)
    assert argv.count("--max-total-tokens") == 1 and argv[argv.index("--max-total-tokens") + 1] == "4096"
    gpu = EngineFleet(cfg, str(tmp_path), device="cuda").command(30001)
    assert "--max-total-tokens" not in gpu and "--sleep-on-idle" not in gpu and "--device" not in gpu
    assert "--max-total-tokens" not in EngineFleet(RolloutConfig(), str(tmp_path), device="cpu").command(30001)


def test_embedded_command_is_parsed_by_the_embedded_server():
    from dapo_mega.engines.embedded.server import build_arg_parser

    cfg = RolloutConfig(backend="embedded")
    argv = build_engine_command(cfg, "/m", port=1234, weight_version="0", python=sys.executable)
    assert argv[2] == "dapo_mega.engines.embedded.server"
    args = build_arg_parser().parse_args(argv[3:])
    assert (args.model_path, args.port, args.tp_size, args.dtype, args.weight_version) == ("/m", 1234, 1, "float32", "0")


def test_non_loopback_without_key_refused():
    with pytest.raises(ValueError, match="api_key"):
        build_engine_command(RolloutConfig(host="0.0.0.0"), "/m", port=1)


def test_router_command_passes_the_engines_api_key():
    """sglang-router 0.3.2 has --api-key (the key it sends to its workers)."""
    argv = build_router_command(["http://a:1", "http://b:2"], port=30000, python="py", api_key="engine-key")
    assert argv[:3] == ["py", "-m", "sglang_router.launch_router"]
    args = parse_in_sglang_venv(PARSE_ROUTER, argv[3:], "sglang_router.router_args")
    assert args == {"worker_urls": ["http://a:1", "http://b:2"], "host": "127.0.0.1", "port": 30000,
                    "policy": "cache_aware", "api_key": "engine-key"}
    assert "--api-key" not in build_router_command(["http://a:1"], port=1, python="py")
    with pytest.raises(ValueError):
        build_router_command(["http://a:1"], port=1, policy="fastest")
