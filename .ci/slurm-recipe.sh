#!/usr/bin/env bash
# Runs the Slurm job-array recipe (deploy/slurm, docs/cluster-campaigns.md) for real: a
# single-node Slurm (Debian's slurm-wlm: slurmctld and slurmd on this machine, munge for
# authentication, every state file in a temporary folder) runs a sharded exploration (a clean one
# and one that finds a bug) and a sharded sweep as job arrays with a dependent merge job, and
# each merged result must be byte for byte what the unsharded run writes here. Run as root (it
# installs packages and starts daemons), from a checkout; about a minute once pdkv is built.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo=sudo; fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
cargo build --release --quiet
pdkv="$root/target/release/pdkv"

work="$(mktemp -d /tmp/pdkv-slurm.XXXXXX)"
state="$work/state"
mkdir -p "$state/ctld" "$state/d"
# Ports of our own, so a Slurm already on the machine's default ports is left alone.
host="$(hostname -s)"
cat >"$work/slurm.conf" <<CONF
ClusterName=pdkv-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$work/slurm.conf"

started=()
# Whether any of the pids still runs (a zombie no longer does: where nothing reaps the
# daemons, they stay zombies after they stop).
running() {
    local pid state
    for pid in "$@"; do
        state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
        if [ -n "$state" ] && [ "$state" != Z ]; then return 0; fi
    done
    return 1
}
stop() {
    local code=$?
    # Only the daemons this script started, by the pids they wrote; then the state, unless a
    # failure needs its logs.
    local pids=()
    for pidfile in "${started[@]}"; do
        if [ -s "$pidfile" ]; then pids+=("$(cat "$pidfile")"); fi
    done
    if [ "${#pids[@]}" -gt 0 ]; then
        kill "${pids[@]}" 2>/dev/null || true
        # slurmctld saves its state as it stops: wait for it before removing the folder.
        for _ in $(seq 20); do
            running "${pids[@]}" || break
            sleep 0.5
        done
    fi
    if [ "$code" -eq 0 ]; then
        rm -rf "$work"
    else
        echo "the Slurm recipe failed; Slurm's logs: $state/slurmctld.log, $state/slurmd.log" >&2
    fi
}
trap stop EXIT

# munge: the package makes the key; the daemon runs as its own user.
if ! pgrep -x munged >/dev/null; then
    if [ ! -s /etc/munge/munge.key ]; then
        $sudo mungekey --create --keyfile /etc/munge/munge.key
        $sudo chown munge:munge /etc/munge/munge.key
    fi
    $sudo mkdir -p /run/munge
    $sudo chown munge:munge /run/munge
    $sudo runuser -u munge -- /usr/sbin/munged
    started+=(/run/munge/munged.pid)
fi
$sudo slurmctld -f "$SLURM_CONF"
started+=("$state/slurmctld.pid")
$sudo slurmd -f "$SLURM_CONF"
started+=("$state/slurmd.pid")
for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -q idle; then break; fi
    sleep 1
done
sinfo

cd "$work"
export PDKV="$pdkv" WAIT=1
failed=0
# check NAME WHOLE MERGED: the unsharded result against the merged one, byte for byte.
check() {
    if diff -r "$2" "$3" >/dev/null; then
        echo "slurm $1: merged shards identical to the unsharded run"
    else
        echo "slurm $1: merged shards DIFFER from the unsharded run ($2, $3)"
        failed=1
    fi
}
# A clean exploration: exit 0 from the merge.
OUT=clean "$root/deploy/slurm/submit.sh" explore 3 notify-drift-fixed --seeds 600 --faults swarm
"$pdkv" explore notify-drift-fixed --seeds 600 --faults swarm --result clean.json >/dev/null
check "explore notify-drift-fixed" clean.json clean/explore.json
# An exploration that finds a bug (the smallest failing seed is not in shard 0): the merge
# exits 1, as the unsharded run does.
code=0
OUT=bug "$root/deploy/slurm/submit.sh" explore 3 proxy-aliasing --seeds 60 --faults swarm || code=$?
if [ "$code" -ne 1 ]; then
    echo "slurm explore proxy-aliasing: the merge exited $code, not 1"
    failed=1
fi
code=0
"$pdkv" explore proxy-aliasing --seeds 60 --faults swarm --result bug.json --out shrunk >/dev/null || code=$?
[ "$code" -eq 1 ] || failed=1
check "explore proxy-aliasing" bug.json bug/explore.json
check "explore proxy-aliasing (shrunk scenario)" shrunk bug/shrunk
# A sweep: every file of the report.
OUT=sweep "$root/deploy/slurm/submit.sh" sweep 2 1P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 4,8,16 --requests-per-client 2
"$pdkv" sweep 1P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 4,8,16 --requests-per-client 2 --out sweep-whole >/dev/null
check "sweep" sweep-whole sweep/sweep

if [ "$failed" -ne 0 ]; then
    exit 1
fi
echo "the Slurm recipe ran: 3 job arrays and their merges, all identical to the unsharded runs"
