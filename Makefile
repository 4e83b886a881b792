# Two commands on a fresh machine: `make train` and `make test`. Extra args: ARGS="...".
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
WARM := $(VENV)/.warm

.PHONY: train test bench setup clean

# Python writes the bytecode of each module it imports, once, as it does by default: where
# the environment turns that off, every process of the suite would compile again what it
# imports (torch alone: seconds)
unexport PYTHONDONTWRITEBYTECODE

setup: $(WARM)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# uv installs what pip would, from pip's own indexes and constraints (which
	@# tools/pip_to_uv.py hands over), unpacking in parallel (a CUDA build of torch is 5 GB
	@# unpacked), in seconds from its cache. Where uv cannot be had or fails, pip.
	($(PY) -m pip install --quiet --disable-pip-version-check uv && \
	  $(PY) tools/pip_to_uv.py $(VENV)/bin/uv --python $(PY) --quiet -e '.[dev]') || \
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.[dev]'
	touch $@

# the bytecode of what a run imports, written by importing it (a third of the time that
# compiling all 21,000 installed modules takes: docs/benchmarks.md); the rest is written as it is
# first imported (above), and a process where Python writes none (PYTHONDONTWRITEBYTECODE
# set by the caller) still finds the run's own. Not for the suite, whose first imports
# write the same while its other worker runs
$(WARM): $(INSTALLED)
	$(PY) -c "import parallab.cli, parallab.training.run, torch._dynamo, \
	  torch.distributed.fsdp, torch.distributed.tensor.parallel, \
	  torch.distributed.checkpoint, torch.utils.tensorboard"
	touch $@

train: $(WARM)
	$(PY) train.py $(ARGS)

test: $(INSTALLED)
	$(PY) -m pytest -n auto --dist loadgroup $(ARGS)

bench: $(INSTALLED)
	$(PY) bench/bench_loop.py $(ARGS)

clean:
	rm -rf $(VENV) outputs/2* outputs/multirun outputs/eval outputs/slurm multirun mlruns
