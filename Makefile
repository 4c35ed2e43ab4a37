# fedctl — set-up, the default run and the tests.
# torch is installed first and pinned, so nothing later replaces the CPU build with a CUDA one.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: setup demo test lint clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,bench,tracking]' "$(TORCH)"
	touch $@

setup: $(VENV)/.installed

demo: setup               ## set up, then run the default cluster (cluster.yaml) on this machine
	$(VENV)/bin/fedctl run --config cluster.yaml

# Two tests at a time (pytest-xdist): a cluster test spends much of its time waiting on its
# processes' start and its rounds' timers, so two share two cores well (the whole suite on this
# 2-core machine: 641 s two at a time, its fedctl processes forked by a fork server that has
# imported torch once: 839 s when each started a fresh interpreter). Each test module stays in one
# process, in order, so that its fixtures (the Ansible deployment, a reference run) are made
# once. `pytest` alone runs everything in turn; so does TEST_PROCESSES=0.
TEST_PROCESSES ?= 2

test: setup               ## set up, then lint and run the whole test suite
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadscope

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
