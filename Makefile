# Two commands on a fresh machine: `make train` and `make test`. Extra args: ARGS="...".
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: train test bench setup clean

setup: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

train: $(INSTALLED)
	$(PY) train.py $(ARGS)

test: $(INSTALLED)
	$(PY) -m pytest -n auto --dist loadgroup $(ARGS)

bench: $(INSTALLED)
	$(PY) bench/bench_loop.py $(ARGS)

clean:
	rm -rf $(VENV) outputs/2* multirun
