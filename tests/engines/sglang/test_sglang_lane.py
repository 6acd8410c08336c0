"""The real-SGLang CPU lane runs the same code on every CPU: SGLang 0.5.23 takes its Intel AMX
paths only where the CPU has AMX and sgl-kernel registers `convert_weight_packed`
(`sglang.srt.utils.common.cpu_has_amx_support`). The kernel tools/setup_sglang_cpu.sh installs
(prebuilt or built from source) leaves that op out, so on an AMX Xeon too SGLang runs its native
torch paths (the AMX build crashed 0.5.23 on its first request there: issue #37)."""

import json
import os
import subprocess

from sglang_venv import sglang_python_or_skip

PROBE = ("import json, torch; from sglang.srt.utils.common import cpu_has_amx_support; "
         "print(json.dumps([bool(torch.cpu._is_amx_tile_supported()), bool(cpu_has_amx_support())]))")


def test_sglangs_amx_backend_is_off_in_the_lane_whatever_the_cpu():
    python = sglang_python_or_skip()
    out = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    cpu_has_amx, backend_on = json.loads(out.stdout.strip().splitlines()[-1])
    assert backend_on is False, f"SGLang's AMX backend is on (this CPU has AMX: {cpu_has_amx})"
