"""Embedded engine vs SGLang's API and vs HF transformers (the reference for the math)."""

import json
import time
import urllib.request

import pytest
import torch

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet

API_KEY = "test-key"


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models(3)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    with EngineFleet(RolloutConfig(api_key=API_KEY), str(model_dir), tmp_path_factory.mktemp("log"),
                     weight_version="7") as fleet:
        fleet.start(1)
        yield fleet.engines[0]


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def call(engine, path, body=None, key=API_KEY, raw=None, method=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(engine.url + path, data=data, method=method or ("POST" if data else "GET"))
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if text and r.headers.get_content_type() == "application/json" else text)
    except urllib.error.HTTPError as err:
        text = err.read().decode()
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, text


def test_generate_text_single_and_meta_info(engine):
    status, out = call(engine, "/generate", {"text": "12+3=", "sampling_params": {"max_new_tokens": 6,
                       "temperature": 1.0, "ignore_eos": True}, "return_logprob": True})
    assert status == 200 and isinstance(out, dict)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 6 and len(out["output_ids"]) == 6
    assert meta["weight_versions"] == [{"version": "7", "start": 0, "end": 6}] and meta["weight_version"] == "7"
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(t[2] is None and t[0] <= 0 for t in meta["output_token_logprobs"])


def test_batched_n_is_prompt_major(engine):
    prompts = [[5, 6], [5, 6, 7, 8, 9], [10]]
    status, out = call(engine, "/generate", {"input_ids": prompts, "sampling_params": {
        "n": 3, "max_new_tokens": 3, "ignore_eos": True}})
    assert status == 200 and len(out) == 9
    # SGLang order: reply i*n + j is sample j of prompt i.
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 2, 5, 5, 5, 1, 1, 1]


def test_logprobs_match_transformers_under_temperature(engine, hf):
    model, tok = hf
    prompt = tok("7*8=", add_special_tokens=False).input_ids
    T = 0.7
    status, out = call(engine, "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 8, "temperature": T, "top_p": 0.9, "top_k": 20, "ignore_eos": True,
        "sampling_seed": 11}, "return_logprob": True})
    assert status == 200
    gen = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:-1]
    # SGLang reports log softmax(z / T) at the sampled token (before top-k/top-p).
    ref = torch.log_softmax(logits / T, dim=-1).gather(1, torch.tensor(gen)[:, None])[:, 0]
    got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, ref, atol=1e-4)


