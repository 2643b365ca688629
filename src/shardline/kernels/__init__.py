"""shardline's own OpenVINO extension: matmuls on GGUF blocks as the file stores them (C++ in
src/, built by `python -m shardline.kernels.build`, which the Makefile's install runs)."""
