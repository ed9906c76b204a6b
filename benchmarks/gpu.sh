#!/usr/bin/env bash
# The figures on one GPU, in one short lease: each benchmark as it prints, in order of need, each under a
# hard timeout, everything logged to $OUT/gpu.log.
#
#     bash benchmarks/gpu.sh            # on a machine with JAX for CUDA and flaxstate's dependencies
#
# Where the machine lacks a dependency (or has an older one), wheels in .whl/ are installed to /tmp/site
# first: only those whose package is missing or older than the wheel.
set -u
OUT=${OUT:-/tmp/flaxstate-gpu}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
PY=${PYTHON:-python3}

if [ -d .whl ]; then
    wheels=$($PY - <<'EOF'
import glob, importlib.metadata as md, re
from packaging.version import Version
for wheel in sorted(glob.glob(".whl/*.whl")):
    name, version = re.match(r"\.whl/([^-]+)-([^-]+)-", wheel).groups()
    try:
        have = md.version(name.replace("_", "-"))
    except md.PackageNotFoundError:
        have = None
    if have is None or Version(have) < Version(version):
        print(wheel)
EOF
)
    echo "installing: ${wheels:-nothing}" | tee -a "$LOG"
    if [ -n "$wheels" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels 2>&1 | tail -3
        export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

step() {  # step SECONDS TITLE COMMAND...
    local limit=$1 title=$2
    shift 2
    echo -e "\n## $title\n\$ $*  (limit ${limit}s)" | tee -a "$LOG"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" 2>&1 | grep -v -e "^WARNING: All log messages" -e "^I0000" | tee -a "$LOG"
    echo "(exit ${PIPESTATUS[0]}, $((SECONDS - start)) s)" | tee -a "$LOG"
}

step 30 "device" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv; \
    $PY -c 'import jax, flax, optax, orbax.checkpoint as o, flaxstate; print(jax.__version__, jax.devices(), flax.__version__, optax.__version__, o.__version__)'"
GPT125="--embed 768 --heads 12 --head-dim 64 --mlp 3072 --layers 12 --seq-len 1024"
GPT350="--embed 1024 --heads 16 --head-dim 64 --mlp 4096 --layers 24 --seq-len 1024"
step 150 "LM, GPT-2 small's shape, bfloat16" $PY benchmarks/sharded.py $GPT125 --batch-size 32 --dtype bfloat16 \
    --rounds 6 --steps 20 --per-dispatch 1
step 100 "loop overhead" $PY benchmarks/loop_overhead.py --rounds 5
step 60 "checkpoint" $PY benchmarks/checkpoint.py --rounds 3
step 90 "tiers" $PY benchmarks/tiers.py --rounds 3
step 50 "memory" $PY benchmarks/memory.py --rounds 3
step 120 "LM, GPT-2 medium's shape, bfloat16" $PY benchmarks/sharded.py $GPT350 --batch-size 16 --dtype bfloat16 \
    --rounds 5 --steps 10 --per-dispatch 1 --no-plan
echo "total $SECONDS s" | tee -a "$LOG"
