#!/bin/bash
# Every CUDA figure of docs/benchmarks.md "On a GPU" that one short lease can take, in one
# command: the GPU's facts, the levers (batch, CUDA graphs, transformers' GPT-2, each
# profiled), float8 by width, the batch-64 runs, then the GPU test set. Each part runs
# until a fixed point in time (seconds from the start: L1..L4), so that a slow part leaves
# the later ones their share; every result lands in OUT_DIR as it comes.
#
#   bash bench/run_gpu.sh [OUT_DIR]        (WHEELS=DIR: pip-install the wheels there first,
#                                          for a machine without Hydra or a network)
set -u
RESULTS=${1:-gpu-results}
T0=$(date +%s)
left() { echo $(( T0 + $1 - $(date +%s) )); }
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/parallab-site "$WHEELS"/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/parallab-site:$PWD/src
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$RESULTS/keep/logs"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  nproc; } > "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"
B="python3 bench/bench_cuda.py --keep $RESULTS/keep/logs"
$B --parts levers --batches ${BATCH:-32} --steps 60 --json "$RESULTS/keep/levers.json" \
  --deadline "$(left ${L1:-235})" 2>&1 | tee "$RESULTS/levers.txt" | grep -v "^  "
$B --parts wide --steps 60 --wide-layers ${WIDE_LAYERS:-8} --json "$RESULTS/keep/wide.json" \
  --deadline "$(left ${L2:-405})" 2>&1 | tee "$RESULTS/wide.txt"
$B --parts gpt --batch 64 --configs bf16:compile:60 fp8:compile:60 --json "$RESULTS/keep/b64.json" \
  --deadline "$(left ${L3:-500})" 2>&1 | tee "$RESULTS/b64.txt"
timeout "$(left ${L4:-585})" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  > "$RESULTS/pytest.txt" 2>&1
tail -5 "$RESULTS/pytest.txt"
tar czf "$RESULTS/keep.tgz" -C "$RESULTS" keep && rm -rf "$RESULTS/keep"
echo "done in $(( $(date +%s) - T0 )) s"
