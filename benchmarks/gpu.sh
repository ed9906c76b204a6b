#!/usr/bin/env bash
# The figures on one GPU, in one short lease: each benchmark as it prints, in order of need, each under a
# hard timeout, everything logged to $OUT/gpu.log.
#
#     bash benchmarks/gpu.sh                 # every step, on a machine with JAX for CUDA and flaxstate's dependencies
#     bash benchmarks/gpu.sh overhead restore # only the steps named (their keys: the first word after `step`)
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

ONLY=" $* "
step() {  # step KEY SECONDS TITLE COMMAND...: runs unless steps were named and KEY is not one of them
    local key=$1 limit=$2 title=$3
    shift 3
    if [ "$ONLY" != "  " ] && [[ "$ONLY" != *" $key "* ]]; then
        return 0
    fi
    echo -e "\n## $title\n\$ $*  (limit ${limit}s)" | tee -a "$LOG"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" 2>&1 | grep -v -e "^WARNING: All log messages" -e "^I0000" | tee -a "$LOG"
    echo "(exit ${PIPESTATUS[0]}, $((SECONDS - start)) s)" | tee -a "$LOG"
}

step device 20 "device" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv; \
    $PY -c 'import jax, flax, optax, orbax.checkpoint as o, flaxstate; print(jax.__version__, jax.devices(), flax.__version__, optax.__version__, o.__version__)'"
GPT125="--embed 768 --heads 12 --head-dim 64 --mlp 3072 --layers 12 --seq-len 1024 --dtype bfloat16"
GPT350="--embed 1024 --heads 16 --head-dim 64 --mlp 4096 --layers 24 --seq-len 1024 --dtype bfloat16"
FAST="--attention cudnn --scan-layers"
step flops 80 "model FLOPs with cuDNN's attention, the host's time a step" $PY benchmarks/gpu_checks.py
step profile 150 "traces and host profiles: the loop's device gaps at K=1 and K=10, the restore" bash -c \
    "$PY benchmarks/gpu_profile.py --out /tmp/flaxstate-profile && mkdir -p $OUT/traces && \
    for d in /tmp/flaxstate-profile/python_*; do cp \$(find \$d -name perfetto_trace.json.gz) $OUT/traces/\$(basename \$d).json.gz; done"
step few 120 "loop overhead, the small MLP, fewer loops in the process (order rotated, 3 runs)" $PY benchmarks/loop_overhead.py \
    --rounds 5 --runs 3 --models small --contenders "flaxstate TrainLoop, K=1|flaxstate TrainLoop, K=10|a record"
step variants 120 "the K-step program built other ways: no fence on the gradients, the scan unrolled" \
    $PY benchmarks/gpu_variants.py --rounds 5 --runs 3
step guard 40 "no implicit device-to-host transfer between records" $PY benchmarks/guard_check.py
step overhead 100 "loop overhead (order rotated every round, 3 runs)" $PY benchmarks/loop_overhead.py --rounds 5 --runs 3 \
    --models tiny,small
step spaced 100 "loop overhead, records 5x further apart (2000 steps a round)" $PY benchmarks/loop_overhead.py \
    --rounds 3 --runs 2 --steps 2000 --models small
step restore 70 "checkpoint" $PY benchmarks/checkpoint.py --rounds 5
step lm 100 "LM, GPT-2 small's shape, batch 32, cuDNN attention, nn.scan: flaxstate alone in its process" \
    $PY benchmarks/sharded.py $GPT125 $FAST --batch-size 32 --rounds 6 --steps 20 --only flaxstate
step lmhw 70 "LM, the same: the hand-written loop alone in its process" \
    $PY benchmarks/sharded.py $GPT125 $FAST --batch-size 32 --rounds 6 --steps 20 --only hand-written --no-plan
step lm64 100 "LM, GPT-2 small's shape, batch 64, cuDNN attention, nn.scan: flaxstate alone" \
    $PY benchmarks/sharded.py $GPT125 $FAST --batch-size 64 --rounds 4 --steps 20 --only flaxstate --no-plan
