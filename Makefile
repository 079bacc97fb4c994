# Two entry points: `make demo` (the main job) and `make test`. Each creates .venv/ first.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test venv simulate
venv: $(VENV)/.installed

$(VENV)/.installed: setup.py
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the CPU build on local disk; unpinned would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install -q -e '.[megatron,deepspeed,test]'
	touch $@

demo: venv
	$(PY) tools/demo.py

test: venv
	$(PY) -m pytest -q tests

simulate: venv
	$(PY) tools/simulate.py --lengths builtin:wikipedia --model llama3-8b --cluster h200 --gpus 32 --tokens-per-step 4194304 --steps 10
