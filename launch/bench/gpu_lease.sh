#!/bin/bash
# One GPU lease (the device tool, 15 minutes in all): install without network from .whl/ (WORKSPACE.md), then
# the GPU check's parts, each under its own limit so one slow compile cannot eat the others. Run from the
# checkout: `bash launch/bench/gpu_lease.sh 2>&1 | tee $OUT/log.txt`; TESTS_S, TRAIN_S, ATTN_S override the limits
# (seconds; their sum plus ~20 s of install must stay under the call's timeout_s) and PARTS picks the parts
# (default "tests train attention"; e.g. PARTS="train attention" TRAIN_S=420 once tests/gpu has passed).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_lease}; mkdir -p $OUT    # the device tool sets OUT; its files come back
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megajax/*.whl
python3 -c "import megajax, megajax.parallel, megajax.launch.bench.gpu, jax; print('jax', jax.__version__, jax.devices())" || exit 4
log installed
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
PARTS=${PARTS:-tests train attention}
wanted() { [[ " $PARTS " == *" $1 "* ]]; }
# Eight pytest workers share the GPU (no preallocation): the kernel tests are compile-bound.
wanted tests && MEGAJAX_TESTS_ON=gpu XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 ${TESTS_S:-220} python3 -m pytest -n 8 -v \
  -p no:cacheprovider -rfEs --tb=short --timeout=150 --durations=15 tests/gpu 2>&1 | grep -v Benchmark > $OUT/tests.txt
wanted tests && tail -40 $OUT/tests.txt && log tests done
wanted train && timeout -k 5 ${TRAIN_S:-200} python3 -m megajax.launch.bench gpu --out=/tmp/gc_train --parts=train --train_sizes=1.3b:2048 --repeats=5
cp /tmp/gc_train/gpu_check.json $OUT/train.json 2>/dev/null
wanted train && log train done
wanted attention && timeout -k 5 ${ATTN_S:-120} python3 -m megajax.launch.bench gpu --out=/tmp/gc_attn --parts=attention --repeats=10
cp /tmp/gc_attn/gpu_check.json $OUT/attention.json 2>/dev/null
wanted attention && log attention done
