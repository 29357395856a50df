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

# The system site packages are visible only where they hold a torch to reuse: otherwise a system
# pytest without this plugin could shadow the environment's own. Where they are visible, pip finds
# the system pytest and installs no `pytest` script into $(VENV)/bin, so the last step installs
# one: after `. $(VENV)/bin/activate`, `pytest` is this environment's. The pytest plugins of the
# extras go in with it: that pytest is the newest release, and a system plugin older than it may
# not load under it (pytest-benchmark 5.2 under pytest 9.2: "'Function' object has no attribute
# '_nodeid'").
$(STAMP): pyproject.toml Makefile
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "set-up: $(VENV) reuses the system torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		echo "set-up: $(VENV) (no system torch to reuse)"; \
		$(PYTHON) -m venv $(VENV); \
	fi
	@$(PY) -c "import torch" 2>/dev/null || { \
		echo "set-up: installing $(TORCH_PIN), the CPU wheel (about 200 MB: a minute or two, silent)"; \
		$(PY) -m pip install -q $(TORCH_PIN); }
	@echo "set-up: installing this package (editable) with its extras $(EXTRAS)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@[ -x $(VENV)/bin/pytest ] || $(PY) -m pip install -q --ignore-installed "pytest>=8" \
		"pytest-benchmark>=4" "pytest-xdist>=3"
	@touch $(STAMP)
	@echo "set-up: done; '. $(VENV)/bin/activate' puts its python and pytest first on PATH"

setup: $(STAMP)

# The built-in suite only (this repository's own tests are `make test`), at the CI budget.
fuzz: $(STAMP)
	$(PY) -m pytest --graphmode-fuzz-only --graphmode-backend=auto --graphmode-profile=ci \
		--pyargs pytest_graphmode._builtin.suite $(ARGS)

# On a GPU the tests marked graphmode_gpu_alone (stream delays and copies in flight whose outcome
# a delay decides, a runner that profiles the GPU's free memory) skip beside other workers: they
# run again afterwards in one process, among the tests ARGS selects (`-n 0` and `-m` come after
# ARGS so that they win; exit status 5 is pytest's "none selected").
test: $(STAMP)
	$(PY) -m pytest -n auto $(ARGS)
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) -m pytest $(ARGS) -n 0 -m graphmode_gpu_alone || [ $$? -eq 5 ]; fi

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
