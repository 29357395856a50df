# Set-up and entry points. `make fuzz` and `make test` each build the environment on first use
# (a virtual environment in .venv, reusing a system torch where one is installed, e.g. a CUDA
# build on a GPU runner) and are fast no-ops for set-up afterwards.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel used where no torch is installed yet; the package itself accepts torch>=2.8.
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= dev,bench,xdist
STAMP := $(VENV)/.graphmode-installed

.PHONY: setup fuzz test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

# The built-in suite only (this repository's own tests are `make test`), at the CI budget.
fuzz: $(STAMP)
	$(PY) -m pytest --graphmode-fuzz --graphmode-backend=auto --graphmode-profile=ci \
		--pyargs pytest_graphmode._builtin.suite $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -n auto $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy pytest_graphmode runtime strategies

bench: $(STAMP)
	$(PY) -m pytest benchmarks -p no:xdist --benchmark-only $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
