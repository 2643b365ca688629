"""Opening a GGUF file in llama.cpp (llama-cpp-python) for the golden-file scripts here.

The tests never import llama_cpp: they compare against the JSON these scripts wrote, made on the
same hand-built files (each golden names its file's sha256; tests/ggufs.py builds them
deterministically). Regenerate with `make bench-deps`, then `python -m tests.golden.<script>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"
F32 = 0  # GGML_TYPE_F32  # the version the goldens were made with (pyproject.toml [bench])


def open_llama(path: Path, n_ctx: int = 512, logits_all: bool = False, vocab_only: bool = False) -> Any:
    """llama_cpp.Llama on `path`, 2 threads. Its extra buffer types (the AMX kernels) are off:
    on these VMs they crash in decode (SIGILL), and they are not the reference anyway."""
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    if llama_cpp.__version__ != LLAMA_CPP_PYTHON:
        raise SystemExit(f"llama-cpp-python {llama_cpp.__version__} is installed; the goldens are "
                         f"made with {LLAMA_CPP_PYTHON}")
    default = lc.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        p.vocab_only = vocab_only
        return p

    lc.llama_model_default_params = params
    try:
        # An f32 KV cache (llama.cpp's default is f16: logits move by ~1e-3), as shardline's
        # exact precision keeps it.
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=2, n_threads_batch=2, logits_all=logits_all,
                               verbose=False, vocab_only=vocab_only, type_k=F32, type_v=F32)
    finally:
        lc.llama_model_default_params = default