step medium 80 "LM, GPT-2 medium's shape, batch 16, cuDNN attention, nn.scan: flaxstate alone" \
    $PY benchmarks/sharded.py $GPT350 $FAST --batch-size 16 --rounds 4 --steps 10 --only flaxstate --no-plan
# Issue 83: XLA's settings (benchmarks/with_preset.py), GPT-2 small's real shape, resume after kill -9, restore.
# The next lease: bash benchmarks/gpu.sh device k_none k_capture k_nocapture lm83 lm83hw lm83none resume83 resume83d
# The LM's flaxstate loop runs K=10 a dispatch: at K=1 a record's step runs a forward and backward pass of its own
# for the record's gradients (10% more compute at a record every 10 steps; the hand-written loop keeps none).
W=benchmarks/with_preset.py
K="--rounds 5 --runs 2 --models small --contenders 'flaxstate TrainLoop, K=1\$|flaxstate TrainLoop, K=10\$'"
step k_none 80 "the K-step loop, XLA's defaults (no XLA_FLAGS)" bash -c "$PY $W none benchmarks/loop_overhead.py $K"
step k_off 80 "the K-step loop, the Hopper preset with command buffers off (MaxText's H100 flags)" \
    bash -c "$PY $W hopper:off benchmarks/loop_overhead.py $K"
step k_capture 80 "the K-step loop, the Hopper preset: while loops captured in CUDA graphs" \
    bash -c "$PY $W hopper benchmarks/loop_overhead.py $K"
step k_nocapture 80 "the K-step loop, the Hopper preset with XLA's own command buffers (while loops not captured)" \
    bash -c "$PY $W hopper:no-capture benchmarks/loop_overhead.py $K"
GPT2="$GPT125 --vocab 50257"
step lm83 170 "LM, GPT-2 small's real shape (vocab 50257), the largest batch fs.plan says fits, Hopper preset: flaxstate" \
    $PY $W hopper benchmarks/sharded.py $GPT2 $FAST --batch-size 0 --batch-to /tmp/lm83-batch --rounds 4 --steps 20 \
    --only flaxstate --per-dispatch 10
step lm83hw 80 "LM, the same batch and preset: the hand-written loop alone in its process" bash -c \
    "$PY $W hopper benchmarks/sharded.py $GPT2 $FAST --batch-size \$(cat /tmp/lm83-batch) --rounds 4 --steps 20 \
    --only hand-written --no-plan"
step resume83 130 "resume after kill -9 under flaxstate launch: programs cached, autotune file, nothing kept" \
    $PY benchmarks/gpu_resume.py --steps 200 --kill-at 100 --every 20
step restore83 50 "restore against plain orbax" $PY benchmarks/checkpoint.py --rounds 7 --restore-only
step restoreprof 45 "restore profiles" $PY benchmarks/gpu_profile.py --only restore_profile
step lm83none 80 "LM, the same batch, XLA's defaults (no preset): flaxstate" bash -c \
    "$PY $W none benchmarks/sharded.py $GPT2 $FAST --batch-size \$(cat /tmp/lm83-batch) --rounds 4 --steps 20 \
    --only flaxstate --no-plan --per-dispatch 10"
step resume83d 130 "resume after kill -9, as resume83, with XLA's deterministic ops (the user's XLA_FLAGS)" \
    env XLA_FLAGS=--xla_gpu_deterministic_ops=true $PY benchmarks/gpu_resume.py --steps 200 --kill-at 100 --every 20
for who in "hopper flaxstate" "hopper hand-written" "none flaxstate"; do
    set -- $who
    step "lm88$1$2" 80 "LM, GPT-2 small's real shape, batch 88, XLA preset $1: $2 alone in its process" \
        $PY $W "$1" benchmarks/sharded.py $GPT2 $FAST --batch-size 88 --rounds 4 --steps 20 --only "$2" --no-plan \
        --per-dispatch 10
done
echo "total $SECONDS s" | tee -a "$LOG"
