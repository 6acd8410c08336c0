#!/usr/bin/env bash
# sgl-kernel's CPU source: which fork and commit, how the archive is cut from it, and the check
# that an archive is that source. Sourced by tools/setup_sglang_cpu.sh; also a command:
#
#   bash tools/sglang_cpu/source_archive.sh make GIT_URL_OR_CLONE OUT_DIR   # writes OUT_DIR/$ARCHIVE
#   bash tools/sglang_cpu/source_archive.sh check ARCHIVE                     # exit 1 unless it is the source
#
# The archive is the folder sgl-kernel/ of $FORK at $COMMIT with what a CPU build does not read
# left out (benchmark/, tests/, csrc/cpu/aarch64/) and pyproject_cpu.toml as its pyproject.toml.
# Its identity is the git tree id of that folder ($TREE): `check` recomputes it from the files
# (git init, add, write-tree in a scratch copy), so an archive made by hand, by `make`, or by
# anyone else from the same commit passes, and any other content is named as not the source.
set -euo pipefail

FORK=https://github.com/modal-projects/sglang
COMMIT=${SGL_KERNEL_COMMIT:-8905cbd42f4a27dbecad6487cd3904278756fef8}
TREE=${SGL_KERNEL_TREE:-7817f2379fcdd579c2017149d59d72c180d04ef9}  # its tests set both for a repository of their own
ARCHIVE=sgl-kernel-cpu-src-modal-projects-${COMMIT:0:7}.tar.gz

_source_die() { echo "source_archive: $*" >&2; exit 1; }

# source_tree_of DIR: the git tree id of the files under DIR (modes and contents, no history)
source_tree_of() {
  local scratch; scratch=$(mktemp -d)
  cp -a "$1/." "$scratch/"
  rm -rf "$scratch/.git"
  (cd "$scratch" && git init -q . && git add -A -f . && git write-tree)
  rm -rf "$scratch"
}

# check_source_archive ARCHIVE: exit 1 (naming both trees) unless ARCHIVE is the source above
check_source_archive() {
  local work; work=$(mktemp -d)
  tar -xzf "$1" -C "$work" || { rm -rf "$work"; _source_die "$1: not a readable .tar.gz"; }
  [ -d "$work/sgl-kernel" ] || { rm -rf "$work"; _source_die "$1 holds no sgl-kernel/ folder"; }
  local got; got=$(source_tree_of "$work/sgl-kernel")
  rm -rf "$work"
  [ "$got" = "$TREE" ] || _source_die "$1 is not sgl-kernel of $FORK at ${COMMIT:0:7}: its files' tree is" \
    "$got, the source's is $TREE (make it with: bash tools/sglang_cpu/source_archive.sh make $FORK DIR)"
}

# make_source_archive GIT_URL_OR_CLONE OUT_DIR: clone (or read a local clone), cut, check, write
make_source_archive() {
  local repo=$1 out=$2 work; work=$(mktemp -d)
  mkdir -p "$out"
  if [ -d "$repo/.git" ] || [ -f "$repo/HEAD" ]; then
    git -C "$repo" archive "$COMMIT" sgl-kernel | tar -x -C "$work" \
      || { rm -rf "$work"; _source_die "$repo has no commit $COMMIT (fetch it from $FORK)"; }
  else
    git clone -q --filter=blob:none --no-checkout "$repo" "$work/clone" \
      || { rm -rf "$work"; _source_die "cloning $repo failed"; }
    git -C "$work/clone" archive "$COMMIT" sgl-kernel | tar -x -C "$work" \
      || { rm -rf "$work"; _source_die "$repo has no commit $COMMIT"; }
    rm -rf "$work/clone"
  fi
  local src="$work/sgl-kernel"
  rm -rf "$src/benchmark" "$src/tests" "$src/csrc/cpu/aarch64"
  cp "$src/pyproject_cpu.toml" "$src/pyproject.toml"
  local got; got=$(source_tree_of "$src")
  [ "$got" = "$TREE" ] || { rm -rf "$work"; _source_die "the cut of $repo at ${COMMIT:0:7} has tree $got, not $TREE"; }
  tar -czf "$out/$ARCHIVE" -C "$work" sgl-kernel
  rm -rf "$work"
  echo "$out/$ARCHIVE"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    make) [ $# -eq 3 ] || _source_die "usage: $0 make GIT_URL_OR_CLONE OUT_DIR"; make_source_archive "$2" "$3" ;;
    check) [ $# -eq 2 ] || _source_die "usage: $0 check ARCHIVE"; check_source_archive "$2"; echo "$2: sgl-kernel of $FORK at ${COMMIT:0:7}" ;;
    *) _source_die "usage: $0 make GIT_URL_OR_CLONE OUT_DIR | check ARCHIVE" ;;
  esac
fi
