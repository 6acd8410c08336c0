"""Hugging Face checkpoints written by the running learner (`trainer.hf_export_interval`).

The references are nobody's code here: transformers' Qwen2 forward on the exported directory
against the Megatron forward of the training checkpoint of the same step (written by the
checkpoint code, not the export, and read back by megatron-core), with its weights rounded to
bf16 by torch as the export's are; the export's tokenizer against the base model's files;
the real SGLang 0.5.23 server's greedy output on the export against transformers'; plan's disk
figure against the parameter count by hand. The directory protocol (atomic rename, keep-K) is
checked on a hand-built tree and with failures injected into a two-rank (PP 2) export.
"""

import json

import pytest
import torch
from dist_helpers import make_config, run_distributed
from helpers.training import RUN_NAME, read_rows, run_train

from dapo_mega.config import ConfigError, load_config
from dapo_mega.run_files.checkpoints import (
    HF_INDEX_FILE,
    begin_hf_export_dir,
    directory_bytes,
    hf_exports_root,
    is_complete_hf_export,
    list_complete_hf_exports,
    prune_hf_exports,
    step_dir_name,
)

TOKEN_IDS = torch.tensor([[20, 21, 22, 23, 24, 25, 26, 27], [5, 40, 41, 42, 7, 60, 61, 62]])
LOGIT_RTOL = 1e-4
"""Both forwards in fp32 on the same bf16-rounded weights: measured equal (|diff| 0.0 at
steps 4 and 5); one RL step of the tiny run moves the largest logit (~4.3) by ~0.47."""


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("override,field", [("trainer.hf_export_interval=-1", "trainer.hf_export_interval"),
                                            ("trainer.hf_export_keep=0", "trainer.hf_export_keep"),
                                            ("trainer.hf_export_dtype=int8", "trainer.hf_export_dtype")])
def test_bad_export_settings_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    message = str(info.value)
    assert message.startswith(field + ":") and "Fix:" in message and "\n" not in message, message


def test_plan_counts_the_kept_exports_on_disk():
    """Qwen2.5-32B (32,763,876,352 parameters): 3 + 1 checkpoints of 14 bytes per parameter
    (docs/cluster.md) and the 2 that keep_every=100 keeps for good (saved every 10 steps up to 313:
    steps 100 and 200; 300 is among the newest 3), plus 2 kept bf16 exports of 2 bytes per parameter."""
    from dapo_mega.plan.memory import compute_plan

    phi = 32_763_876_352
    off = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b"])).checkpoint
    on = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b", "trainer.hf_export_interval=10"])).checkpoint
    assert off.disk_peak_bytes == (4 + 2) * 14 * phi and off.hf_export_bytes == 0
    assert on.hf_export_bytes == 2 * phi and on.disk_peak_bytes == (4 + 2) * 14 * phi + 2 * 2 * phi


# --------------------------------------------------------------------------- directory protocol


def _fake_export(root, name, complete=True):
    path = root / name
    path.mkdir(parents=True)
    (path / "model-00001-of-00001.safetensors").write_bytes(b"x" * 10)
    if complete:
        (path / HF_INDEX_FILE).write_text("{}")
        (path / "config.json").write_text("{}")
    return path


