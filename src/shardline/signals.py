"""Ctrl-C (SIGINT) and SIGTERM stop a long-running command quietly, whatever it inherited.

A process started from a background shell job (`cmd &`, nohup, some supervisors) inherits
SIGINT ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C or `kill -INT`
would never stop it. SIGTERM's default action kills the process on the spot, before any
`finally` (an engine's stop, a socket's close) runs, and an inherited SIG_IGN makes it a no-op.
So `relay`, `worker` and `serve` set both explicitly, and SIGTERM unwinds the way Ctrl-C does.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGINT_EXIT = 128 + signal.SIGINT  # 130, the shell's code for a process ended by SIGINT
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143


class _Received:
    terminated = False  # SIGTERM arrived: the KeyboardInterrupt it caused exits with 143


_received = _Received()


def stop_on_signals() -> None:
    """SIGINT raises KeyboardInterrupt (Python's own default, restored even if SIGINT was
    inherited ignored); SIGTERM does whatever SIGINT would do at that moment, then exits 143.

    Forwarding to the current SIGINT handler, rather than raising from a SIGTERM handler of its
    own, keeps one stop path per loop: asyncio.run replaces SIGINT's handler with one that
    cancels its main task (an exception raised in the middle of a task's step instead would
    leave that task failed and its connections' handlers logging tracebacks), and uvicorn
    installs its own handlers for both signals while it runs and re-raises the signal after
    its graceful shutdown. Only the main thread may set handlers (a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _received.terminated = False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _received.terminated = True
    on_sigint = signal.getsignal(signal.SIGINT)
    if not callable(on_sigint):  # someone set SIG_IGN/SIG_DFL since: stop anyway
        raise KeyboardInterrupt
    on_sigint(signal.SIGINT, frame)


def interrupted_exit_code() -> int:
    """The exit code after a KeyboardInterrupt: 143 if SIGTERM caused it, else 130."""
    return SIGTERM_EXIT if _received.terminated else SIGINT_EXIT
