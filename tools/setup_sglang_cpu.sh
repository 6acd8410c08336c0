#!/usr/bin/env bash
# Build a virtual environment with the real SGLang 0.5.23 server for CPU (~2 min from wheels).
#
#   usage: tools/setup_sglang_cpu.sh VENV_DIR --offline DIR [--from-source]
#          tools/setup_sglang_cpu.sh VENV_DIR --from-git [URL_OR_CLONE]
#
# then start servers with
#   SGLANG_USE_CPU_ENGINE=1 VENV_DIR/bin/python -m sglang.launch_server --device cpu ...
#
# The plain-text inputs live in the project (tools/sglang_cpu/deps.txt, constraints.txt); the
# one binary SGLang needs beyond PyPI, sgl-kernel's CPU build, comes from DIR:
#   DIR/sglang_kernel_cpu-*.whl             the x86-64-v3 (AVX2) build without the AMX switch op
#                                           (convert_weight_packed): every x86-64 CPU, AMX or not
#   DIR/sgl-kernel-cpu-src-*.tar.gz         its source (the folder sgl-kernel/ of the fork named
#                                           in tools/sglang_cpu/README.md): built here the same way
#                                           when the wheel is missing, or always with --from-source
#                                           (~10 min on 2 cores)
# --from-git cuts that source archive from a clone of the fork (default: its GitHub URL; or a
# local clone) and builds from it: what a person outside this project's machines runs. Any
# source archive, given or cut, must be the fork's commit (tools/sglang_cpu/source_archive.sh
# checks its files' git tree) before it is built.
# Everything else comes from pip's configured index. Elsewhere than this project's machines
# torch==2.13.0 must resolve to the CPU build: point pip at PyTorch's CPU wheel index with
# PIP_EXTRA_INDEX_URL. A VENV_DIR that already passes the final import check is left as it is.
# Each step is explained in tools/sglang_cpu/README.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
inputs="$here/sglang_cpu"
TORCH=2.13.0 TORCHVISION=0.28.0 SGLANG=0.5.23 ROUTER=0.3.2

# shellcheck source=tools/sglang_cpu/source_archive.sh
. "$inputs/source_archive.sh"

usage() { echo "usage: $0 VENV_DIR --offline DIR [--from-source] | $0 VENV_DIR --from-git [URL_OR_CLONE]" >&2; exit 2; }
die() { echo "setup_sglang_cpu: $*" >&2; exit 1; }
venv="" offline="" from_source=0 from_git=""
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) [ $# -ge 2 ] || usage; offline=$2; shift 2 ;;
    --offline=*) offline=${1#--offline=}; shift ;;
    --from-source) from_source=1; shift ;;
    --from-git)
      if [ $# -ge 2 ] && [ "${2#-}" = "$2" ] && [ -n "$venv" ]; then from_git=$2; shift 2; else from_git=$FORK; shift; fi ;;
    --from-git=*) from_git=${1#--from-git=}; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) usage ;;
    *) [ -z "$venv" ] || usage; venv=$1; shift ;;
  esac
done
[ -n "$venv" ] || usage
if [ -n "$from_git" ]; then
  [ -z "$offline" ] || die "give --offline DIR or --from-git, not both"
  offline=$(mktemp -d)  # holds only the archive cut from the fork: the kernel is built from it
  trap 'rm -rf "$offline"' EXIT
  from_source=1
else
  [ -n "$offline" ] || usage
fi
[ -d "$offline" ] || die "offline directory $offline does not exist"
offline=$(cd "$offline" && pwd)

# The import SGLang's server makes at start, and the router's; exit 132 (SIGILL) is the sign of a
# kernel compiled for instructions this CPU lacks.
check_venv() {
  SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c "
import sglang.srt.entrypoints.http_server, sgl_kernel, sglang_router, torch, torchvision, sglang
from sglang.srt.utils.common import cpu_has_amx_support
assert sglang.__version__ == '$SGLANG' and torch.__version__.startswith('$TORCH'), (sglang.__version__, torch.__version__)
assert not cpu_has_amx_support(), 'sgl-kernel registers convert_weight_packed: SGLang would take its AMX paths' 
import sglang.srt.mem_cache.pool_host.common as host
assert 'cpu' in host.ALLOC_MEMORY_FUNCS, 'no CPU host buffers (tools/sglang_cpu/cpu_host_buffers.py): --enable-return-routed-experts would die' 
print('sglang-cpu ready: sglang', sglang.__version__, 'torch', torch.__version__)" 2>&1
}
if [ -x "$venv/bin/python" ] && [ $from_source -eq 0 ] && out=$(check_venv); then
  echo "$out" | grep -v -i warn
  exit 0
fi

# One sgl-kernel on every CPU: the x86-64-v3 build without the op `convert_weight_packed`, whose
# presence switches SGLang 0.5.23 to its AMX paths on CPUs with AMX
# (`sglang.srt.utils.common.cpu_has_amx_support`); this source's AMX ops predate the signatures
# 0.5.23 calls, and the server died on its first request on an AMX Xeon. Without it SGLang runs
# its native torch paths everywhere: the same code and numbers on AVX2, AVX-512 and AMX CPUs.
flavour=x86-64-v3
wheel=$(ls "$offline"/sglang_kernel_cpu-*.whl 2>/dev/null | head -1 || true)
if [ -n "$from_git" ]; then
  echo "setup_sglang_cpu: cutting sgl-kernel's source from $from_git at ${COMMIT:0:7}" >&2
  make_source_archive "$from_git" "$offline" >/dev/null
