"""Training checkpoints that do not fit the learner are refused whole.

A checkpoint with a shard file missing or cut short, one whose tensors have other shapes (another FFN
width) and one of another architecture (an extra layer, so tensors are missing) must each
raise an error that names the tensor or the file, and leave the learner's weights exactly
as they were before the attempt: never loaded partially. The same learner then loads the
intact checkpoint (so the refusals are not a loader that refuses everything).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dist_helpers import make_config

from dapo_mega.weights.spawn import spawn_gloo


def _learner(world, **model_overrides):
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config()
    cfg.megatron.use_distributed_optimizer = True
    for key, value in model_overrides.items():
        setattr(cfg.model, key, value)
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    return MegatronLearner(cfg, hf, layout)


def _weights(learner):
    return {n: p.detach().clone() for c in learner.model_chunks for n, p in c.named_parameters()}


def _run(rank, world, root):
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from dist_helpers import make_samples

    from dapo_mega.backends.megatron import checkpoint as C
    from dapo_mega.backends.megatron.layout import ParallelLayout  # noqa: F401
    from dapo_mega.run_files.checkpoints import MODEL_OPTIM_DIR

    root = Path(root)
    source = _learner(world)
    source.train_step(make_samples(seed=1))
    saved = C.save_checkpoint(source, root / "good", 1, {"policy_version": 1})
    saved_weights = _weights(source)
    # A shard file gone (e.g. a copy interrupted).
    shutil.copytree(saved.parent.parent, root / "missing_shard")
    shard = sorted((root / "missing_shard" / "checkpoints" / saved.name / MODEL_OPTIM_DIR).glob("*.distcp"))[-1]
    shard.unlink()
    # A shard cut short (a full disk while copying).
    shutil.copytree(saved.parent.parent, root / "short_shard")
    cut = root / "short_shard" / "checkpoints" / saved.name / MODEL_OPTIM_DIR / shard.name
    cut.write_bytes(cut.read_bytes()[:-100])

    def attempt(learner, path):
        before = _weights(learner)
        try:
            C.load_checkpoint(learner, path)
            error = None
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            error = f"{type(exc).__name__}: {exc}"
        after = _weights(learner)
        unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        return error, unchanged

    results = {}
    fresh = _learner(world)
    results["missing_shard"] = attempt(fresh, root / "missing_shard")
    results["short_shard"] = attempt(fresh, root / "short_shard")
    results["ffn_width"] = attempt(_learner(world, tiny_intermediate_size=128), root / "good")
    results["extra_layer"] = attempt(_learner(world, tiny_num_layers=3), root / "good")
    error, _ = attempt(fresh, root / "good")
    loaded = _weights(fresh)
    results["good"] = (error, all(torch.equal(loaded[k], saved_weights[k]) for k in saved_weights))
    results["shard_name"] = shard.name
    return results


def test_mismatched_checkpoints_are_refused_naming_the_tensor_and_never_half_loaded(tmp_path):
    result = spawn_gloo(_run, 1, args=(str(tmp_path),), timeout_s=400)[0]
    for case, words in (("missing_shard", "is missing"), ("short_shard", "bytes")):
        error, unchanged = result[case]
        assert error and error.startswith("CheckpointCorruptError") and result["shard_name"] in error, error
        assert words in error and "tensor '" in error, error
        assert unchanged, f"{case}: weights changed by a failed load ({error})"
    error, unchanged = result["ffn_width"]
    assert error and error.startswith("CheckpointCorruptError") and "linear_fc" in error and "shape" in error, error
    assert unchanged, error
    error, unchanged = result["extra_layer"]
    assert error and error.startswith("CheckpointCorruptError") and "decoder.layers" in error, error
    assert unchanged, error
    assert result["good"] == (None, True)
