#!/usr/bin/env bash
# Start or stop a one-node SLURM cluster on localhost (for megatron-lns's tests).
#
#   cluster.sh start DIR   install SLURM + munge from Debian packages if missing, then start
#                          munged, slurmctld and slurmd with state, logs and pid files under
#                          DIR, and wait until the node is idle. Clients need
#                          `export SLURM_CONF=DIR/slurm.conf`.
#   cluster.sh stop DIR    stop the daemons started in DIR, by their pid files.
#
# Needs root (SLURM runs jobs as the submitting user and slurmd as root). Ports can be
# moved with SLURM_TEST_CTLD_PORT / SLURM_TEST_SLURMD_PORT (default 16817 / 16818).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)

die() { echo "cluster.sh: $*" >&2; exit 1; }

install_slurm() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "SLURM is not installed and apt-get is not available"
    echo "cluster.sh: installing SLURM and munge from Debian packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
}

# Kill the process named in a pid file and wait (up to 30 s) until it is gone.
stop_pidfile() {
    local pidfile=$1 pid
    [[ -f $pidfile ]] || return 0
    pid=$(cat "$pidfile")
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "cluster.sh: pid $pid ($pidfile) ignored SIGTERM; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$pidfile"
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq $((seconds * 2))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    die "timed out after ${seconds}s waiting for $what (logs in $DIR/log)"
}

node_idle() {
    [[ $(sinfo -h -o %t 2>/dev/null) == idle ]]
}

running() {  # running PIDFILE: whether the process it names is alive
    [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

start() {
    [[ $(id -u) == 0 ]] || die "must run as root (slurmd runs as root)"
    for pidfile in "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd.pid "$DIR"/munge/munged.pid; do
        if running "$pidfile"; then die "already running in $DIR ($pidfile)"; fi
    done
    install_slurm
    mkdir -p "$DIR"/{state,spool,log,run,munge}
    # munged runs as the munge user and insists on owning its socket directory.
    chmod 755 "$DIR"
    chown munge:munge "$DIR/munge"
    chmod 755 "$DIR/munge"  # clients need to reach the socket

    local host node
    host=$(hostname -s)
    node=$(slurmd -C | head -n 1)
    [[ $node == NodeName=* ]] || die "unexpected 'slurmd -C' output: $node"
    sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$host|g" -e "s|@NODE@|$node|g" \
        -e "s|@CTLD_PORT@|${SLURM_TEST_CTLD_PORT:-16817}|g" \
        -e "s|@SLURMD_PORT@|${SLURM_TEST_SLURMD_PORT:-16818}|g" \
        "$HERE/slurm.conf.template" > "$DIR/slurm.conf"
    export SLURM_CONF=$DIR/slurm.conf

    su -s /bin/sh munge -c "/usr/sbin/munged --socket=$DIR/munge/munge.socket \
        --pid-file=$DIR/munge/munged.pid --log-file=$DIR/munge/munged.log \
        --seed-file=$DIR/munge/munged.seed"
    wait_for 10 munged munge -n --socket="$DIR/munge/munge.socket"
    /usr/sbin/slurmctld
    wait_for 30 slurmctld scontrol ping
    /usr/sbin/slurmd
    wait_for 60 "the node to be idle" node_idle
    echo "cluster.sh: SLURM is up (export SLURM_CONF=$DIR/slurm.conf)" >&2
}

stop() {
    stop_pidfile "$DIR/run/slurmd.pid"
    stop_pidfile "$DIR/run/slurmctld.pid"
    stop_pidfile "$DIR/munge/munged.pid"
}

[[ $# == 2 ]] || die "usage: cluster.sh start|stop DIR"
DIR=$(realpath -m "$2")
case $1 in
    start) start ;;
    stop) stop ;;
    *) die "usage: cluster.sh start|stop DIR" ;;
esac
