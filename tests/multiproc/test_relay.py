"""`shardline relay` stopped with Ctrl-C while connections are open ends quietly (exit 130, empty
stderr): Python 3.11's stream callback used to log a traceback per cancelled connection. It does
so whether it was started with SIGINT at its default or ignored (as a shell's background job
starts it), whatever the disposition the test process itself inherited."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from tests.multiproc.procs import relay


@pytest.mark.parametrize("ignore", [(), (signal.SIGINT,)], ids=["sigint-default", "sigint-ignored"])
def test_ctrl_c_with_open_connections_is_quiet(ignore: tuple[signal.Signals, ...]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as target, \
            relay(f"127.0.0.1:{target.getsockname()[1]}", 5, ignore=ignore) as r:
        target.settimeout(10)
        clients = [socket.create_connection(("127.0.0.1", r.port), timeout=10) for _ in range(3)]
        accepted = [target.accept()[0] for _ in clients]
        try:
            for c in clients:
                c.sendall(b"x" * 1000)
            time.sleep(0.2)  # every connection's handler is running
            r.proc.send_signal(signal.SIGINT)
            assert r.proc.wait(timeout=10) == 130
            assert r.stderr() == ""
        finally:
            for s in clients + accepted:
                s.close()
