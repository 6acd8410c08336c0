"""SGLang's HTTP API as pinned from its source: the one table of field names.

Read from the sglang 0.5.23 wheel (`pip download sglang==0.5.23 --no-deps`):
`srt/managers/io_struct.py` (request structs), `srt/entrypoints/http_server.py` (routes and
replies), `srt/sampling/sampling_params.py` (sampling fields), `srt/arg_groups/fields/*.py`
(server flags: a field `tp_size` becomes `--tp-size`, `arg_utils._field_to_cli_name`),
`srt/utils/weight_versions.py` (the `weight_versions` spans) and sglang-router 0.3.2
`router_args.py`. The client (`dapo_mega.engines.sglang.client`), the embedded engine
(`dapo_mega.engines.embedded.server`) and the launcher all validate against these tables, and the
tests check every body they build against them, so a rename in a future SGLang is one
edit here.

Facts read from that source that the code relies on:

* A batched `/generate` with `sampling_params.n = G` returns a flat list of
  `batch_size * G` replies ordered prompt-major: reply `i * G + j` is sample `j` of prompt
  `i` (`TokenizerManager._handle_batch_request` loops `for i in range(batch_size): for _ in
  range(parallel_sample_num)`). A single prompt with n > 1 is turned into a batch of one,
  so the reply is a list of n.
* `meta_info.output_token_logprobs` is a list of `[logprob, token_id, None]`; the logprob is
  `log_softmax(logits / temperature)` at the sampled token, before top-k / top-p
  filtering (`layers/sampler.py`, unless SGLANG_RETURN_ORIGINAL_LOGPROB is set); greedy
  (temperature 0) requests report the raw `log_softmax(logits)`.
* `meta_info.finish_reason` is `{"type": "stop", "matched": <token id or stop string>}`,
  `{"type": "length", "length": n}` or `{"type": "abort", "message": ...}`. A matched stop
  token or stop string is trimmed from `text`, never from `output_ids` (checked against the
  0.5.23 server: `tests/engines/test_conformance.py`) unless `no_stop_trim`. The scheduler
  clamps `max_new_tokens` to context - 2 - prompt length.
* `meta_info.weight_versions` is a list of `{"version", "start", "end"}` spans over the
  output tokens and `meta_info.weight_version` the version of the last span.
* Control endpoints reply `{"success", "message"}` with status 200 or 400; pause/continue
  reply `{"message", "status": "ok"}`; release/resume memory reply `null`;
  `/get_weights_by_name` replies the first `truncate_size` rows of the parameter as float
  lists; `/flush_cache` replies plain text (400 when requests are running).
"""

from __future__ import annotations

from typing import Dict, FrozenSet

SGLANG_VERSION_READ = "0.5.23"
SGLANG_ROUTER_VERSION_READ = "0.3.2"

# Fields every control request accepts (io_struct.BaseReq).
_BASE_REQ = frozenset({"rid", "http_worker_ipc"})

#: POST body fields of each control endpoint (io_struct.*ReqInput), with SGLang's defaults.
REQUEST_DEFAULTS: Dict[str, Dict[str, object]] = {
    "/init_weights_update_group": {
        "master_address": None, "master_port": None, "rank_offset": None, "world_size": None,
        "group_name": "weight_update_group", "backend": "nccl"},
    "/destroy_weights_update_group": {"group_name": "weight_update_group"},
    "/update_weights_from_distributed": {
        "names": None, "dtypes": None, "shapes": None, "group_name": "weight_update_group",
        "flush_cache": True, "abort_all_requests": False, "weight_version": None,
        "load_format": None, "selector": "all", "torch_empty_cache": False},
    "/update_weights_from_tensor": {
        "serialized_named_tensors": None, "load_format": None, "flush_cache": True,
        "abort_all_requests": False, "weight_version": None, "selector": "all",
        "torch_empty_cache": False},
    "/update_weight_version": {"new_version": None, "abort_all_requests": True},
    "/get_weights_by_name": {"name": None, "truncate_size": 100},
    # `/weights_checker` (GET or POST, body optional): action checksum replies {"success",
    # "message", "ranks": [{"checksums": {name: hex}, "per_gpu_checksum", "parallelism_info"}],
    # "per_engine_checksum"} (`wire/checksum.py` computes the same digests)
    "/weights_checker": {"action": "checksum", "allow_quant_error": False, "skip_tensor_list": None,
                         "selector": "all"},
    "/release_memory_occupation": {"tags": None},
    "/resume_memory_occupation": {"tags": None},
    "/pause_generation": {"mode": "abort"},
    "/continue_generation": {"torch_empty_cache": True},
    # A weight-update session: every update from distributed / tensor must run between the
    # two, else 400 (`scheduler_components/weight_updater.py`).
    "/begin_weight_update": {"selector": "all"},
    "/end_weight_update": {},
    # `rid` (from BaseReq) or `abort_all`; the reply is 200 with an empty body.
    "/abort_request": {"abort_all": False, "finished_reason": None, "abort_message": None,
                       "weight_versions": None},
}

