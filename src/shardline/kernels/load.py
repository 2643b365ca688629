"""The kernels' library into an OpenVINO Core: once per Core, before it reads a stage.

`attach(core)` adds the built library's ops (True) or, where it is not built or will not load,
the Python declarations (False), so a graph with the ops still reads and its ops can be
replaced by the plugin's form. Why the library is missing is said once per process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from functools import cache

import openvino as ov

from shardline.kernels.build import library
from shardline.kernels.ops import GgufGather, GgufMatMul

log = logging.getLogger(__name__)
# Set to "0" to run every stage on OpenVINO's own matmuls (what a machine without a compiler gets).
ENV = "SHARDLINE_KERNELS"
_ATTACHED: weakref.WeakKeyDictionary[ov.Core, bool] = weakref.WeakKeyDictionary()


@cache
def why_not() -> str | None:
    """None when the library can be used here, else why not (said once)."""
    if os.environ.get(ENV, "1") == "0":
        why = f"{ENV}=0"
    elif not library().is_file():
        why = "not built for these sources (run: python -m shardline.kernels.build)"
    else:
        try:
            ctypes.CDLL(str(library()))
            return None
        except OSError as e:
            why = f"cannot be loaded: {e}"
    log.warning("shardline's block kernels are off (%s): stages use OpenVINO's own matmuls", why)
    return why


def isa() -> str | None:
    """The ISA the kernels run at on this CPU (avx2, avx-vnni, scalar), or None without them."""
    if why_not() is not None:
        return None
    lib = ctypes.CDLL(str(library()))
    lib.shardline_kernel_isa.restype = ctypes.c_char_p
    return str(lib.shardline_kernel_isa().decode())


def attach(core: ov.Core) -> bool:
    """The ops into `core` (at most once); True if they are the built kernels."""
    if core in _ATTACHED:
        return _ATTACHED[core]
    native = why_not() is None
    if native:
        core.add_extension(str(library()))
    else:
        core.add_extension(ov.OpExtension(GgufMatMul))
        core.add_extension(ov.OpExtension(GgufGather))
    _ATTACHED[core] = native
    return native
