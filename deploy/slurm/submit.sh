#!/usr/bin/env bash
# Submits a sharded pdkv exploration or sweep to Slurm: an array of N shards, then the merge,
# which starts once every shard succeeded.
#
#   deploy/slurm/submit.sh explore 8 notify-drift-fixed --seeds 80000 --faults swarm
#   deploy/slurm/submit.sh sweep 4 2P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 32,128,512
#
# Environment: PDKV, the pdkv binary as the compute nodes see it (default: pdkv on their PATH);
# OUT, the results folder on a file system every node shares (default: out); WAIT=1 to wait for
# the merge and exit with its code (sbatch --wait). Prints the two job ids. Any other sbatch
# option (partition, account, time limit) goes in SBATCH_* environment variables, which sbatch
# reads itself, e.g. SBATCH_PARTITION=cpu.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
kind="${1:?usage: submit.sh explore|sweep SHARDS ARGS...}"
shards="${2:?usage: submit.sh explore|sweep SHARDS ARGS...}"
shift 2
: "${OUT:=out}"
export PDKV="${PDKV:-pdkv}" OUT
mkdir -p "$OUT"
# Slurm does not create the folders of --output; OUT exists now.
array=$(sbatch --parsable --array="0-$((shards - 1))" --output="$OUT/slurm-%A_%a.txt" \
    "$here/shard.sh" "$kind" "$@")
array="${array%%;*}"
echo "shards: job $array (array 0-$((shards - 1)))"
wait_flag=()
if [ "${WAIT:-0}" = 1 ]; then
    wait_flag=(--wait)
fi
# afterok: the merge runs only if every shard wrote its file; kill-on-invalid-dep drops it
# (instead of leaving it pending forever) when a shard failed.
code=0
merge=$(sbatch --parsable "${wait_flag[@]}" --dependency="afterok:$array" --kill-on-invalid-dep=yes \
    --output="$OUT/slurm-merge-%j.txt" "$here/merge.sh" "$kind") || code=$?
echo "merge: job ${merge%%;*} (output in $OUT/slurm-merge-${merge%%;*}.txt)"
exit "$code"
