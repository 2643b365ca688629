"""`shardline relay` stopped with Ctrl-C while connections are open ends quietly (exit 130, empty
stderr): Python 3.11's stream callback used to log a traceback per cancelled connection."""

from __future__ import annotations

import signal
import socket
import time

from tests.multiproc.procs import relay


def test_ctrl_c_with_open_connections_is_quiet() -> None:
    with socket.create_server(("127.0.0.1", 0)) as target:
        r = relay(f"127.0.0.1:{target.getsockname()[1]}", 5)
        clients = [socket.create_connection(("127.0.0.1", r.port)) for _ in range(3)]
        accepted = [target.accept()[0] for _ in clients]
        for c in clients:
            c.sendall(b"x" * 1000)
        time.sleep(0.2)  # every connection's handler is running
        r.proc.send_signal(signal.SIGINT)
        assert r.proc.wait(timeout=10) == 130
        assert r.stderr() == ""
        for s in clients + accepted:
            s.close()
        r.stop()
