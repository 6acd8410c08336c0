"""The disk fills up during a checkpoint save of a real `dapo-mega train` run.

The run's `checkpoints/` directory is a tmpfs sized for one checkpoint and a half, so step
1's save fits and step 2's runs out of space part-way (a real ENOSPC from the kernel).
Where mounting is not allowed (not root), the checkpoint writer of step 2 raises ENOSPC
instead. Either way: the run stops with an error that says the disk is full and that the
previous checkpoint is intact; `latest` still names step 1, no partial directory is left,
and a restart resumes from step 1 and finishes.
"""

from __future__ import annotations

import shutil
import subprocess

import torch
from test_faults_common import load_checkpoint_tensors, read_metric_rows, run_trainer

RUN = ["trainer.total_steps=2", "trainer.save_interval=1", "trainer.keep_last_k=1"]


def _mount_small_tmpfs(path, size_bytes) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path):
    from test_faults_common import TINY_OVERRIDES

    from dapo_mega.config import load_config
    from dapo_mega.models.tiny import build_tiny_model_dir

    # A checkpoint holds fp32 weights + two Adam moments: about 3x the model's safetensors.
    model_dir = tmp_path / "probe_model"
    build_tiny_model_dir(model_dir, load_config(TINY_OVERRIDES).model, seed=0)
    weights_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    ckpts = tmp_path / "full" / "checkpoints"
    mounted = _mount_small_tmpfs(ckpts, int(4.5 * weights_bytes))
    try:
        result = run_trainer(tmp_path, "full", RUN, faults=[] if mounted else ["enospc:2"])
        out = result.stdout
        assert result.returncode != 0, out[-3000:]
        error = next(ln for ln in out.splitlines() if ".CheckpointSaveError: " in ln)
        assert "step 2" in error and "disk full (ENOSPC" in error and "intact" in error, error
        assert (ckpts / "latest").read_text().strip() == "step_000001"
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001"], "partial save left behind"
        saved = load_checkpoint_tensors(ckpts / "step_000001")
        assert saved and all(torch.isfinite(t).all() for t in saved.values())
        if mounted:  # move the checkpoint to a disk with room for the restart
            shutil.copytree(ckpts, tmp_path / "ckpt_copy")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ckpts)], timeout=30)
    if mounted:
        shutil.rmtree(ckpts)
        shutil.move(str(tmp_path / "ckpt_copy"), str(ckpts))

    assert [r["step"] for r in read_metric_rows(tmp_path / "full")] == [1]
    again = run_trainer(tmp_path, "full", RUN)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "at step 1, policy version 1" in again.stdout
    assert [r["step"] for r in read_metric_rows(tmp_path / "full")] == [1, 2]
    assert (ckpts / "latest").read_text().strip() == "step_000002"
    after = load_checkpoint_tensors(ckpts / "step_000002")
    assert not torch.equal(after["output_layer.weight"], saved["output_layer.weight"])
