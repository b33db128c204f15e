#!/usr/bin/env bash
# The merge of a sharded pdkv exploration or sweep: a Slurm job that runs after the array.
#
#   sbatch --dependency=afterok:<array job id> deploy/slurm/merge.sh explore
#   sbatch --dependency=afterok:<array job id> deploy/slurm/merge.sh sweep
#
# Reads the shards deploy/slurm/shard.sh wrote into $OUT (default out/) and writes what the
# unsharded run writes, byte for byte: out/explore.json (and a failure's shrunk scenario in
# out/shrunk/), or the sweep report in out/sweep/. Its exit code is the campaign's: 0 nothing
# broken (every point as expected), 1 a seed broke a property (a point did not end as expected),
# 2 the shard files do not belong together (the file at fault is named).
#SBATCH --job-name=pdkv-merge
#SBATCH --cpus-per-task=1
set -euo pipefail

: "${PDKV:=pdkv}"
: "${OUT:=out}"
case "${1:?usage: merge.sh explore|sweep}" in
explore)
    exec "$PDKV" explore-merge "$OUT"/shard-*.json --result "$OUT/explore.json" --out "$OUT/shrunk"
    ;;
sweep)
    exec "$PDKV" sweep-merge "$OUT"/shard-*/ --out "$OUT/sweep"
    ;;
*)
    echo "merge.sh: the argument is explore or sweep, not \`$1\`" >&2
    exit 2
    ;;
esac
