"""bench/gpu_nccl.py's pure pieces on the CPU (issue #46): reading a side's output and the
verdict. The run itself starts a NCCL communicator: GPU only (bench/gpu_node.py check f)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_nccl  # noqa: E402

WHEEL = "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"


def _side(version="2.30.7", banner="2.30.7", library=WHEEL, mapped=(WHEEL,), compiled="2.29.7"):
    probe = {"version": version, "library": library, "package": "nvidia-nccl-cu13" if library else None,
             "note": None if version else "torch 2.13.0+cpu has no CUDA and maps no libnccl"}
    return {"probe": probe, "mapped_at_communicator": list(mapped), "torch_compiled": compiled, "banner": banner}


def test_a_side_is_read_from_its_json_line_and_nccls_own_banner():
    out = ('host:11:11 [0] NCCL INFO NCCL version 2.30.7+cuda13.0\n'
           '{"probe": {"version": "2.30.7"}, "mapped_at_communicator": [], "torch_compiled": "2.29.7"}\n')
    assert gpu_nccl.read_side(0, out, "")["banner"] == "2.30.7"
    assert gpu_nccl.read_side(0, out.splitlines()[1], "NCCL version 2.29.7+cuda13.0")["banner"] == "2.29.7"
    assert gpu_nccl.read_side(0, out.splitlines()[1], "")["banner"] is None
    assert gpu_nccl.read_side(1, "", "Traceback ...\nRuntimeError: no CUDA GPUs\n") == \
        {"error": "exit 1: RuntimeError: no CUDA GPUs"}
    compile(gpu_nccl.AT_COMMUNICATOR, "at_communicator", "exec")  # what runs on the GPU parses


def test_the_check_passes_where_the_probe_names_the_release_the_communicator_runs():
    passed, reason, note = gpu_nccl.judge({"learner": _side(), "engines": _side(compiled="2.30.7")})
    assert passed and reason == ""
    assert note.startswith(f"learner NCCL 2.30.7 ({WHEEL}, nvidia-nccl-cu13; torch built against 2.29.7)")
    assert note.endswith("the two agree")
    assert gpu_nccl.judge({"learner": _side(), "engines": _side("2.29.7", "2.29.7")})[2].endswith(
        "the preflight refuses this pair")  # a mismatch is the preflight's to refuse, not this check's
    assert gpu_nccl.judge({"learner": _side("2.28.9", "2.28.9", library=None, mapped=())})[0]  # linked into torch


def test_the_check_fails_where_the_probe_and_nccl_disagree():
    cases = {
        "learner: the probe read 2.29.7 from": _side(version="2.29.7"),
        "learner: the probe read /venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2, the "
        "communicator maps ['/usr/lib/libnccl.so.2']": _side(mapped=("/usr/lib/libnccl.so.2",)),
        "learner: the probe found no NCCL (torch 2.13.0+cpu": _side(version=None, library=None),
        "learner: NCCL printed no 'NCCL version' line": _side(banner=None),
        "learner: exit 1: boom": {"error": "exit 1: boom"},
    }
    for said, side in cases.items():
        passed, reason, _ = gpu_nccl.judge({"learner": side})
        assert not passed and reason.startswith(said), reason
