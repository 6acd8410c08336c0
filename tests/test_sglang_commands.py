"""Command lines and request bodies vs the SGLang field table pinned from sglang 0.5.23."""

import sys

import pytest

from dapo_mega.backends.sglang import api
from dapo_mega.backends.sglang.launch import build_engine_command, build_router_command
from dapo_mega.config import RolloutConfig
from dapo_mega.backends.sglang import client as C


def flags_of(argv):
    return {a for a in argv if a.startswith("--")}


def test_server_command_uses_pinned_flags():
    cfg = RolloutConfig(backend="sglang", engine_tp_size=4, engine_dp_size=2, mem_fraction_static=0.6,
                        api_key="k", dtype="auto", extra_server_args=["--enable-memory-saver"])
    argv = build_engine_command(cfg, "/models/qwen", port=30001, weight_version="5", python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert flags_of(argv) <= set(api.SERVER_FLAGS.values())
    pairs = dict(zip(argv[3::2], argv[4::2]))
    assert pairs["--model-path"] == "/models/qwen" and pairs["--tp-size"] == "4" and pairs["--dp-size"] == "2"
    assert pairs["--mem-fraction-static"] == "0.6" and pairs["--weight-version"] == "5"
    assert pairs["--api-key"] == "k" and pairs["--dtype"] == "bfloat16" and pairs["--port"] == "30001"
    # The field -> flag rule of sglang's arg_utils._field_to_cli_name.
    assert all(flag == "--" + field.replace("_", "-") for field, flag in api.SERVER_FLAGS.items())


def test_embedded_command_is_parsed_by_the_embedded_server():
    from dapo_mega.rollout.server import build_arg_parser

    cfg = RolloutConfig(backend="embedded")
    argv = build_engine_command(cfg, "/m", port=1234, weight_version="0", python=sys.executable)
    assert argv[2] == "dapo_mega.rollout.server"
    args = build_arg_parser().parse_args(argv[3:])
    assert (args.model_path, args.port, args.tp_size, args.dtype, args.weight_version) == ("/m", 1234, 1, "float32", "0")


def test_non_loopback_without_key_refused():
    with pytest.raises(ValueError, match="api_key"):
        build_engine_command(RolloutConfig(host="0.0.0.0"), "/m", port=1)


def test_router_command():
    argv = build_router_command(["http://a:1", "http://b:2"], port=30000, python="py")
    assert argv == ["py", "-m", "sglang_router.launch_router", "--worker-urls", "http://a:1", "http://b:2",
                    "--host", "127.0.0.1", "--port", "30000", "--policy", "cache_aware"]
    with pytest.raises(ValueError):
        build_router_command(["http://a:1"], port=1, policy="fastest")


def test_request_bodies_match_pinned_structs():
    bodies = {
        "/init_weights_update_group": C.control_body("/init_weights_update_group", master_address="h",
                                                     master_port=1, rank_offset=1, world_size=3,
                                                     group_name="g", backend="nccl"),
        "/update_weights_from_distributed": C.control_body(
            "/update_weights_from_distributed", names=["a"], dtypes=["bfloat16"], shapes=[[2]],
            group_name="g", weight_version="3", load_format=api.FLATTENED_BUCKET, flush_cache=False),
        "/update_weights_from_tensor": C.control_body(
            "/update_weights_from_tensor", serialized_named_tensors=["x"], load_format=None, weight_version="3"),
        "/pause_generation": C.control_body("/pause_generation", mode="retract"),
    }
    for path, body in bodies.items():
        assert set(body) <= api.REQUEST_FIELDS[path], path
        assert api.REQUEST_REQUIRED[path] <= set(body), path
    assert api.REQUEST_REQUIRED["/init_weights_update_group"] == {
        "master_address", "master_port", "rank_offset", "world_size"}
    assert api.REQUEST_REQUIRED["/update_weights_from_distributed"] == {"names", "dtypes", "shapes"}
    gen = C.build_generate_body([[1, 2], [3]], C.build_sampling_params(n=4, stop=["\n"], max_new_tokens=9),
                                return_logprob=True)
    assert set(gen) <= api.GENERATE_FIELDS and set(gen["sampling_params"]) <= api.SAMPLING_FIELDS
    assert gen["input_ids"] == [[1, 2], [3]] and gen["sampling_params"]["n"] == 4
    assert set(C.build_generate_body(["a"], {})) == {"text", "sampling_params", "return_logprob"}


def test_parse_generate_reply_prompt_major():
    def item(p, j):
        return {"text": "", "output_ids": [p, j], "meta_info": {
            "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": p, "completion_tokens": 2,
            "weight_versions": [{"version": "4", "start": 0, "end": 2}],
            "output_token_logprobs": [[-0.5, p, None], [-0.25, j, None]]}}
    reply = [item(p, j) for p in range(2) for j in range(3)]
    res = C.parse_generate_reply(reply, num_prompts=2, n=3)
    assert [(r.prompt_index, r.sample_index) for r in res] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert res[4].token_ids == [1, 1] and res[4].logprobs == [-0.5, -0.25] and res[4].truncated
    with pytest.raises(ValueError):
        C.parse_generate_reply(reply[:5], num_prompts=2, n=3)
