# Every target sets up .venv itself from the pinned requirements.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 2
export PYTHONHASHSEED := 0
export MPLBACKEND := Agg

.PHONY: help venv book test test-lib test-notebooks lab bench exercises clean

help:
	@echo "make book       build the HTML book into _build/html"
	@echo "make test       every test: library, kernels (Triton interpreter), notebooks, grader, book build"
	@echo "make lab        JupyterLab on the chapters with the project's environment"
	@echo "make bench      timing and peak-memory tables (python -m atlaslib.bench)"
	@echo "make exercises  regenerate the student notebooks from exercises/solutions"

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

book: $(STAMP)
	$(VENV)/bin/jupyter-book build -W -n --keep-going . 
	@echo "The book is at file://$(CURDIR)/_build/html/index.html"

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests
	$(PY) -m pytest -q -p no:cacheprovider --nbval --nbval-current-env \
	    --sanitize-with tests/nbval_sanitize.cfg book exercises/solutions

lab: $(STAMP)
	$(VENV)/bin/jupyter lab book

bench: $(STAMP)
	$(PY) -m atlaslib.bench

exercises: $(STAMP)
	$(PY) -m atlaslib.exercises.generate

clean:
	rm -rf _build
