"""A lane CI is there to prove (real SGLang, the local Slurm cluster) that cannot run here.

On a laptop a missing SGLang venv or Slurm install is a skip that says why. Under CI (`CI`
set to true, as `.ci/run` does) it is a failure with the same reason: a CI run whose
evidence quietly skipped would otherwise pass.
"""

import os


def in_ci() -> bool:
    """True when the `CI` environment variable says so (true / 1 / yes, any case)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def lane_unavailable(reason: str) -> None:
    """Skip the calling test with `reason`, or fail it with `reason` under CI. Never returns."""
    import pytest

    if in_ci():
        pytest.fail(f"CI=true and this lane cannot run: {reason}", pytrace=False)
    pytest.skip(reason)
