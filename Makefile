# `make book` and `make test` each create the environment first; nothing else is needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The book build executes every notebook; fail on warnings, on a broken reference or a cell error.
JB_FLAGS ?= -W -n --keep-going

.PHONY: env book test lint bench notebooks clean

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . $(JB_FLAGS)

# The browser check reads _build/html, so the book is built (from its cache) first.
test: book
	$(BIN)/python -m pytest tests -q
	$(BIN)/python -m pytest --nbval-lax -p no:cacheprovider notebooks -q

# Re-execute the notebooks in place: their committed outputs are what nbval compares against.
notebooks: $(STAMP)
	for script in tools/make_ch*.py; do $(BIN)/python $$script || exit 1; done
	$(BIN)/jupyter execute --inplace --timeout=600 notebooks/*.ipynb

lint: $(STAMP)
	$(BIN)/ruff check labs tests

bench: $(STAMP)
	$(BIN)/python -m labs.bench launch
	$(BIN)/python -m labs.bench collectives

clean:
	rm -rf _build
