# Two entry points: `make demo` (the main job) and `make test`. Each creates .venv/ first.
# The stack users run: Python 3.12, torch 2.13.0, megatron-core 0.19.2, deepspeed 0.19.8.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Python 3.12: $(PYTHON312) if given, else the first of pyenv's 3.12.x and python3.12 on PATH that runs.
PYTHON312 ?= $(shell for c in $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null) \
	$$(command -v python3.12 2>/dev/null); do "$$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
	2>/dev/null && echo "$$c" && break; done)

.PHONY: demo test test-unit test-slow venv simulate
venv: $(VENV)/.installed

$(VENV)/.installed: setup.py
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found. Install it (e.g. 'pyenv install 3.12') or run 'make PYTHON312=/path/to/python3.12 ...'"; exit 2; }
	$(PYTHON312) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned (for Python 3.12 the registry's build is the CUDA one; it runs on CPU).
	$(PIP) install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install -q -e '.[megatron,deepspeed,test]'
	touch $@

demo: venv
	$(PY) tools/demo.py

# Two pytest workers (pytest-xdist), each test file whole on one worker (its module-scoped launches are shared by its
# tests): launches wait on timeouts and rendezvous and most unit tests use one core, so the other worker fills the
# gaps (docs/benchmarks.md, "The test suite"). PYTEST_WORKERS=0 runs everything in this one process.
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test: venv
	$(PYTEST) -m "not slow" tests

# The one-process tests alone (tests/unit/, ~30 s): the loop while editing; `make test` runs them too.
test-unit: venv
	$(PYTEST) -m "not slow" tests/unit

# CI runs it after `make test`: the planner properties at 3,000 hypothesis examples (DCP_SLOW_EXAMPLES for more) and the 4-8 rank launches.
test-slow: venv
	$(PYTEST) -m slow tests

simulate: venv
	$(PY) tools/simulate.py --lengths builtin:wikipedia --model llama3-8b --cluster h200 --gpus 32 --tokens-per-step 4194304 --steps 10
