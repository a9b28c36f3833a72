# pdserve: set-up, run and test on a fresh machine. `make run` and `make test` do all set-up themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TINY := build/tiny-llama
PROMPT ?= The class statement
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run run-engine test bench bench-disagg bench-cluster bench-http bench-reuse bench-soak bench-quant bench-roofline bench-overhead bench-families gpu-check clean

# torch is pinned to the CPU build that lies on these machines' disk; see README for CUDA machines.
$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -m common.engine.cpu_kernels || echo "CPU kernels not built: the engine uses its PyTorch attention"
	touch $@

setup: $(BIN)/.installed

$(TINY)/config.json: $(BIN)/.installed
	$(BIN)/pdserve model build-tiny --arch llama --out $(TINY)

# The whole cluster (Redis, router, 1 prefill + 1 decode worker) as local processes; one streamed generation.
run: $(TINY)/config.json
	scripts/demo.sh $(TINY) "$(PROMPT)"

# One in-process engine, no cluster.
run-engine: $(TINY)/config.json
	$(BIN)/pdserve run --model $(TINY) --prompt "$(PROMPT)" --max-tokens 32

test: $(BIN)/.installed build/promtool build/checkov/bin/checkov
	$(BIN)/ruff check common pdserve services tests benchmarks scripts
	$(BIN)/python -m pytest -q

# checkov (the IaC scanner of tests/deploy) in a virtual environment of its own: its pins (packaging<24,
# networkx<2.7, botocore's python-dateutil<3) conflict with pytest 9 and kubernetes in .venv. Where pip cannot
# install it, the checkov tests skip.
build/checkov/bin/checkov:
	@$(PY) -m venv build/checkov && build/checkov/bin/pip install -q checkov==3.3.30 \
		|| { rm -rf build/checkov; echo "checkov unavailable: pip install checkov failed; tests/deploy skips checkov checks"; }
build/checkov: build/checkov/bin/checkov

# promtool (from Debian's prometheus package) for tests/deploy; where apt-get cannot fetch it, those tests skip.
build/promtool:
	@mkdir -p build
	@tmp=$$(mktemp -d) && (cd "$$tmp" && apt-get download -q prometheus && dpkg-deb -x prometheus_*.deb x) \
		&& cp "$$tmp/x/usr/bin/promtool" $@ \
		|| echo "promtool unavailable: apt-get download prometheus or dpkg-deb -x failed; tests/deploy skips promtool checks"; \
		rm -rf "$$tmp"

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/engine_throughput.py $(ARGS)

bench-disagg: $(BIN)/.installed
	$(BIN)/python benchmarks/disagg_overhead.py

bench-cluster: $(BIN)/.installed
	$(BIN)/python benchmarks/cluster_reference.py

bench-http: $(BIN)/.installed
	$(BIN)/python benchmarks/http_overhead.py

bench-reuse: $(BIN)/.installed
	$(BIN)/python benchmarks/kv_reuse.py

bench-soak: $(BIN)/.installed
	$(BIN)/python benchmarks/soak.py --json build/soak.json

# Prefill and single-stream decode as fractions of this machine's FLOP and bandwidth roofline (ARGS="--size 350m")
bench-roofline: $(BIN)/.installed
	$(BIN)/python benchmarks/roofline.py $(ARGS)

# 16 concurrent streams through the router of a local cluster against the bare engine
bench-overhead: $(BIN)/.installed
	$(BIN)/python benchmarks/cluster_overhead.py $(ARGS)

# int8 weight-only quantization against fp32 on the 60M Llama (ARGS="--dtype bfloat16" for bf16)
bench-quant: $(BIN)/.installed
	$(BIN)/python benchmarks/quantization.py $(ARGS)

# Decode speed across model families (MoE, Gemma, Phi-3 ...) against a Llama of the same shape (ARGS="--dtype bfloat16")
bench-families: $(BIN)/.installed
	$(BIN)/python benchmarks/families.py $(ARGS)

# One prepared check on a GPU machine (no set-up: it runs with whatever python there has torch); ARGS=... passes
# flags, e.g. make gpu-check ARGS="--device cpu --quick". With $$OUT set, the table and JSON land there too.
gpu-check:
	benchmarks/gpu_check.sh $(ARGS)

clean:
	rm -rf $(VENV) build
