"""tools/sglang_cpu/source_archive.sh: the sgl-kernel source archive is cut from one commit
of a git repository and checked by its files' git tree before the setup builds from it.

A repository made here stands in for the fork (its commit and tree replace the fork's through
SGL_KERNEL_COMMIT / SGL_KERNEL_TREE); the tree is computed by git itself on a checkout cut by
hand, and the archive from the real fork was checked against the script's tree when it was
written (the README says how to repeat that)."""

import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "sglang_cpu" / "source_archive.sh"


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout.strip()


def _fork(root: Path) -> tuple:
    """A repository with an sgl-kernel/ folder as the fork lays it out; returns (repo, commit,
    the git tree of the folder as the archive must hold it)."""
    repo = root / "fork"
    files = {"sgl-kernel/pyproject.toml": "[project]\nname = 'sglang-kernel'\n",
             "sgl-kernel/pyproject_cpu.toml": "[project]\nname = 'sglang-kernel-cpu'\n",
             "sgl-kernel/csrc/cpu/gemm.cpp": "int gemm();\n", "sgl-kernel/csrc/cpu/aarch64/moe.cpp": "arm\n",
             "sgl-kernel/tests/test_gemm.py": "pass\n", "sgl-kernel/benchmark/b.py": "pass\n",
             "sgl-kernel/build.sh": "#!/bin/sh\n", "python/sglang/x.py": "outside the folder\n"}
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    (repo / "sgl-kernel/build.sh").chmod(0o755)
    _git(repo, "init", "-q", ".")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "fork")
    commit = _git(repo, "rev-parse", "HEAD")
    # the cut by hand: the folder without benchmark/, tests/, csrc/cpu/aarch64/, pyproject_cpu.toml as pyproject.toml
    cut = root / "cut"
    cut.mkdir()
    for name in ("pyproject_cpu.toml", "csrc/cpu/gemm.cpp", "build.sh"):
        (cut / name).parent.mkdir(parents=True, exist_ok=True)
        (cut / name).write_bytes((repo / "sgl-kernel" / name).read_bytes())
    (cut / "pyproject.toml").write_bytes((repo / "sgl-kernel/pyproject_cpu.toml").read_bytes())
    (cut / "build.sh").chmod(0o755)
    _git(cut, "init", "-q", ".")
    _git(cut, "add", "-A")
    return repo, commit, _git(cut, "write-tree")


def _run(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", **env_extra}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env)


def test_the_archive_cut_from_the_commit_passes_and_any_other_content_is_named(tmp_path):
    repo, commit, tree = _fork(tmp_path)
    env = {"SGL_KERNEL_COMMIT": commit, "SGL_KERNEL_TREE": tree}
    made = _run(env, "make", str(repo), str(tmp_path / "out"))
    assert made.returncode == 0, made.stderr
    archive = Path(made.stdout.strip())
    assert archive.name == f"sgl-kernel-cpu-src-modal-projects-{commit[:7]}.tar.gz"
    with tarfile.open(archive) as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert names == ["sgl-kernel/build.sh", "sgl-kernel/csrc/cpu/gemm.cpp", "sgl-kernel/pyproject.toml",
                     "sgl-kernel/pyproject_cpu.toml"]
    assert _run(env, "check", str(archive)).returncode == 0

    # one byte changed in a source file: not the source, and the message says which trees differ
    work = tmp_path / "edited"
    work.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="tar")
    (work / "sgl-kernel/csrc/cpu/gemm.cpp").write_text("int gemm(); \n")
    edited = tmp_path / "edited.tar.gz"
    subprocess.run(["tar", "-czf", str(edited), "-C", str(work), "sgl-kernel"], check=True)
    bad = _run(env, "check", str(edited))
    assert bad.returncode == 1 and f"is not sgl-kernel of https://github.com/modal-projects/sglang at {commit[:7]}" \
        in bad.stderr and tree in bad.stderr, bad.stderr

    # the script's own commit is not in this repository: named, nothing written
    missing = _run({}, "make", str(repo), str(tmp_path / "none"))
    assert missing.returncode == 1 and "has no commit 8905cbd" in missing.stderr, missing.stderr
    assert not list((tmp_path / "none").glob("*.tar.gz"))