def test_prune_deletes_only_older_complete_exports_and_interrupted_ones(tmp_path):
    root = hf_exports_root(tmp_path)
    for step in (1, 2, 3):
        _fake_export(root, step_dir_name(step))
    # an export killed after writing every file but before its rename: all files, the tmp name
    interrupted = _fake_export(root, step_dir_name(4) + ".tmp-4242")
    no_index = _fake_export(root, step_dir_name(5), complete=False)   # not an export of this protocol
    (root / "notes").mkdir()
    (root / "README.txt").write_text("kept")
    assert not is_complete_hf_export(interrupted) and not is_complete_hf_export(no_index)
    assert [p.name for p in list_complete_hf_exports(tmp_path)] == [step_dir_name(s) for s in (1, 2, 3)]

    deleted = prune_hf_exports(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == [step_dir_name(1), interrupted.name]
    assert sorted(p.name for p in root.iterdir()) == ["README.txt", "notes", step_dir_name(2), step_dir_name(3),
                                                       step_dir_name(5)]
    assert prune_hf_exports(tmp_path, keep=2) == []
    assert directory_bytes(root / step_dir_name(2)) == 10 + 2 + 2
    assert begin_hf_export_dir(tmp_path, 6).name.startswith(step_dir_name(6) + ".tmp-")


def _export_with_failures(rank, world, model_dir, run_dir):
    """PP 2: export step 1; step 2 with stage 1's writer failing (disk full) after 3 tensors;
    step 3 with rank 0's rename failing; step 4. What every rank saw, and the hf/ listing."""
    import errno
    from unittest import mock

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.run_files.checkpoints import HFExportError
    from dapo_mega.weights import hf_io
    from dapo_mega.weights.convert import export_hf_step, read_hf_config_dict

    cfg = make_config(pp=world)
    layout = ParallelLayout.from_config(cfg.megatron, world, model_dir).initialize()
    learner = MegatronLearner(cfg, model_dir, layout)
    hf_cfg = read_hf_config_dict(model_dir)

    def export(step):
        try:
            record = export_hf_step(learner.model_chunks, learner.info, layout, run_dir, step, hf_cfg, model_dir,
                                    torch.bfloat16, keep=3)
            return "ok" if rank != 0 else f"ok {record.path.name} {record.bytes}"
        except HFExportError as exc:
            return f"HFExportError: {exc}"

    seen = [export(1)]
    real_add, added = hf_io.ShardedSafetensorsWriter.add, []

    def add_until_full(self, name, tensor):
        added.append(name)
        if len(added) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, name, tensor)

    with mock.patch.object(hf_io.ShardedSafetensorsWriter, "add", add_until_full if rank == 1 else real_add):
        seen.append(export(2))
    with mock.patch("dapo_mega.run_files.checkpoints.commit_hf_export_dir", side_effect=OSError(errno.EIO, "I/O error")):
        seen.append(export(3))
    seen.append(export(4))
    # what a process killed now would leave: mid-stream, and with every file written just before the rename
    from dapo_mega.run_files import checkpoints as R

    snapshots, real_commit = [], R.commit_hf_export_dir

    def snapshot(tmp=None):
        snapshots.append((sorted(p.name for p in hf_exports_root(run_dir).iterdir()),
                          [p.name for p in list_complete_hf_exports(run_dir)],
                          tmp is not None and (tmp / HF_INDEX_FILE).is_file() and (tmp / "config.json").is_file()))

    def add_and_look(self, name, tensor):
        if len(snapshots) == 0:
            snapshot()
        return real_add(self, name, tensor)

    def look_and_commit(tmp):
        snapshot(tmp)
        return real_commit(tmp)

    with mock.patch.object(hf_io.ShardedSafetensorsWriter, "add", add_and_look), \
            mock.patch("dapo_mega.run_files.checkpoints.commit_hf_export_dir", look_and_commit):
        seen.append(export(5))
    return seen, sorted(p.name for p in hf_exports_root(run_dir).iterdir()), snapshots


