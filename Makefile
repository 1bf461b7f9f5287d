# `make book` and `make test` each create the environment first; nothing else is needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The book build executes every notebook; fail on warnings, on a broken reference or a cell error.
JB_FLAGS ?= -W -n --keep-going

.PHONY: env book test test-slow lint bench notebooks clean

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . $(JB_FLAGS)

# `make test` renders the book from the outputs stored in the notebooks, without executing
# them: nbval below executes every notebook and compares its outputs with the stored ones, so
# executing them for the book too would run every notebook twice. The browser check reads
# that _build/html. Tests run on $(WORKERS) pytest-xdist workers: most of their time is spent
# starting ranks and kernels, so two workers overlap that on two cores.
WORKERS ?= 2
STORED_CONFIG := _build/_config_stored.yml

test: $(STAMP)
	mkdir -p _build
	sed 's/^  execute_notebooks: cache$$/  execute_notebooks: "off"/' _config.yml > $(STORED_CONFIG)
	@grep -q 'execute_notebooks: "off"' $(STORED_CONFIG) || \
	  { echo "Makefile: _config.yml no longer says 'execute_notebooks: cache'; update the test target"; exit 1; }
	$(BIN)/jupyter-book build . --config $(STORED_CONFIG) $(JB_FLAGS)
	$(BIN)/python -m pytest tests -q -n $(WORKERS) --dist worksteal -m "not slow"
	$(BIN)/python -m pytest --nbval-lax -p no:cacheprovider notebooks -q -n $(WORKERS) --dist loadscope

# The tests marked slow: more cases of kinds `make test` already runs (every chapter's
# grading, collectives on 5-8 ranks). CI runs them after `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest tests -q -n $(WORKERS) --dist worksteal -m slow

# Re-execute the notebooks in place: their committed outputs are what nbval compares against.
notebooks: $(STAMP)
	for script in tools/make_*.py; do $(BIN)/python $$script || exit 1; done
	$(BIN)/python tools/execute_notebooks.py notebooks/*.ipynb

lint: $(STAMP)
	$(BIN)/ruff check labs tests tools

bench: $(STAMP)
	$(BIN)/python -m labs.bench launch
	$(BIN)/python -m labs.bench collectives
	$(BIN)/python -m labs.bench ddp --launches 3
	$(BIN)/python -m labs.bench fsdp

clean:
	rm -rf _build
