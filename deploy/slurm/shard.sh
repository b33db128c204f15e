#!/usr/bin/env bash
# One shard of a pdkv exploration or sweep: one task of a Slurm job array.
#
#   sbatch --array=0-7 deploy/slurm/shard.sh explore notify-drift-fixed --seeds 80000 --faults swarm
#   sbatch --array=0-3 deploy/slurm/shard.sh sweep 2P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 32,128,512
#
# Task i of an array of N runs `pdkv <explore|sweep> ARGS... --shard i/N` and writes its shard
# into $OUT (default out/): out/shard-i.json for an exploration, out/shard-i/ for a sweep. The
# array must be 0-(N-1) without gaps or steps: SLURM_ARRAY_TASK_COUNT is N and every index from
# 0 to N-1 must run, or the merge says which shard is missing. deploy/slurm/submit.sh submits
# the array and the merge that depends on it; docs/cluster-campaigns.md explains both.
#SBATCH --job-name=pdkv-shard
#SBATCH --cpus-per-task=2
set -euo pipefail

: "${PDKV:=pdkv}"
: "${OUT:=out}"
kind="${1:?usage: shard.sh explore|sweep ARGS...}"
shift
i="${SLURM_ARRAY_TASK_ID:?not a task of a Slurm job array}"
# SHARDS overrides the count, to rerun one shard on its own: SHARDS=16 sbatch --array=5 ...
n="${SHARDS:-${SLURM_ARRAY_TASK_COUNT:?not a task of a Slurm job array}}"
# The shard's seeds or points on the cores Slurm gave the task.
jobs="${SLURM_CPUS_PER_TASK:-1}"
mkdir -p "$OUT"

case "$kind" in
explore)
    # The shrunk scenario of a failure goes to a folder of the shard's own, so shards on a
    # shared file system do not write one file at once.
    args=(explore "$@" --jobs "$jobs" --shard "$i/$n" --result "$OUT/shard-$i.json" --out "$OUT/shrunk-$i")
    ;;
sweep)
    args=(sweep "$@" --jobs "$jobs" --shard "$i/$n" --out "$OUT/shard-$i")
    ;;
*)
    echo "shard.sh: the first argument is explore or sweep, not \`$kind\`" >&2
    exit 2
    ;;
esac

# pdkv exits 1 when the shard found what it looks for (a failing seed, a point with an
# unexpected outcome): that is a result, written to the shard file, and the merge reports it.
# Only bad input (2) or a crash fails the task, so the merge job's afterok dependency holds
# exactly when every shard file was written.
code=0
"$PDKV" "${args[@]}" || code=$?
if [ "$code" -eq 1 ]; then
    exit 0
fi
exit "$code"
