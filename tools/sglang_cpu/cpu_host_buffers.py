"""SGLang 0.5.23 on a CPU: host buffers without CUDA (installed into the SGLang venv by
tools/setup_sglang_cpu.sh, loaded by a .pth file; nothing of SGLang is edited).

`--enable-return-routed-experts` records each token's experts in a host buffer allocated
through `mem_cache/pool_host/common.py` `ALLOC_MEMORY_FUNCS`, whose entries cover npu, musa and
xpu; every other device falls to `alloc_with_host_register`, which pins the buffer and
registers it with `torch.cuda.cudart()`: on a CPU build of torch the server dies at start
("Torch not compiled with CUDA enabled"). A "cpu" entry here allocates the buffer plainly, as
that function does before it pins. GPU venvs never install this file."""

import importlib.abc
import importlib.util
import sys

TARGET = "sglang.srt.mem_cache.pool_host.common"


def plain_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Adds the "cpu" entry once SGLang's module has run (its import is lazy, in the server)."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real spec without this finder
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            funcs = getattr(module, "ALLOC_MEMORY_FUNCS", None)
            if isinstance(funcs, dict):
                funcs.setdefault("cpu", plain_alloc)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
