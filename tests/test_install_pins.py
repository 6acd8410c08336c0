"""The GPU install, checked where no GPU is needed: the learner's extra keeps SGLang out, its
constraints file pins what docs/cluster.md installs and what pyproject.toml allows (that a
SGLang run names a Python that has SGLang: tests/test_engine_python.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
LEARNER_PINS = {"torch", "megatron-core", "transformer-engine"}
"""What the learner's side must pin: the torch TE's extension is compiled against, and both."""
ENGINE_ONLY = {"sglang", "sglang-router"}


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def _pins(text: str) -> dict:
    """name -> version of every `name==version` line (comments and blank lines skipped)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints-gpu.txt: {line!r} is not a pin"
            pins[_name(req.name)] = spec.version
    return pins


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def gpu_pins():
    return _pins((REPO / "constraints-gpu.txt").read_text())


def test_the_learners_install_keeps_sglang_out(project):
    """SGLang 0.5.23 pins torch==2.14.1: in the learner's environment it replaces the torch
    Transformer Engine was built against."""
    gpu = [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    core = [Requirement(r) for r in project["dependencies"]]
    assert not {_name(r.name) for r in gpu + core} & ENGINE_ONLY, [str(r) for r in gpu]
    assert "transformer-engine" in {_name(r.name) for r in gpu}


def test_constraints_pin_the_learner_within_what_pyproject_allows(project, gpu_pins):
    assert LEARNER_PINS <= set(gpu_pins), sorted(gpu_pins)
    assert not set(gpu_pins) & ENGINE_ONLY
    for raw in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        req = Requirement(raw)
        pinned = gpu_pins.get(_name(req.name))
        if pinned is not None:
            assert req.specifier.contains(pinned, prereleases=True), f"pyproject {raw!r} excludes the pin {pinned}"
    # TE's parts move together, and the learner's torch is the one the CPU lane tests
    te = {gpu_pins[n] for n in gpu_pins if n.startswith("transformer-engine")}
    assert len(te) == 1, te
    cpu = _pins((REPO / "constraints-cpu.txt").read_text())
    assert (cpu["torch"], cpu["megatron-core"]) == (gpu_pins["torch"], gpu_pins["megatron-core"])


def test_the_install_doc_uses_the_constraints_and_a_separate_sglang_venv(gpu_pins):
    doc = (REPO / "docs" / "cluster.md").read_text()
    section = doc[doc.index("## 1. Container"):doc.index("## 2. Data")]
    lines = [line for line in section.splitlines() if "pip install" in line]
    learner = [line for line in lines if "'.[gpu]'" in line or "megatron-core" in line]
    assert learner and all("-c constraints-gpu.txt" in line for line in learner), learner
    assert any("--no-build-isolation" in line and "'.[gpu]'" in line for line in learner), learner
    engines = [line for line in lines if "sglang" in line]
    assert engines and all("/bin/pip install" in line and "'.[gpu]'" not in line for line in engines), engines
    venv = re.search(r"(\S+)/bin/pip install sglang", section).group(1)
    assert f"rollout.engine_python={venv}/bin/python" in section
    # every version the section names for the learner is the constraints file's: the NCCL in its
    # "after torch" line (--no-deps: torch pins its own; tests/test_nccl_agreement.py)
    after_torch = re.search(r"^# after torch: (pip install --no-deps nvidia-nccl-cu13==([\d.]+))$",
                            (REPO / "constraints-gpu.txt").read_text(), re.M)
    assert after_torch, "constraints-gpu.txt names no NCCL release for the learner"
    assert re.search(rf"^{re.escape(after_torch.group(1))}$", section, re.M), section
    for name, version in re.findall(r"([A-Za-z][\w.-]*)==([\w.]+)", section):
        if _name(name) == "nvidia-nccl-cu13":
            assert version == after_torch.group(2), (name, version, after_torch.group(1))
        elif _name(name) not in ENGINE_ONLY:
            assert gpu_pins.get(_name(name)) == version, (name, version, gpu_pins)
