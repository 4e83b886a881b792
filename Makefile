# Two commands on a fresh machine: `make train` and `make test`. Extra args: ARGS="...".
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: train test bench setup clean

setup: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# uv installs what pip would, from pip's own indexes and constraints (which
	@# tools/pip_to_uv.py hands over), unpacking in parallel and compiling the bytecode on
	@# every core: the whole set-up took 41 s against pip's 99 s here (a CUDA build of torch
	@# is 5 GB unpacked). Where uv cannot be had or fails, pip installs, then compileall.
	($(PY) -m pip install --quiet --disable-pip-version-check uv && \
	  $(PY) tools/pip_to_uv.py $(VENV)/bin/uv --python $(PY) --quiet --compile-bytecode \
	    -e '.[dev]') || \
	($(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.[dev]' && \
	  { $(PY) -m compileall -qq -j 0 $(VENV)/lib || true; })
	@# parallab's own (the editable install's src/), so that no process compiles it at its
	@# start where Python writes no bytecode itself (PYTHONDONTWRITEBYTECODE); -qq: quiet
	$(PY) -m compileall -qq -j 0 src
	touch $@

train: $(INSTALLED)
	$(PY) train.py $(ARGS)

test: $(INSTALLED)
	$(PY) -m pytest -n auto --dist loadgroup $(ARGS)

bench: $(INSTALLED)
	$(PY) bench/bench_loop.py $(ARGS)

clean:
	rm -rf $(VENV) outputs/2* outputs/multirun outputs/eval outputs/slurm multirun mlruns
