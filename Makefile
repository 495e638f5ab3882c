# skippy_zmq: `make serve` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR := models/smollm2-135m-instruct
GGUF := models/SmolLM2-135M-Instruct.Q4_1.gguf
TOPOLOGY ?= topologies/smollm2-2stage.yaml

.PHONY: install model test test-quick serve bench bench-quick peers bench-peers bench-scale bench-spec gpu-check clean

install: $(VENV)/.installed $(VENV)/.kernel

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# instructor 1.17.0 (the one release that takes openai 3) caps jiter below what openai 3.57 needs:
	# installed without its resolver, with the dependencies it imports (tests/test_frameworks.py)
	$(BIN)/pip install -q --no-deps instructor==1.17.0
	$(BIN)/pip install -q "aiohttp>=3.14.3,<4" "docstring-parser==0.18.0" "rich>=13.7,<15"
	touch $@

# The native CPU kernel, built at install like a package's native code, into the venv
# (share/skippy_zmq/kernel), so a stage's first start loads it instead of compiling it (~9 CPU s);
# again when its sources change. Without a compiler the stages run the XLA path (and log why).
$(VENV)/.kernel: $(VENV)/.installed $(wildcard skippy_zmq/model/*.cc skippy_zmq/model/*.h)
	$(BIN)/skippy-zmq build-kernel && touch $@ || echo "make install: the native kernel was not built (see above)"

model: install $(MODEL_DIR)/model.json

$(GGUF): | $(VENV)/.installed
	$(BIN)/skippy-zmq fetch-model smollm2 --out models

$(MODEL_DIR)/model.json: | $(GGUF)
	$(BIN)/skippy-zmq convert --gguf $(GGUF) --out $(MODEL_DIR)

# The suite runs on PYTEST_WORKERS parallel workers (pytest-xdist): a module's tests stay on one worker,
# and the modules that share the session's pipelines stay on one (tests/conftest.py). 0: one process.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -rs -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadscope

# pytest exits 5 when it collects no test; that is not a failure of the suite.
# --durations: the slowest units are printed at the end, so every run (CI's too) says where the time went.
test: install model
	$(PYTEST) --durations=40 tests; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

# The fast part of the suite: no process spawning, no real-model runs (pytest -m "not slow").
test-quick: install model
	$(PYTEST) -m "not slow" tests; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

serve: install model
	$(BIN)/skippy-zmq up $(TOPOLOGY)

# Benchmarks write bench-out/bench.{json,md} and PNG plots; matplotlib comes with the `bench` extra.
bench: install model
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/skippy-zmq bench all --out bench-out

bench-quick: install model
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/skippy-zmq bench all --quick --out bench-out

# The llama.cpp a user deploys: llama-server, llama-bench, llama-quantize and rpc-server built from the llama-cpp-python
# sdist's vendored source with cmake and ninja from PyPI, CPU only, once, into ~/.cache/skippy_zmq
# ($$SKIPPY_PEERS_DIR); about 10-15 minutes on 2 cores, reused afterwards.
peers: install
	$(BIN)/pip install -q -e '.[peers-build]'
	$(BIN)/python -c "from skippy_zmq.devtools.bench.llama_build import build; build()"

# Ours beside llama-server on the same GGUF through both HTTP APIs: single stream, speculation, concurrency;
# writes bench-out/peers.{json,md}.
bench-peers: peers model
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/skippy-zmq bench peers --out bench-out

# Random models of real shapes (Llama-3.2-1B, Llama-3.1-8B; q4) on 1-3 stages beside llama.cpp on the very
# same weights: about 12 minutes on 2 cores once models/random/ holds them (making the 8B adds 2.5).
bench-scale: install model
	$(BIN)/pip install -e '.[test,bench,peers]'
	$(BIN)/skippy-zmq bench scale --out bench-out

# Speculative decoding on SmolLM2 (q4 stages, the GGUF's levels): off / on on 1, 2 and 3 stages (5 and 20 ms
# per simulated hop), 8 streams, beside llama.cpp plain and with prompt lookup; writes bench-out/spec.{json,md}.
bench-spec: install model
	$(BIN)/pip install -e '.[test,bench,peers]'
	$(BIN)/skippy-zmq bench spec --out bench-out

# One NVIDIA GPU: parity and benches on gpu:0 (installs the `gpu` extra if JAX sees no GPU;
# GPU_WHEELS=DIR: offline, see scripts/gpu-check.sh).
gpu-check:
	scripts/gpu-check.sh bench-out/gpu

clean:
	rm -rf $(VENV) bench-out runs *.egg-info