@pytest.mark.slow
def test_an_export_that_fails_on_any_rank_leaves_no_complete_directory(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    results = run_distributed(_export_with_failures, 2, (str(tiny_model_dir), str(run_dir)), timeout_s=240)
    (seen0, listing, snapshots), (seen1, _, _) = results
    assert seen0[0].startswith("ok step_000001") and seen1[0] == "ok"
    for seen in (seen0, seen1):  # step 2: stage 1 ran out of disk; every rank stops, none hangs
        assert seen[1].startswith("HFExportError: HF export of step 2 failed"), seen[1]
        assert seen[2].startswith("HFExportError: HF export of step 3 failed"), seen[2]
    assert "No space left on device" in seen1[1] and "another learner rank" in seen0[1]
    assert "I/O error" in seen0[2] and "another learner rank" in seen1[2]
    assert "was removed" in seen0[1] and "earlier exports" in seen0[1]
    assert seen0[3].startswith("ok step_000004") and seen1[3] == "ok"
    # step 5 looked at while its shards stream in, and once every file is there but before the
    # rename: only a .tmp- directory, never complete, whatever a kill at either moment left
    (mid, mid_complete, _), (written, written_complete, all_files_there) = snapshots
    assert mid[:2] == written[:2] == ["step_000001", "step_000004"] and mid_complete == written_complete == mid[:2]
    assert len(mid) == len(written) == 3 and mid[2] == written[2] and mid[2].startswith("step_000005.tmp-")
    assert all_files_there
    assert listing == ["step_000001", "step_000004", "step_000005"]  # no step 2 or 3, no tmp directory left
    exported = list_complete_hf_exports(run_dir)[-1]
    assert exported.name == "step_000005" and seen0[4].startswith("ok step_000005")
    index = json.loads((exported / HF_INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]  # one per stage


# --------------------------------------------------------------------------- a run


EXPORT_RUN = ["trainer.total_steps=5", "trainer.save_interval=2", "trainer.keep_last_k=3",
              "trainer.hf_export_interval=2", "trainer.hf_export_keep=2"]
"""Checkpoints at steps 2, 4, 5; exports at 2, 4 and the last step 5; keep 2: 4 and 5 stay."""


@pytest.fixture(scope="module")
def export_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hf_export_run")
    run_train(tmp_path, *EXPORT_RUN)
    return tmp_path / RUN_NAME


def _checkpoint_logits(rank, world, step_dirs, hf_cfg, token_ids):
    """Megatron's fp32 logits of each training checkpoint, its weights rounded to bf16 first."""
    from dapo_mega.backends.megatron.checkpoint import load_model_from_dist_checkpoint, resolve_megatron_source
    from dapo_mega.weights.convert import _build
    from dapo_mega.weights.verify import megatron_logits

    layout, chunks, info = _build(hf_cfg, 1, 1, world, torch.float32)
    out = []
    for step_dir in step_dirs:
        load_model_from_dist_checkpoint(chunks, resolve_megatron_source(step_dir)["ckpt_dir"])
        with torch.no_grad():
            for param in chunks[0].parameters():
                param.copy_(param.to(torch.bfloat16).float())
        out.append(megatron_logits(chunks, info, token_ids))
    return out


def _hf_logits(model_dir, token_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(token_ids).logits.float()


@pytest.mark.slow
def test_a_run_keeps_its_newest_exports_with_their_cost_in_the_metrics(export_run):
    from safetensors import safe_open

    exports = list_complete_hf_exports(export_run)
    assert [p.name for p in exports] == ["step_000004", "step_000005"]             # step 2's pruned by keep-K
    assert sorted(p.name for p in hf_exports_root(export_run).iterdir()) == ["step_000004", "step_000005"]
    rows = {r["step"]: r for r in read_rows(export_run)}
    assert sorted(s for s, r in rows.items() if "hf_export/bytes" in r) == [2, 4, 5]
    for step in (4, 5):
        row = rows[step]
        assert row["hf_export/bytes"] == directory_bytes(export_run / "hf" / step_dir_name(step))
        assert 0 < row["hf_export/seconds"] <= row["time/hf_export_s"] and row["mem/hf_export/rss_peak_gib"] > 0
    base = export_run / "base_model"
    for export in exports:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (export / name).read_bytes() == (base / name).read_bytes(), name
        config = json.loads((export / "config.json").read_text())
        assert config["dtype"] == "bfloat16" and config["architectures"] == ["Qwen2ForCausalLM"]
        index = json.loads((export / HF_INDEX_FILE).read_text())
        for file in set(index["weight_map"].values()):
            with safe_open(str(export / file), "pt") as f:
                assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    from transformers import AutoTokenizer

    text = "Answer: 12+34=46"
    assert AutoTokenizer.from_pretrained(exports[0])(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(base)(text)["input_ids"]


@pytest.mark.slow
def test_an_export_holds_the_learner_weights_of_its_step(export_run):
    """transformers on hf/step_4 == Megatron on checkpoint step 4 (bf16-rounded), and not on
    checkpoint step 2: the export is of its own step, not an earlier or later one."""
    from dapo_mega.weights.convert import read_hf_config_dict

    hf_cfg = read_hf_config_dict(export_run / "base_model")
    ckpts = [export_run / "checkpoints" / step_dir_name(s) for s in (4, 2)]
    at_4, at_2 = run_distributed(_checkpoint_logits, 1, ([str(p) for p in ckpts], hf_cfg, TOKEN_IDS))[0]
    got = _hf_logits(export_run / "hf" / step_dir_name(4), TOKEN_IDS)
    scale = max(1.0, at_4.abs().max().item())
    assert (got - at_4).abs().max().item() <= LOGIT_RTOL * scale
    assert (got - at_2).abs().max().item() > 100 * LOGIT_RTOL * scale


# --------------------------------------------------------------------------- SGLang and PP 2


def _engine_greedy(url, prompts, steps):
    import asyncio

    from dapo_mega.engines.sglang.client import EngineClient
    from dapo_mega.engines.sglang.endpoint import EngineEndpoint

    async def main():
        async with EngineClient(EngineEndpoint(url, timeout_s=300)) as client:
            res = await client.generate(list(prompts), {"n": 1, "temperature": 0.0, "max_new_tokens": steps,
                                                        "ignore_eos": True}, return_logprob=True)
            return [(r.token_ids, r.logprobs) for r in res]
    return asyncio.run(main())


def _hf_greedy(model_dir, prompts, steps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, logprobs = list(prompt), []
            for _ in range(steps):
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                ids.append(int(logp.argmax()))
                logprobs.append(float(logp[ids[-1]]))
            out.append((ids[len(prompt):], logprobs))
    return out


@pytest.mark.slow
@pytest.mark.sglang
def test_real_sglang_serves_an_export(export_run, tmp_path):
    """SGLang 0.5.23 (CPU, fp32) started on hf/step_5: its greedy tokens and log-probs equal
    transformers' on the same directory."""
    from sglang_venv import sglang_python_or_skip

    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.fleet import EngineFleet

    python = sglang_python_or_skip()
    export = export_run / "hf" / step_dir_name(5)
    prompts, steps = ([20, 21, 22, 23, 24], [5, 40, 41, 42, 7, 60]), 6
    cfg = RolloutConfig(backend="sglang", engine_python=str(python), dtype="float32", health_timeout_s=600,
                        request_timeout_s=600, extra_server_args=["--max-total-tokens", "4096"], num_engines=1)
    fleet = EngineFleet(cfg, str(export), tmp_path / "logs", device="cpu", extra_env={"OMP_NUM_THREADS": "1"})
    try:
        got = _engine_greedy(fleet.start(1)[0].url, prompts, steps)
    finally:
        fleet.close()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, _hf_greedy(export, prompts, steps)):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-3


@pytest.mark.slow
def test_pipeline_parallel_learners_export_their_stages(tmp_path):
    """Two learner processes at PP 2: each stage's rank writes its own shard of hf/step_1, and
    transformers on it equals Megatron (TP 1, PP 1) on the step-1 checkpoint."""
    from dapo_mega.weights.convert import read_hf_config_dict

    run_train(tmp_path, "cluster.num_learner_processes=2", "megatron.pipeline_model_parallel_size=2",
              "trainer.total_steps=1", "trainer.sft_warmup_steps=0", "trainer.hf_export_interval=1",
              timeout_s=400)
    run_dir = tmp_path / RUN_NAME
    export = run_dir / "hf" / step_dir_name(1)
    index = json.loads((export / HF_INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    hf_cfg = read_hf_config_dict(run_dir / "base_model")
    [want] = run_distributed(_checkpoint_logits, 1, ([str(run_dir / "checkpoints" / step_dir_name(1))], hf_cfg,
                                                     TOKEN_IDS))[0]
    got = _hf_logits(export, TOKEN_IDS)
    assert (got - want).abs().max().item() <= LOGIT_RTOL * max(1.0, want.abs().max().item())
    assert [r["hf_export/bytes"] for r in read_rows(run_dir) if r["step"] == 1] == [directory_bytes(export)]
