"""shardline: one large language model across a fleet of ordinary PCs."""

import sys

__version__ = "0.1.0"

# `import openvino` sends a usage event (openvino.tools.ovc at import; NNCF likewise): from a
# thread it forks a child that opens an HTTPS connection. A fork while another thread holds
# OpenSSL's lock leaves that child deadlocked for ever, orphaned when its parent exits (seen:
# left-over "shardline worker" processes, each a telemetry child stuck in SSL_CTX_new). shardline
# sends nothing anywhere: in its processes the telemetry module is not importable, and OpenVINO
# and NNCF fall back to their no-op stubs (both import it under `except ImportError`).
if "openvino_telemetry" not in sys.modules:
    sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]
