"""A checkpoint directory with only the files that make a save complete (`run_files/checkpoints.py`)."""

import json
from pathlib import Path

from dapo_mega.run_files import checkpoints as R


def fake_checkpoint(checkpoints: Path, step: int, complete: bool = True, latest: bool = False) -> Path:
    """`checkpoints/step_<N>` holding the two files `is_complete_checkpoint` requires (neither
    when not `complete`: an interrupted save); with `latest`, the `latest` pointer names it."""
    d = Path(checkpoints) / R.step_dir_name(step)
    (d / R.MODEL_OPTIM_DIR).mkdir(parents=True)
    if complete:
        (d / R.MODEL_OPTIM_DIR / "metadata.json").write_text("{}")
        (d / R.TRAINER_STATE_FILE).write_text(json.dumps({"step": step}))
    if latest:
        (Path(checkpoints) / R.LATEST_FILE).write_text(d.name)
    return d
