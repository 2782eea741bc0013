#!/bin/bash
# One GPU lease (the device tool: 15 minutes of device time in all, one command at most 10): install
# without network from .whl/ (WORKSPACE.md), then `bench gpu`, whose parts keep to its budget (each in its
# own process under its planned seconds, gpu.PLAN_S: 470 s in all). Run from the checkout:
#   bash launch/bench/gpu_lease.sh 2>&1 | tail -c 11000        (timeout_s=560)
# PARTS picks the parts (default: tests,train,attention,run,checkpoint), BUDGET_S the seconds; the install
# takes ~20 s of the call. The report lands in $OUT/gpu_check/ (gpu_check.json, gpu_check.md, a log per part).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_lease}; mkdir -p $OUT    # the device tool sets OUT; its files come back
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megajax/*.whl
python3 -c "import megajax, megajax.parallel, megajax.launch.bench.gpu, jax; print('jax', jax.__version__, jax.devices())" || exit 4
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92    # the MFU suite's rows need more than XLA's default 75%
python3 -m megajax.launch.bench gpu --out=$OUT/gpu_check --parts=${PARTS:-tests,train,attention,run,checkpoint} \
  --budget_s=${BUDGET_S:-470} --repeats=5 --train_sizes=1.3b:2048
