"""`dapo-mega train rollout.backend=sglang` with the real SGLang 0.5.23 server on a CPU, colocated
(update from tensor in SGLang's own format, engine memory released while the learner trains)
and disaggregated (update from distributed over a gloo group): two steps each, and the
ledger's policy versions, read from SGLang's replies, equal the learner's versions.

Needs the SGLang venv (`../shared/sglang-cpu/setup.sh`, see test_conformance.py); skips
without it. The model is random (no warm start), so dynamic sampling is off: every group
is all-wrong and would be filtered.
"""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_venv import sglang_python_or_skip

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode,update_path", [("colocated", "/update_weights_from_tensor"),
                                              ("disaggregated", "/update_weights_from_distributed")])
def test_train_with_real_sglang(tmp_path, mode, update_path):
    sglang_python = sglang_python_or_skip()
    import pyarrow.parquet as pq

    cmd = [sys.executable, "-m", "dapo_mega.cli", "train", f"cluster.mode={mode}", "rollout.backend=sglang",
           f"rollout.engine_python={sglang_python}", "trainer.total_steps=2", "trainer.sft_warmup_steps=0",
           "algo.dynamic_sampling=false", f"trainer.output_dir={tmp_path}", "trainer.run_name=run",
           "rollout.extra_server_args=[--max-total-tokens,4096]"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    run = tmp_path / "run"
    engine_log = (run / "logs" / "engine-0.log").read_text(errors="replace")
    assert engine_log.count(f"POST {update_path} ") >= 3  # the first push and one per step
    assert engine_log.count("POST /begin_weight_update ") == engine_log.count("POST /end_weight_update ") >= 3
    for step in (1, 2):
        table = pq.read_table(glob.glob(str(run / "ledger" / f"step_{step:08d}.parquet"))[0]).to_pydict()
        assert set(map(int, table["learner_version"])) == {step - 1}
        assert set(map(int, table["policy_version_min"])) == set(map(int, table["policy_version_max"])) == {step - 1}
