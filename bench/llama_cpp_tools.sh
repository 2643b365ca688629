#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-bench, llama-server, ggml-rpc-server, llama-gguf-split) from the
# sources the llama-cpp-python sdist vendors (the version pyproject.toml's [bench] pins), for the
# benchmarks that compare against them. Nothing of llama.cpp is committed here: the sdist comes
# from PyPI. About 15 minutes on 2 cores. Prints the folder holding the binaries.
#
#   bash bench/llama_cpp_tools.sh            # -> ~/.cache/shardline/llama.cpp/build/bin
#   bash bench/llama_cpp_tools.sh --exact-gelu
#
# --exact-gelu builds llama-server alone, from the same source with one line changed: ggml's CPU
# GELU computed in f32 instead of looked up in its fp16 table (GGML_GELU_FP16, ggml-cpu/vec.h),
# the reference for Gemma's exact logits (tests/golden/families_llama_server.py).
set -euo pipefail
VERSION=0.3.36
ROOT="${SHARDLINE_LLAMA_CPP:-$HOME/.cache/shardline/llama.cpp}"
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
BIN="$ROOT/build/bin"
if [ "${1:-}" = "--exact-gelu" ]; then
    bash "$0" >/dev/null  # the stock source first
    EXACT="$ROOT-exact-gelu"
    if [ ! -x "$EXACT/build/bin/llama-server" ]; then
        if [ ! -d "$EXACT/src" ]; then
            rm -rf "$EXACT/src.partial" && mkdir -p "$EXACT"
            cp -r "$ROOT/src/vendor/llama.cpp" "$EXACT/src.partial"
            sed -i 's|^#define GGML_GELU_FP16$|// exact GELU: #define GGML_GELU_FP16|' "$EXACT/src.partial/ggml/src/ggml-cpu/vec.h"
            grep -q '^// exact GELU: #define GGML_GELU_FP16$' "$EXACT/src.partial/ggml/src/ggml-cpu/vec.h"
            mv "$EXACT/src.partial" "$EXACT/src"
        fi
        cmake -S "$EXACT/src" -B "$EXACT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
            -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF >&2
        cmake --build "$EXACT/build" -j 2 --target llama-server >&2
    fi
    echo "$EXACT/build/bin"; exit 0
fi
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-server" ] && [ -x "$BIN/ggml-rpc-server" ]; then
    echo "$BIN"; exit 0
fi
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src/vendor/llama.cpp" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/sdist" >&2
    rm -rf "$ROOT/src.partial" && mkdir -p "$ROOT/src.partial"
    tar xzf "$ROOT/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT/src.partial" --strip-components=1
    mv "$ROOT/src.partial" "$ROOT/src"
fi
# AMX kernels die with SIGILL on these VMs (MISSION.md): off, as in `make bench-deps`.
cmake -S "$ROOT/src/vendor/llama.cpp" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_RPC=ON -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$ROOT/build" -j 2 --target llama-bench llama-server ggml-rpc-server llama-gguf-split >&2
echo "$BIN"
