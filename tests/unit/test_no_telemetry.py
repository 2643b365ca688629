"""shardline's processes send no usage events: `import openvino` would fork a telemetry child
(one was found deadlocked in OpenSSL, orphaned, after a worker exited)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_openvino_after_shardline_loads_no_telemetry() -> None:
    code = ("import sys, shardline, openvino, openvino.tools.ovc.utils as u\n"
            "print(sys.modules.get('openvino_telemetry'), u.tm.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["None", "openvino.tools.ovc.telemetry_stub"]
