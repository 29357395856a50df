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

# mypy cannot follow the editable install's import hook, and runtime/, strategies/ and planner/ are
# installed as pytest_graphmode.runtime, .strategies and .planner: without the package laid out as
# installed, every import across those folders would be Any and go unchecked.
MYPY_TREE := $(VENV)/mypy-tree

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/pytest_graphmode
	ln -s $(CURDIR)/pytest_graphmode/* $(CURDIR)/runtime $(CURDIR)/strategies \
		$(CURDIR)/planner $(MYPY_TREE)/pytest_graphmode/
	cd $(MYPY_TREE) && $(abspath $(PY)) -m mypy --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/.mypy_cache -p pytest_graphmode

bench: $(STAMP)
	$(PY) -m pytest benchmarks -p no:xdist --benchmark-only $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