def test_greedy_matches_transformers_generate_and_stop_string(engine, hf):
    model, tok = hf
    prompt = tok("3+4=", add_special_tokens=False).input_ids
    status, out = call(engine, "/generate", {"input_ids": [prompt, prompt[:2]], "sampling_params": {
        "max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}})
    assert status == 200
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=None)[0, len(prompt):].tolist()
    assert out[0]["output_ids"] == ref
    text = out[0]["text"]
    stop = text[3:5]
    if stop and text.find(stop) == 3:
        status, cut = call(engine, "/generate", {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 10, "temperature": 0.0, "stop": [stop], "ignore_eos": True}})
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert cut["text"] == text[:3]


def test_max_new_tokens_and_stop_token_ids(engine):
    status, out = call(engine, "/generate", {"input_ids": [4, 5], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    first = out["output_ids"][0]
    status, out2 = call(engine, "/generate", {"input_ids": [4, 5], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0.0, "stop_token_ids": [first]},  # ignore_eos would ignore them
        "return_logprob": True})
    assert out2["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert out2["output_ids"] == [first]  # SGLang 0.5.23 trims a matched stop token from the text only
    assert [t[1] for t in out2["meta_info"]["output_token_logprobs"]] == [first]


def test_api_key_and_bad_requests(engine):
    assert call(engine, "/health", key=None)[0] == 200
    assert call(engine, "/model_info", key=None)[0] == 401
    assert call(engine, "/model_info", key="wrong")[0] == 401
    status, info = call(engine, "/model_info")
    assert status == 200 and info["weight_version"] == "7"
    assert call(engine, "/generate", raw=b"{not json")[0] == 400
    assert call(engine, "/generate", {"text": "1", "temprature": 1.0})[0] == 400
    assert call(engine, "/generate", {"text": "1", "sampling_params": {"temprature": 1.0}})[0] == 400
    assert call(engine, "/generate", {"text": "1", "input_ids": [1]})[0] == 400
    assert call(engine, "/update_weight_version", {"new_version": "8", "bogus": 1})[0] == 400
    assert call(engine, "/pause_generation", {"mode": "sideways"})[0] == 400


def test_wrong_weight_names_and_shapes_rejected_state_unchanged(engine, hf):
    model, _ = hf
    name = "model.layers.0.mlp.up_proj.weight"
    before = call(engine, "/get_weights_by_name", {"name": name, "truncate_size": 10**6})[1]
    assert torch.equal(torch.tensor(before), model.state_dict()[name])
    body = {"names": [name], "dtypes": ["float32"], "shapes": [list(model.state_dict()[name].shape)]}
    status, out = call(engine, "/update_weights_from_distributed", body)  # outside a session, as SGLang
    assert status == 400 and "between begin_weight_update() and end_weight_update()" in out["message"]
    assert call(engine, "/begin_weight_update", {})[0] == 200
    status, out = call(engine, "/update_weights_from_distributed", {
        "names": ["model.layers.0.mlp.up_proj.weight", "model.nope.weight"], "dtypes": ["float32"] * 2,
        "shapes": [list(model.state_dict()[name].shape), [3]]})
    assert status == 400 and "model.nope.weight" in out["message"] and out["success"] is False
    status, out = call(engine, "/update_weights_from_distributed", {
        "names": [name], "dtypes": ["float32"], "shapes": [[1, 2]]})
    assert status == 400 and name in out["message"] and "shape" in out["message"]
    assert call(engine, "/end_weight_update", {})[0] == 200
    after = call(engine, "/get_weights_by_name", {"name": name, "truncate_size": 10**6})[1]
    assert after == before
    assert call(engine, "/model_info")[1]["weight_version"] == "7"


def wait_tokens(engine, base, more, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if call(engine, "/server_info")[1]["num_generated_tokens"] >= base + more:
            return
        time.sleep(0.002)
    raise AssertionError("engine generated nothing")


def test_pause_in_place_splits_version_spans(engine):
    import threading

    result = {}
    base = call(engine, "/server_info")[1]["num_generated_tokens"]

    def long_request():
        result["out"] = call(engine, "/generate", {"input_ids": [4, 5, 6], "sampling_params": {
            "max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    wait_tokens(engine, base, 3)
    assert call(engine, "/pause_generation", {"mode": "in_place"})[0] == 200
    assert call(engine, "/update_weight_version", {"new_version": "8", "abort_all_requests": False})[0] == 200
    assert call(engine, "/continue_generation", {})[0] == 200
    t.join(timeout=120)
    status, out = result["out"]
    spans = out["meta_info"]["weight_versions"]
    assert status == 200 and out["meta_info"]["completion_tokens"] == 200
    assert [s["version"] for s in spans] == ["7", "8"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 200
    call(engine, "/update_weight_version", {"new_version": "7"})


def test_pause_abort_finishes_requests_with_abort(engine):
    import threading

    result = {}
    base = call(engine, "/server_info")[1]["num_generated_tokens"]
    t = threading.Thread(target=lambda: result.setdefault("out", call(engine, "/generate", {
        "input_ids": [4, 5], "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}})))
    t.start()
    wait_tokens(engine, base, 3)
    call(engine, "/pause_generation", {"mode": "abort"})
    t.join(timeout=60)
    call(engine, "/continue_generation", {})
    assert result["out"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["out"][1]["meta_info"]["completion_tokens"] < 240


def test_continuous_batching_joins_running_batch_and_matches_transformers(engine, hf):
    """A request sent while a long one decodes joins its batch (SGLang batches continuously):
    it finishes first, and both outputs still equal transformers' greedy generation (the
    newcomer's KV cache is merged into the running batch's, left-padded to one width)."""
    import threading

    model, tok = hf
    long_prompt = tok("9*9=", add_special_tokens=False).input_ids
    short_prompts = [tok("1+2=", add_special_tokens=False).input_ids, tok("40-7=", add_special_tokens=False).input_ids]
    long_new = 200
    replies, done_at = {}, {}

    def send(name, body):
        replies[name] = call(engine, "/generate", body)
        done_at[name] = time.monotonic()

    greedy = {"temperature": 0.0, "ignore_eos": True}
    slow = threading.Thread(target=send, args=("long", {"input_ids": long_prompt, "sampling_params": {
        **greedy, "max_new_tokens": long_new}}))
    steps_before = call(engine, "/server_info")[1]["num_forward_steps"]
    slow.start()
    deadline = time.monotonic() + 30
    while call(engine, "/server_info")[1]["num_forward_steps"] < steps_before + 2:  # the long one decodes
        assert time.monotonic() < deadline, "the long request never started"
    send("short", {"input_ids": short_prompts, "sampling_params": {**greedy, "max_new_tokens": 12}})
    slow.join(timeout=120)
    assert replies["long"][0] == 200 and replies["short"][0] == 200
    assert done_at["short"] < done_at["long"], "the short request waited for the long one's batch to end"

    def reference(prompt, n):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=None)
        return out[0, len(prompt):].tolist()

    assert replies["long"][1]["output_ids"] == reference(long_prompt, long_new)
    for prompt, out in zip(short_prompts, replies["short"][1]):
        assert out["output_ids"] == reference(prompt, 12)


def test_samples_sharing_a_prompt_match_transformers_each(engine, hf):
    """The n samples of a prompt share one prefill (their cache rows are copies, as SGLang's
    prefix cache shares the prompt): every sample's log-probs still equal transformers' on
    its own tokens, and the samples are not copies of each other."""
    model, tok = hf
    prompts = [tok("6*7=", add_special_tokens=False).input_ids, tok("13+29=", add_special_tokens=False).input_ids]
    T = 0.9
    status, out = call(engine, "/generate", {"input_ids": prompts, "sampling_params": {
        "n": 4, "max_new_tokens": 10, "temperature": T, "ignore_eos": True, "sampling_seed": 5},
        "return_logprob": True})
    assert status == 200 and len(out) == 8
    for k, reply in enumerate(out):
        prompt = prompts[k // 4]
        gen = [t[1] for t in reply["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits / T, dim=-1).gather(1, torch.tensor(gen)[:, None])[:, 0]
        got = torch.tensor([t[0] for t in reply["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, ref, atol=1e-4), k
    for first in (0, 4):
        assert len({tuple(o["output_ids"]) for o in out[first:first + 4]}) > 1


def test_uniforms_drawn_in_blocks_are_the_single_draws():
    """A sequence's uniform numbers, drawn UNIFORM_BLOCK at a time, are those its generator
    gives one by one (what makes a seeded sample the same whatever batch it decodes in)."""
    import torch

    from dapo_mega.engines.embedded.sampling import UNIFORM_BLOCK, SamplingSpec, Sequence_

    for dtype in (torch.float32, torch.bfloat16):
        seq = Sequence_(prompt_ids=[1], spec=SamplingSpec(), on_done=lambda s: None,
                        generator=torch.Generator().manual_seed(7))
        single = torch.Generator().manual_seed(7)
        n = 2 * UNIFORM_BLOCK + 3
        got = [seq.next_uniform(dtype) for _ in range(n)]
        want = [float(torch.rand(1, generator=single, dtype=dtype)) for _ in range(n)]
        assert got == want


def test_queue_beyond_max_queued_requests_is_refused_with_503(model_dir):
    """--max-queued-requests bounds the waiting sequences: one runs (--max-running-requests 1),
    one waits, the next request is refused with SGLang's 503 and the two others still finish."""
    import threading

    rollout = RolloutConfig(api_key=API_KEY, extra_server_args=[
        "--max-running-requests", "1", "--max-queued-requests", "1", "--test-decode-delay-ms", "50"])
    with EngineFleet(rollout, str(model_dir), num_threads=1, weight_version="0",
                     extra_env={"DAPO_MEGA_TEST_CLOCK": "1"}) as fleet:
        fleet.start(1)
        engine = fleet.engines[0]
        body = {"text": "12+3=", "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True}}
        replies = {}

        def send(name):
            replies[name] = call(engine, "/generate", body)

        def wait_for_load(running, waiting):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                load = call(engine, "/v1/loads")[1]["loads"][0]
                if (load["num_running_reqs"], load["num_waiting_reqs"]) == (running, waiting):
                    return
                time.sleep(0.01)
            raise AssertionError(f"engine load never reached {running} running, {waiting} waiting: {load}")

        threads = [threading.Thread(target=send, args=(name,)) for name in ("first", "second")]
        threads[0].start()
        wait_for_load(1, 0)
        threads[1].start()
        wait_for_load(1, 1)
        status, refused = call(engine, "/generate", body)
        for t in threads:
            t.join(timeout=60)
    assert status == 503 and refused["error"]["message"] == "The request queue is full.", refused
    assert [replies[n][0] for n in ("first", "second")] == [200, 200]
    assert all(replies[n][1]["meta_info"]["completion_tokens"] == 40 for n in ("first", "second"))
