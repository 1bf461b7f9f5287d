# `make book` and `make test` each create the environment first; nothing else is needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The book build executes every notebook; fail on warnings, on a broken reference or a cell error.
JB_FLAGS ?= -W -n --keep-going

.PHONY: env learner book test test-slow test-latest test-gpu gpu-wheelhouse lock lint bench notebooks chapter clean

env: $(STAMP)

# The environment installs requirements.lock: the exact version of every package, the
# transitive ones included, that the whole suite passed with. requirements.txt keeps the
# direct dependencies with ranges (for a GPU box that keeps its own torch); `make lock`
# compiles the lock from it. pip comes from the venv as Python made it, not the newest release.
$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Refresh the lock on purpose: the newest releases requirements.txt admits, resolved by
# pip-tools (itself pinned) in a throwaway environment. Then run `make test test-slow` and
# commit the lock with the numbers. pip-compile writes the CPU wheel's local version
# (torch==2.13.0+cpu); the lock says torch==2.13.0, which pip finds here (the wheel on disk)
# and on PyPI alike.
PIP_TOOLS := pip-tools==7.6.2
LOCK_VENV := _build/venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet "$(PIP_TOOLS)"
	$(LOCK_VENV)/bin/pip-compile --quiet --upgrade --allow-unsafe --strip-extras \
	  --no-emit-index-url --no-emit-find-links --output-file requirements.lock requirements.txt
	sed -i -E 's/^(torch==[0-9.]+)\+cpu$$/\1/' requirements.lock
	rm -rf $(LOCK_VENV)

# A learner's own copy of the chapters to run in JupyterLab: one .ipynb per chapter, outputs
# kept, in $(LEARNER_DIR) (git-ignored), never overwriting a notebook the learner changed.
# notebooks/ holds the references nbval compares; a learner's saves would rewrite them.
LEARNER_DIR ?= my-notebooks
learner: $(STAMP)
	$(BIN)/python tools/learner_copy.py $(LEARNER_DIR)

book: $(STAMP)
	$(BIN)/jupyter-book build . $(JB_FLAGS)

# `make test` renders the book from the outputs stored in the notebooks, without executing
# them: nbval below executes every notebook and compares its outputs with the stored ones, so
# executing them for the book too would run every notebook twice. The browser check reads
# that _build/html. Tests run on $(WORKERS) pytest-xdist workers: most of their time is spent
# starting ranks and kernels, so two workers overlap that on two cores.
WORKERS ?= 2
STORED_CONFIG := _build/_config_stored.yml

# The suite, run by the Python environment in $(1): `make test` gives it .venv, `make
# test-latest` a throwaway one. Jupyter Book reads a local extension's folder relative to the
# config file, so the stored config, one folder down, names book/ext as ../book/ext.
define run_suite
	mkdir -p _build
	sed -e 's/^  execute_notebooks: cache$$/  execute_notebooks: "off"/' \
	  -e 's|^\(    [a-z_]*\): book/ext$$|\1: ../book/ext|' _config.yml > $(STORED_CONFIG)
	@grep -q 'execute_notebooks: "off"' $(STORED_CONFIG) || \
	  { echo "Makefile: _config.yml no longer says 'execute_notebooks: cache'; update the test target"; exit 1; }
	@grep -q ': \.\./book/ext$$' $(STORED_CONFIG) || \
	  { echo "Makefile: _config.yml's local_extensions no longer name book/ext; update the test target"; exit 1; }
	$(1)/jupyter-book build . --config $(STORED_CONFIG) $(JB_FLAGS)
	$(1)/python -m pytest tests -q -n $(WORKERS) --dist worksteal -m "not slow" --durations=25
	$(1)/python -m pytest --nbval-lax --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider \
	  notebooks -q -n $(WORKERS) --dist loadscope --durations=10
endef

test: $(STAMP)
	$(call run_suite,$(BIN))

# The suite (and the slow tests) against the newest releases that requirements.txt admits,
# in a throwaway environment, so that a release which breaks the course is found here before
# a learner finds it. It first lists what differs from requirements.lock.
LATEST_VENV := _build/venv-latest
test-latest: export LABS_UNLOCKED := 1
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade -r requirements.txt
	$(LATEST_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(LATEST_VENV)/bin/python tools/lock_diff.py requirements.lock
	$(call run_suite,$(LATEST_VENV)/bin)
	$(LATEST_VENV)/bin/python -m pytest tests -q -n $(WORKERS) --dist worksteal -m slow

# The tests marked slow: more cases of kinds `make test` already runs (every chapter's
# grading, collectives on 5-8 ranks). CI runs them after `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest tests -q -n $(WORKERS) --dist worksteal -m slow

# Re-execute the chapters in place: their committed outputs are what nbval compares against.
# Each chapter's source is notebooks/NN_name.md, paired with the executed .ipynb (jupytext).
notebooks: $(STAMP)
	$(BIN)/python tools/execute_notebooks.py notebooks/*.md

# One chapter after an edit of its .md (or of its .ipynb in Jupyter): `make chapter NB=02`.
chapter: $(STAMP)
	@test -n "$(NB)" || { echo "usage: make chapter NB=02 (a chapter's number, or A1)"; exit 2; }
	$(BIN)/python tools/execute_notebooks.py notebooks/$(NB)_*.md

# On a GPU box that keeps its own CUDA torch (README, "On a GPU box"): tests/test_gpu.py, the
# library's tests and nbval of every chapter with the GPU visible, by the box's python3, with
# the logs and JUnit files in _build/gpu (reports/gpu/ holds the reports made from them). A box
# without network takes the Jupyter packages from _build/wheelhouse, made here by
# `make gpu-wheelhouse` (GPU_PY=3.12 by default) and copied there.
test-gpu:
	bash tools/gpu_check.sh _build/gpu

gpu-wheelhouse:
	bash tools/gpu_wheelhouse.sh _build/wheelhouse

lint: $(STAMP)
	$(BIN)/ruff check labs tests tools notebooks

bench: $(STAMP)
	$(BIN)/python -m labs.bench launch
	$(BIN)/python -m labs.bench collectives
	$(BIN)/python -m labs.bench ddp --launches 3
	$(BIN)/python -m labs.bench fsdp

clean:
	rm -rf _build
