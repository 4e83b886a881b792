# Two commands on a fresh machine: `make train` and `make test`. Extra args: ARGS="...".
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: train test bench setup clean

setup: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.[dev]'
	@# the bytecode pip would compile file by file, compiled on every core (-j 0): 20 s of a
	@# 2-minute set-up; and parallab's own (the editable install's src/, which pip leaves),
	@# so that no process compiles it at its start where Python writes no bytecode itself
	@# (PYTHONDONTWRITEBYTECODE); -qq: some packages ship templates that are not Python 3.11
	$(PY) -m compileall -qq -j 0 $(VENV)/lib src || true
	touch $@

train: $(INSTALLED)
	$(PY) train.py $(ARGS)

test: $(INSTALLED)
	$(PY) -m pytest -n auto --dist loadgroup $(ARGS)

bench: $(INSTALLED)
	$(PY) bench/bench_loop.py $(ARGS)

clean:
	rm -rf $(VENV) outputs/2* multirun
