# Two set-up commands: `make serve` and `make test`. Each builds what it needs from scratch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv model kernels kernels-avx2 test test-slow serve clean dynamo-venv serve-dynamo aiperf prometheus-env cluster-env

$(STAMP): requirements.txt requirements-load.txt requirements-bench.txt requirements-nodeps.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt -r requirements-load.txt -r requirements-bench.txt
	$(BIN)/pip install -q --no-deps -r requirements-nodeps.txt
	# the stub's interpreter runs isolated (PYTHONPATH is ignored): make backend/ importable from the venv
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

model: venv
	$(BIN)/python -m backend.serving.model_store

# The CPU kernels, compiled once per CPU before any server or test loads them, with a progress line (a 2-core Zen 3
# takes about 2 minutes; the log says what the last build on this CPU took). Dynamo's venv loads the same build.
kernels: venv
	$(BIN)/python -m backend.engine.kernels.cpu_kernels

# Their AVX2 build too, which tests/test_kernels_avx2.py runs the CPU tests on where the CPU has AVX-512 (on an
# AVX2-only CPU the native build is the AVX2 code, which the whole suite runs)
kernels-avx2: venv
	if grep -qw avx512f /proc/cpuinfo; then LLM_KERNEL_MARCH=x86-64-v3 $(BIN)/python -m backend.engine.kernels.cpu_kernels; fi

test: model kernels kernels-avx2 dynamo-venv prometheus-env cluster-env
	$(BIN)/python -m pytest -q --durations=20

# Debian's prometheus (tests/test_dashboard.py scrapes a test server with it); apt-get, as root, when missing
prometheus-env:
	bash scripts/prometheus_env.sh

# Debian's etcd-server and nats-server (Dynamo's discovery and event planes: serve-dynamo DISCOVERY=etcd, and the
# test that runs a cluster on them); apt-get, as root, when missing
cluster-env:
	bash scripts/cluster_env.sh

test-slow: model kernels
	$(BIN)/python -m pytest -q -m slow

# A real tritonserver (from the nvidia-pytriton wheel here; the image's own in Docker) on model_repository/,
# on 127.0.0.1 with the admin APIs behind $TRITON_ADMIN_KEY (docs/security.md). SERVE_ARGS="--host 0.0.0.0"
# opens it to the network.
SERVE_ARGS ?=
serve: model kernels
	$(BIN)/python -m backend.triton.launcher --model-repository model_repository $(SERVE_ARGS)

# NVIDIA Dynamo in its own venv (.venv-dynamo, ~1 min): the frontend (OpenAI API on :8080, KV-aware router)
# and WORKERS engine workers on this host, or PREFILL_WORKERS=1 DECODE_WORKERS=1 (disaggregated: the prompt's
# KV blocks move from the prefill to the decode worker; CONDITIONAL_DISAGG='{"policy": "isl_bounding"}' keeps
# mostly-cached turns on the decode worker). Engine settings for every worker: WORKER_ARGS="--max-num-seqs 32".
# DISCOVERY=etcd: etcd discovery and NATS JetStream events (those ETCD_ENDPOINTS / NATS_SERVER name, else started on
# this host), as a cluster of several hosts runs them; file (the default): one host, neither. HOSTS=1 (with
# DISCOVERY=etcd; root): etcd + NATS, the frontend and each worker in a network namespace of its own, as hosts.
# PLANNER='{"decode_scale_up_kv_rate": 70, "decode_scale_down_kv_rate": 10}' (with DISCOVERY=etcd): Dynamo's planner
# in load mode adds and stops workers between MIN_WORKERS and MAX_WORKERS (docs/dynamo.md).
WORKERS ?= 2
PREFILL_WORKERS ?= 0
DECODE_WORKERS ?= 0
CONDITIONAL_DISAGG ?=
WORKER_ARGS ?=
DISCOVERY ?= file
HOSTS ?=
PLANNER ?=
MIN_WORKERS ?= 1
MAX_WORKERS ?= 4
dynamo-venv:
	bash scripts/dynamo_env.sh

