"""One GPU: is the NCCL preflight's reading the release NCCL itself runs? (issue #46)

The preflight (`dapo_mega/plan/nccl.py`) asks each Python which NCCL it loads without a GPU:
`plan/nccl_probe.py` imports torch, finds the libnccl it maps and calls that library's
`ncclGetVersion`. What only a GPU settles: that this is the release a communicator runs. In
each Python (the learner's and, given, the SGLang venv's) a world-size-1 NCCL group is started
with NCCL_DEBUG=VERSION, so NCCL prints its release ("NCCL version 2.29.7+cuda13.0") when the
communicator starts. The check passes when, on each side, the probe read (after `import
torch`, before any CUDA call) names that release and a file still mapped at the
communicator. `torch.cuda.nccl.version()` (the release torch was compiled against) is
reported beside it: after `pip install --no-deps nvidia-nccl-cu13==2.30.7` on torch 2.13.0
it should say 2.29.7 where both others say 2.30.7.

`bench/gpu_node.py` runs it as check f; alone, on a node with one GPU:

    python bench/gpu_nccl.py [--sglang-python /opt/sglang/bin/python]

prints the JSON of both sides and exits 0 when the check passed. Its pure pieces (reading
the output, the verdict) are tested on the CPU in tests/bench/test_gpu_nccl.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "dapo_mega" / "plan" / "nccl_probe.py"

AT_COMMUNICATOR = r"""
import json, os, sys
import torch
import torch.distributed as dist
probe = {"__name__": "nccl_probe"}
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), probe)  # the preflight's probe, as it runs
before = probe["loaded_nccl"]()  # after `import torch`, before any CUDA call: what the preflight reads
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
x = torch.ones(1, device="cuda")
dist.all_reduce(x)  # the communicator starts here; NCCL_DEBUG=VERSION prints its release
torch.cuda.synchronize()
mapped = probe["mapped_nccl_libraries"]()
dist.destroy_process_group()
print(json.dumps({"probe": before, "mapped_at_communicator": mapped,
                  "torch_compiled": ".".join(str(v) for v in torch.cuda.nccl.version()[:3])}))
"""
"""Run in each Python: argv[1] the probe's file, argv[2] a free port."""

SIDE_TIMEOUT_S = 90
"""One side: torch's import, CUDA's start and one communicator."""

BANNER = re.compile(r"NCCL version (\d+\.\d+\.\d+)")
"""What NCCL prints when a communicator starts under NCCL_DEBUG=VERSION (init.cc)."""


def read_side(returncode: int, stdout: str, stderr: str) -> Dict[str, Any]:
    """One side's run: its JSON line, and `banner`, the release NCCL printed (stdout by default,
    stderr where NCCL_DEBUG_FILE says so), or `error`."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if returncode != 0 or not lines:
        tail = [ln for ln in stderr.splitlines() if ln.strip()][-1:] or [""]
        return {"error": f"exit {returncode}: {tail[0][:300]}"}
    banner = BANNER.search(stdout + "\n" + stderr)
    return {**json.loads(lines[-1]), "banner": banner.group(1) if banner else None}


def judge(sides: Dict[str, Dict[str, Any]]) -> Tuple[bool, str, str]:
    """(passed, reason, note): on every side the probe's release is NCCL's banner, from a file
    still mapped at the communicator. The note says what each side loads, what torch says it
    was built against, and whether the two sides agree (what the preflight decides)."""
    notes = []
    for side, got in sides.items():
        if "error" in got:
            return False, f"{side}: {got['error']}", ""
        probe = got["probe"]
        if probe["version"] is None:
            return False, f"{side}: the probe found no NCCL ({probe['note']})", ""
        if got["banner"] is None:
            return False, f"{side}: NCCL printed no 'NCCL version' line at the communicator (NCCL_DEBUG=VERSION)", ""
        if probe["version"] != got["banner"]:
            return False, (f"{side}: the probe read {probe['version']} from {probe['library']}, the communicator "
                           f"runs {got['banner']}"), ""
        if probe["library"] is not None and probe["library"] not in got["mapped_at_communicator"]:
            return False, (f"{side}: the probe read {probe['library']}, the communicator maps "
                           f"{got['mapped_at_communicator']}"), ""
        notes.append(f"{side} NCCL {probe['version']} ({probe['library'] or 'linked into torch'}, "
                     f"{probe['package'] or 'not pip'}; torch built against {got['torch_compiled']})")
    releases = {got["probe"]["version"] for got in sides.values()}
    if len(sides) > 1:
        notes.append("the two agree" if len(releases) == 1 else "the preflight refuses this pair")
    return True, "", "; ".join(notes)


def check_nccl_loaded(learner_python: str, engines_python: Optional[str]) -> Dict[str, Any]:
    """The check in the learner's Python and, where given and another, the SGLang venv's."""
    from dapo_mega.distributed import free_port

    pythons = {"learner": learner_python}
    if engines_python and engines_python != learner_python:
        pythons["engines"] = engines_python
    sides = {}
    for side, python in pythons.items():
        try:
            proc = subprocess.run([python, "-c", AT_COMMUNICATOR, str(PROBE), str(free_port())],
                                  capture_output=True, text=True, timeout=SIDE_TIMEOUT_S, cwd=tempfile.gettempdir(),
                                  env={**os.environ, "NCCL_DEBUG": "VERSION"})
            sides[side] = read_side(proc.returncode, proc.stdout, proc.stderr)
        except subprocess.TimeoutExpired:
            sides[side] = {"error": f"no exit within {SIDE_TIMEOUT_S} s"}
    passed, reason, note = judge(sides)
    out: Dict[str, Any] = {"passed": passed, "reason": reason, "sides": sides}
    if note:
        out["note"] = note
    if "engines" not in pythons:
        out["note"] = (note + "; " if note else "") + "the SGLang venv's side skipped: no --sglang-python"
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sglang-python", default=os.environ.get("DAPO_MEGA_SGLANG_PYTHON", ""),
                    help="the SGLang venv's interpreter (default $DAPO_MEGA_SGLANG_PYTHON; empty: the learner's only)")
    args = ap.parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    out = check_nccl_loaded(sys.executable, args.sglang_python or None)
    print(json.dumps(out, indent=2))
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
