#!/usr/bin/env bash
# The process tests of the files whose scenarios run on the tests' shared cluster, timed side by side: a commit
# before the cluster (a worker a run; default d0f5d32) in a worktree of its own, against this checkout, rounds
# rotated (odd rounds the old first). Run from the repository root on an idle machine, with .venv installed:
#   bash benchmarks/shared_cluster.sh [ROUNDS=2] [OLD=d0f5d32]
# Each round prints both sides' seconds and pytest's last line; tests/README.md has the figures.
set -euo pipefail
rounds=${1:-2}
old=${2:-d0f5d32}
files="tests/test_nnx.py tests/checkpoint/test_weight_map.py tests/test_global_batches.py
tests/training/test_multihost.py tests/training/test_loop_processes.py tests/training/test_accumulation.py
tests/checkpoint/test_devices.py tests/checkpoint/test_resume.py tests/checkpoint/test_safetensors.py
tests/test_sharding.py tests/checkpoint/test_writers.py"
here=$(pwd)
worktree=$(mktemp -d)
git worktree add -q --detach "$worktree" "$old"
trap 'git worktree remove --force "$worktree"' EXIT
for round in $(seq 1 "$rounds"); do
    sides="old new"
    [ $((round % 2)) -eq 0 ] && sides="new old"
    for side in $sides; do
        directory=$here
        [ "$side" = old ] && directory=$worktree
        log=$(mktemp)
        start=$(date +%s.%N)
        # shellcheck disable=SC2086
        (cd "$directory" && "$here/.venv/bin/python" -m pytest -q -p no:cacheprovider -m processes $files >"$log" 2>&1) || true
        end=$(date +%s.%N)
        echo "round $round $side: $(echo "$end - $start" | bc) s: $(tail -1 "$log")"
        rm -f "$log"
    done
done