serve-dynamo: model kernels dynamo-venv $(if $(filter etcd,$(DISCOVERY)),cluster-env)
	.venv-dynamo/bin/python -m backend.dynamo.launcher --workers $(WORKERS) --prefill-workers $(PREFILL_WORKERS) \
		--discovery $(DISCOVERY) $(if $(HOSTS),--hosts) \
		--decode-workers $(DECODE_WORKERS) $(if $(CONDITIONAL_DISAGG),--conditional-disagg '$(CONDITIONAL_DISAGG)') \
		$(if $(PLANNER),--planner '$(PLANNER)' --min-workers $(MIN_WORKERS) --max-workers $(MAX_WORKERS)) \
		-- $(WORKER_ARGS)

# NVIDIA AIPerf (own venv, .venv-aiperf) against a RUNNING `make serve-dynamo`: synthetic chat, 256 tokens in,
# 64 out (EOS ignored), streaming; summary on stdout, artifacts in results/aiperf/.
AIPERF_URL ?= 127.0.0.1:8080
AIPERF_ARGS ?= --concurrency 4 --request-count 64
aiperf: model
	bash load_tests/aiperf_env.sh
	.venv-aiperf/bin/aiperf profile -m SmolLM2-135M-Instruct --url $(AIPERF_URL) --endpoint-type chat --streaming \
		--tokenizer "$$($(BIN)/python -c 'from backend.serving.model_store import default_model_dir; print(default_model_dir())')" \
		--synthetic-input-tokens-mean 256 --synthetic-input-tokens-stddev 0 --output-tokens-mean 64 \
		--output-tokens-stddev 0 --extra-inputs ignore_eos:true --random-seed 0 --artifact-dir results/aiperf $(AIPERF_ARGS)

clean:
	rm -rf $(VENV) .venv-dynamo .cache

# ---- load test (issue 5): locust against a RUNNING server (start one with `make serve`) ----
# make load [LOAD_HOST=127.0.0.1:8001] [LOAD_METRICS=http://127.0.0.1:8002/metrics] [LOAD_USERS=32]
#           [LOAD_TIME=60s] [LOAD_SHAPE=constant|step|poisson] [LOAD_PROTOCOL=grpc|http]
#           [LOAD_ARGS="--prompt-set shared-system --max-tokens 16-128 --rate 4"]
# LOAD_PROTOCOL=http wants LOAD_HOST=http://127.0.0.1:8000. Writes locust's CSVs, HTML report and log to
# $(LOAD_OUT), prints a summary, and the engine's KV blocks (and a local server's memory) before and after.
LOAD_HOST ?= 127.0.0.1:8001
LOAD_METRICS ?= http://127.0.0.1:8002/metrics
LOAD_USERS ?= 32
LOAD_TIME ?= 60s
LOAD_SHAPE ?= constant
LOAD_PROTOCOL ?= grpc
LOAD_ARGS ?=
LOAD_OUT ?= results/load
LOAD_STATS = $(BIN)/python -m load_tests.server_stats --metrics-url $(LOAD_METRICS) \
	--port $(lastword $(subst :, ,$(LOAD_HOST)))

.PHONY: load

load: venv
	mkdir -p $(LOAD_OUT)
	$(LOAD_STATS) --label start
	LOAD_SHAPE=$(LOAD_SHAPE) LOAD_PROTOCOL=$(LOAD_PROTOCOL) $(BIN)/locust -f load_tests/locustfile.py --headless --only-summary \
		-H $(LOAD_HOST) -u $(LOAD_USERS) -r $(LOAD_USERS) -t $(LOAD_TIME) $(LOAD_ARGS) \
		--csv $(LOAD_OUT)/load --html $(LOAD_OUT)/load.html > $(LOAD_OUT)/locust.log 2>&1; \
	status=$$?; \
	$(BIN)/python -m load_tests.summarize $(LOAD_OUT)/load_stats.csv || status=1; \
	$(LOAD_STATS) --label end --wait-idle 30 || status=1; \
	echo "report: $(LOAD_OUT)/load.html, locust log: $(LOAD_OUT)/locust.log"; \
	exit $$status