#: Required fields (no default in the struct).
REQUEST_REQUIRED: Dict[str, FrozenSet[str]] = {
    path: frozenset(k for k, v in fields.items() if v is None and k not in (
        "weight_version", "load_format", "tags", "finished_reason", "abort_message", "weight_versions",
        "skip_tensor_list"))
    for path, fields in REQUEST_DEFAULTS.items()
}

#: Every accepted key per control endpoint.
REQUEST_FIELDS: Dict[str, FrozenSet[str]] = {
    path: frozenset(fields) | _BASE_REQ for path, fields in REQUEST_DEFAULTS.items()
}

PAUSE_MODES = ("abort", "retract", "in_place")

#: GenerateReqInput fields the embedded engine implements.
GENERATE_FIELDS_SUPPORTED = frozenset({
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "stream",
    "rid", "return_text_in_logprobs", "top_logprobs_num", "log_metrics", "no_logs", "return_routed_experts",
    "routed_experts_start_len"})

#: Other GenerateReqInput fields of sglang 0.5.23: accepted only when null/false/default.
GENERATE_FIELDS_OTHER = frozenset({
    "session_id", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "watermark",
    "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "return_hidden_states", "return_indexer_topk", "modalities", "session_params",
    "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
    "routing_key", "conversation_id", "http_worker_ipc", "background", "require_reasoning",
    "max_thinking_tokens", "priority", "extra_key", "custom_labels"})

GENERATE_FIELDS = GENERATE_FIELDS_SUPPORTED | GENERATE_FIELDS_OTHER

#: SamplingParams fields the embedded engine implements, with SGLang's defaults.
SAMPLING_DEFAULTS: Dict[str, object] = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "n": 1, "ignore_eos": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "sampling_seed": None, "min_new_tokens": 0}

#: Other SamplingParams fields: accepted only at their neutral value.
SAMPLING_NEUTRAL: Dict[str, object] = {
    "stop_regex": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "beam_width": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "stream_interval": None, "logit_bias": None,
    "custom_params": None}

SAMPLING_FIELDS = frozenset(SAMPLING_DEFAULTS) | frozenset(SAMPLING_NEUTRAL)

#: `python -m sglang.launch_server` flags (ServerArgs field -> flag) used by the launcher.
SERVER_FLAGS: Dict[str, str] = {
    "model_path": "--model-path", "tp_size": "--tp-size", "dp_size": "--dp-size",
    "pp_size": "--pp-size", "mem_fraction_static": "--mem-fraction-static",
    "host": "--host", "port": "--port", "weight_version": "--weight-version",
    "api_key": "--api-key", "dtype": "--dtype", "max_running_requests": "--max-running-requests",
    "enable_memory_saver": "--enable-memory-saver",
    "enable_weights_cpu_backup": "--enable-weights-cpu-backup",
    "random_seed": "--random-seed", "trust_remote_code": "--trust-remote-code",
    "skip_server_warmup": "--skip-server-warmup", "log_level": "--log-level",
    "served_model_name": "--served-model-name",
    "device": "--device", "base_gpu_id": "--base-gpu-id", "max_total_tokens": "--max-total-tokens",
    "enable_return_routed_experts": "--enable-return-routed-experts",
    "sleep_on_idle": "--sleep-on-idle",
}

#: GET /server_info answers with the server's arguments as resolved at start, each under its
#: ServerArgs field name (`http_server.get_server_info`: `dataclasses.asdict(server_args)`;
#: the embedded engine answers its own the same way): this one says whether /generate's
#: `return_routed_experts` reports each token's experts.
SERVER_INFO_ROUTED_EXPERTS = "enable_return_routed_experts"

#: `python -m sglang_router.launch_router` flags (sglang-router 0.3.2 router_args.py).
ROUTER_FLAGS: Dict[str, str] = {
    "worker_urls": "--worker-urls", "host": "--host", "port": "--port", "policy": "--policy",
    "api_key": "--api-key"}
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")

#: Default name of the weight-update process group (io_struct defaults).
DEFAULT_GROUP_NAME = "weight_update_group"

#: SGLang's bucketed load format: one uint8 tensor holding the bytes of every tensor of the
#: bucket back to back (`weight_sync/tensor_bucket.FlattenedTensorBucket`).
FLATTENED_BUCKET = "flattened_bucket"
