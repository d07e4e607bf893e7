# Two commands matter: `make serve` and `make test`. Both install what is missing first.
PYTHON ?= python3
# `make test` runs in this many pytest-xdist workers; the Ray tests keep to one of them (tests/conftest.py).
TEST_WORKERS ?= 2
PIP := $(PYTHON) -m pip
# A CPU build of torch unless one is installed already (a GPU machine keeps its CUDA build).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test test-gpu lint bench-encoder

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	@($(PIP) show -q vlm-serve >/dev/null 2>&1 && \
	  $(PYTHON) -c "import ray, av, fastapi, transformers, pytest, hypothesis, orjson, psutil, openai, matplotlib, llguidance, mkdocs, material, xdist" 2>/dev/null) || $(PIP) install -q -e ".[dev]"

# Ray Serve's low-overhead mode for the Ray this starts (deployments/ray_env.py; a variable already set wins).
serve: install
	env $$($(PYTHON) -m deployments.ray_env) serve run serve_config.yaml

test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-gpu: install
	$(PYTHON) -m pytest -q -m gpu

lint: install
	$(PYTHON) -m ruff check .

bench-encoder:
	$(PYTHON) benchmarks/encoder.py
