#!/bin/bash
# Every CUDA figure of docs/benchmarks.md "On a GPU" that one short lease can take, in one
# command: the GPU's facts, how transformers' GPT-2 calls attention under compile, the
# levers (compile modes, transformers' GPT-2, each profiled), float8 at width 4096, the GPU
# test set, GPT-2's own 50,304-token head. Each part runs until a fixed point in time
# (seconds from the start: L1..L5), so that a slow part leaves the later ones their share;
# every result lands in OUT_DIR as it comes.
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
timeout 40 $B --parts hfsdpa > "$RESULTS/hfsdpa.txt" 2>&1
grep -v "^W\|Warn" "$RESULTS/hfsdpa.txt" | tail -6
$B --parts levers --batches ${BATCH:-64} --modes default --steps 40 \
  --json "$RESULTS/keep/levers.json" --deadline "$(left ${L1:-150})" 2>&1 \
  | tee "$RESULTS/levers.txt" | grep -v "^  "
$B --parts levers --no-hf --batches ${BATCH:-64} --modes max-autotune-no-cudagraphs --steps 40 \
  --json "$RESULTS/keep/autotune.json" --deadline "$(left ${L2:-300})" 2>&1 \
  | tee "$RESULTS/autotune.txt" | grep -v "^  "
$B --parts wide --steps 30 --wide-width 4096 --wide-layers 4 --wide-batch 8 \
  --wide-recipes tensorwise --json "$RESULTS/keep/wide.json" --deadline "$(left ${L3:-460})" \
  2>&1 | tee "$RESULTS/wide.txt" | grep -v "^  "
timeout "$(left ${L4:-540})" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  > "$RESULTS/pytest.txt" 2>&1
tail -4 "$RESULTS/pytest.txt"
$B --parts vocab --batches 32 --modes default --steps 40 --json "$RESULTS/keep/vocab.json" \
  --deadline "$(left ${L5:-600})" 2>&1 | tee "$RESULTS/vocab.txt" | grep -v "^  "
tar czf "$RESULTS/keep.tgz" -C "$RESULTS" keep && rm -rf "$RESULTS/keep"
echo "done in $(( $(date +%s) - T0 )) s"
