#!/usr/bin/env bash
# The process tests of the files whose scenarios run on the tests' shared cluster, timed side by side: a commit
# before the cluster (a worker a run; default d0f5d32) in a worktree of its own, against this checkout, rounds
# rotated (odd rounds the old first). Run from the repository root on an idle machine, with .venv installed:
#   bash benchmarks/shared_cluster.sh [ROUNDS=2] [OLD=d0f5d32]
# Each round prints both sides' seconds and pytest's last line; tests/README.md has the figures.
set -euo pipefail
rounds=${1:-2}
old=${2:-d0f5d32}
# The files by subject, in each tree as it names them: one file a subject before the tiers were declared by name,
# test_S.py, test_S_joined.py and test_S_processes.py after (the loop over processes: test_loop_processes.py
# before, test_loop_joined.py after).
subjects="test_nnx checkpoint/test_weight_map test_global_batches training/test_multihost training/test_accumulation
checkpoint/test_devices checkpoint/test_resume checkpoint/test_safetensors test_sharding checkpoint/test_writers"
files_in() {
    local subject each
    for subject in $subjects; do
        for each in "$1/tests/$subject.py" "$1/tests/${subject}_joined.py" "$1/tests/${subject}_processes.py"; do
            [ -f "$each" ] && echo "${each#"$1"/}"
        done
    done
    if [ -f "$1/tests/training/test_loop_joined.py" ]; then
        echo tests/training/test_loop_joined.py
    else
        echo tests/training/test_loop_processes.py
    fi
}
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
        # shellcheck disable=SC2046
        (cd "$directory" && "$here/.venv/bin/python" -m pytest -q -p no:cacheprovider -m processes $(files_in "$directory") >"$log" 2>&1) || true
        end=$(date +%s.%N)
        echo "round $round $side: $(echo "$end - $start" | bc) s: $(tail -1 "$log")"
        rm -f "$log"
    done
done