fi
source_archive=$(ls "$offline"/sgl-kernel-cpu-src-*.tar.gz 2>/dev/null | head -1 || true)
if [ $from_source -eq 1 ] || [ -z "$wheel" ]; then
  [ -n "$source_archive" ] || die "no sgl-kernel for this CPU in $offline: neither the $flavour wheel" \
    "($wheel_dir/sglang_kernel_cpu-*.whl) nor a source archive ($offline/sgl-kernel-cpu-src-*.tar.gz)"
  wheel=""
fi

python3 -m venv "$venv"
pip="$venv/bin/pip install -q"
$pip "torch==$TORCH"                                          # the CPU build
$pip -c "$inputs/constraints.txt" -r "$inputs/deps.txt"       # sglang's CPU-side dependencies, torch held
$pip --no-deps "torchvision==$TORCHVISION" "sglang==$SGLANG"  # both pin a CUDA torch: --no-deps
$pip --no-deps "sglang-router==$ROUTER"

# Build sgl-kernel's CPU wheel from the source archive against the venv's torch (its ABI is
# tied to torch's). Baseline flags replace upstream's -march=x86-64-v4 -mavx512bf16
# -mavx512vnni -mamx-tile -mamx-bf16 -mamx-int8 by -march=x86-64-v3 (AVX2, FMA, BMI2): code
# behind CPU_CAPABILITY_AVX512 then compiles out and the wheel imports on any x86-64-v3 CPU.
build_kernel_from_source() {
  if [ ! -e /usr/include/numa.h ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q libnuma-dev >/dev/null \
        || { apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q libnuma-dev >/dev/null; } \
        || die "building sgl-kernel needs libnuma-dev; apt-get install libnuma-dev failed"
    else
      die "building sgl-kernel needs libnuma's headers (Debian: apt-get install libnuma-dev)"
    fi
  fi
  check_source_archive "$source_archive"
  $pip scikit-build-core cmake wheel
  local work; work=$(mktemp -d)
  tar -xzf "$source_archive" -C "$work"
  local src="$work/sgl-kernel"
  [ -f "$src/pyproject_cpu.toml" ] || die "$source_archive has no sgl-kernel/pyproject_cpu.toml"
  local torch_version; torch_version=$("$venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
  sed "s/\"torch==[^\"]*\"/\"torch==$torch_version\"/" "$src/pyproject_cpu.toml" > "$src/pyproject.toml"
  local cmake="$src/csrc/cpu/CMakeLists.txt"
  sed -i '/-march=x86-64-v4/,/-mamx-int8/c\        -march=x86-64-v3' "$cmake"
  grep -q -- '-march=x86-64-v3' "$cmake" && ! grep -q -- '-mamx\|-mavx512\|x86-64-v4' "$cmake" \
    || die "$cmake no longer holds the x86_64 flags this script replaces (-march=x86-64-v4 ... -mamx-int8)"
  local ext="$src/csrc/cpu/torch_extension_cpu.cpp"  # the op that turns SGLang's AMX paths on: not registered
  sed -i '/m\.def("convert_weight_packed(/d; /m\.impl("convert_weight_packed",/d' "$ext"
  ! grep -qE 'm\.(def|impl)\("convert_weight_packed[(",]' "$ext" \
    || die "$ext still registers convert_weight_packed in a form this script does not remove"
  echo "setup_sglang_cpu: building sgl-kernel ($flavour flags) from $(basename "$source_archive")" >&2
  (cd "$src" && VIRTUAL_ENV="$venv" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
     "$venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/dist" .) \
    || die "building sgl-kernel from $source_archive failed (above)"
  wheel=$(ls "$work"/dist/sglang_kernel_cpu-*.whl)
  $pip --no-deps --force-reinstall "$wheel"
  rm -rf "$work"
}
if [ -n "$wheel" ]; then $pip --no-deps --force-reinstall "$wheel"; else build_kernel_from_source; fi

# PyPI's torchvision is a CUDA build: guard its two fake registrations so `import torchvision`
# works against the CPU torch (idempotent: a guarded line no longer starts with `@torch`).
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
sed -i 's/^@torch.library.register_fake("torchvision::\(q\?nms\)")/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' \
  "$site/torchvision/_meta_registrations.py"

# SGLang's routed-experts host buffer pins memory through CUDA; on a CPU it gets a plain one
# (tools/sglang_cpu/cpu_host_buffers.py says why), loaded at every interpreter start by a .pth.
cp "$inputs/cpu_host_buffers.py" "$site/dapo_mega_sglang_cpu_host_buffers.py"
echo "import dapo_mega_sglang_cpu_host_buffers" > "$site/dapo_mega_sglang_cpu_host_buffers.pth"

rc=0
out=$(check_venv) || rc=$?
if [ $rc -ne 0 ]; then
  echo "setup_sglang_cpu: importing sglang / sgl_kernel in $venv failed with exit $rc (132 = an instruction this CPU lacks):" >&2
  echo "$out" | grep -v -i warn | tail -5 >&2
  exit 1
fi
echo "$out" | grep -v -i warn
