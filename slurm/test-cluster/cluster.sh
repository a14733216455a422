#!/usr/bin/env bash
# Start or stop a one-node SLURM cluster on localhost (for megatron-lns's tests).
#
#   cluster.sh start DIR   install SLURM + munge from Debian packages if missing, then start
#                          munged, slurmctld and slurmd with state, logs and pid files under
#                          DIR, check that these very daemons answer on the cluster's ports,
#                          and wait until the node is idle. Clients need
#                          `export SLURM_CONF=DIR/slurm.conf`; the ports are in DIR/ports.env.
#   cluster.sh stop DIR    stop the daemons that `start DIR` started (and only those).
#
# Needs root (SLURM runs jobs as the submitting user and slurmd as root).
#
# Several clusters may run on one machine (a CI run's and a developer's), so a cluster
# must never use, or be mistaken for, another one: `start` picks two free ports (or takes
# SLURM_TEST_CTLD_PORT / SLURM_TEST_SLURMD_PORT, and refuses a port already in use), and
# says "SLURM is up" only once its own slurmctld and slurmd hold those ports and answer;
# otherwise it stops what it started and fails. It records each daemon's pid with the
# process's start time (DIR/run/daemons), and `stop` kills a pid only while it is still
# that process: a pid file outlives its daemon, and its pid may since name anything.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
# Free ports are picked above the MASTER_PORTs the jobs use (10000-29999) and below the
# kernel's ephemeral range (where outgoing connections would take them meanwhile).
PICK_FROM=30000

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

# --- ports ------------------------------------------------------------------------------

# The inodes of the TCP sockets bound to PORT (listening, or bound and not yet listening).
port_sockets() {
    local hex
    hex=$(printf ':%04X' "$1")
    awk -v port="$hex" 'FNR > 1 && substr($2, length($2) - 4) == port \
        && ($4 == "0A" || $4 == "07") { print $10 }' /proc/net/tcp /proc/net/tcp6
}

port_in_use() { [[ -n $(port_sockets "$1") ]]; }

# choose_port VARIABLE OTHER: the port VARIABLE names, refused if in use; else a free one.
choose_port() {
    local variable=$1 other=$2 port low
    port=${!variable:-}
    if [[ -n $port ]]; then
        [[ $port =~ ^[0-9]+$ ]] && ((port > 0 && port < 65536)) \
            || die "$variable=$port is not a port number"
        ! port_in_use "$port" \
            || die "port $port ($variable) is already in use: another cluster or program" \
                "listens there; choose a free port, or unset $variable to pick one"
        echo "$port"
        return
    fi
    low=$(awk '{ print $1 }' /proc/sys/net/ipv4/ip_local_port_range)
    ((low > PICK_FROM + 100)) || low=$((PICK_FROM + 2768))
    for _ in $(seq 200); do
        port=$((PICK_FROM + RANDOM % (low - PICK_FROM)))
        if [[ $port != "$other" ]] && ! port_in_use "$port"; then
            echo "$port"
            return
        fi
    done
    die "no free port found between $PICK_FROM and $low"
}

# --- the daemons this cluster started --------------------------------------------------

# A process's start time (clock ticks since boot): with its pid, it names one process.
start_time() {
    [[ -r /proc/$1/stat ]] || return 1
    sed 's/.*) //' "/proc/$1/stat" | awk '{ print $20 }'
}

# is_ours NAME PID STARTED: whether PID is still the NAME process recorded at start
# (and has not exited: a zombie waiting for its parent counts as gone).
is_ours() {
    [[ $(cat "/proc/$2/comm" 2>/dev/null) == "$1" && $(start_time "$2") == "$3" ]] \
        && [[ $(sed 's/.*) //' "/proc/$2/stat" 2>/dev/null | awk '{ print $1 }') != Z ]]
}

# record NAME PIDFILE: wait until the daemon has written its pid file, then record it.
record() {
    local name=$1 pidfile=$2 pid started
    for _ in $(seq 60); do
        pid=$(cat "$pidfile" 2>/dev/null || true)
        if [[ -n $pid ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] \
            && started=$(start_time "$pid"); then
            echo "$name $pid $started" >> "$DIR/run/daemons"
            return
        fi
        sleep 0.5
    done
    die "$name did not start (no live $name named in $pidfile; logs in $DIR/log)"
}

recorded() {  # recorded NAME: "PID STARTED" of the NAME started here
    awk -v name="$1" '$1 == name { print $2, $3 }' "$DIR/run/daemons" 2>/dev/null
}

# alive_on NAME PORT: the recorded NAME is still running and holds PORT itself.
alive_on() {
    local name=$1 port=$2 pid started inode
    read -r pid started <<< "$(recorded "$name")"
    is_ours "$name" "$pid" "$started" || die "$name (pid $pid) exited; see $DIR/log/$name.log"
    for inode in $(port_sockets "$port"); do
        if find "/proc/$pid/fd" -lname "socket:\[$inode\]" 2>/dev/null | grep -q .; then
            return 0
        fi
    done
    return 1
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq $((seconds * 2))); do
        if "$@"; then return 0; fi
        sleep 0.5
    done
    die "timed out after ${seconds}s waiting for $what (logs in $DIR/log)"
}

munged_answers() {
    munge -n --socket="$DIR/munge/munge.socket" >/dev/null 2>&1
}

ctld_answers() {
    alive_on slurmctld "$CTLD_PORT" && scontrol ping 2>/dev/null | grep -q "is UP"
}

node_idle() {
    alive_on slurmd "$SLURMD_PORT" && [[ $(sinfo -h -o %t 2>/dev/null) == idle ]]
}

# Stop the daemons recorded in DIR, newest first, each only while it is still that process.
stop_recorded() {
    local name pid started
    [[ -f $DIR/run/daemons ]] || return 0
    tac "$DIR/run/daemons" | while read -r name pid started; do
        if ! is_ours "$name" "$pid" "$started"; then
            continue  # gone already; its pid may name another process now
        fi
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 60); do
            is_ours "$name" "$pid" "$started" || break
            sleep 0.5
        done
        if is_ours "$name" "$pid" "$started"; then
            echo "cluster.sh: $name (pid $pid) ignored SIGTERM; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    rm -f "$DIR/run/daemons" "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd.pid \
        "$DIR"/munge/munged.pid
}

start() {
    [[ $(id -u) == 0 ]] || die "must run as root (slurmd runs as root)"
    local name pid started
    while read -r name pid started; do
        ! is_ours "$name" "$pid" "$started" || die "already running in $DIR ($name, pid $pid)"
    done < <(cat "$DIR/run/daemons" 2>/dev/null)
    CTLD_PORT=$(choose_port SLURM_TEST_CTLD_PORT "")
    SLURMD_PORT=$(choose_port SLURM_TEST_SLURMD_PORT "$CTLD_PORT")
    [[ $CTLD_PORT != "$SLURMD_PORT" ]] || die "slurmctld and slurmd need two ports, not one"
    install_slurm
    mkdir -p "$DIR"/{state,spool,log,run,munge}
    rm -f "$DIR/run/daemons" "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd.pid \
        "$DIR"/munge/munged.pid
    # From here on, a failure stops whatever this start started.
    trap 'stop_recorded' EXIT
    # munged runs as the munge user and insists on owning its socket directory.
    chmod 755 "$DIR"
    chown munge:munge "$DIR/munge"
    chmod 755 "$DIR/munge"  # clients need to reach the socket

    local host node
    host=$(hostname -s)
    node=$(slurmd -C | head -n 1)
    [[ $node == NodeName=* ]] || die "unexpected 'slurmd -C' output: $node"
    sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$host|g" -e "s|@NODE@|$node|g" \
        -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
        "$HERE/slurm.conf.template" > "$DIR/slurm.conf"
    printf 'SLURM_TEST_CTLD_PORT=%s\nSLURM_TEST_SLURMD_PORT=%s\n' "$CTLD_PORT" "$SLURMD_PORT" \
        > "$DIR/ports.env"
    export SLURM_CONF=$DIR/slurm.conf

    su -s /bin/sh munge -c "/usr/sbin/munged --socket=$DIR/munge/munge.socket \
        --pid-file=$DIR/munge/munged.pid --log-file=$DIR/munge/munged.log \
        --seed-file=$DIR/munge/munged.seed"
    record munged "$DIR/munge/munged.pid"
    wait_for 10 munged munged_answers
    /usr/sbin/slurmctld
    record slurmctld "$DIR/run/slurmctld.pid"
    wait_for 30 "slurmctld on port $CTLD_PORT" ctld_answers
    /usr/sbin/slurmd
    record slurmd "$DIR/run/slurmd.pid"
    wait_for 60 "the node to be idle (slurmd on port $SLURMD_PORT)" node_idle
    trap - EXIT
    echo "cluster.sh: SLURM is up on ports $CTLD_PORT/$SLURMD_PORT" \
        "(export SLURM_CONF=$DIR/slurm.conf)" >&2
}

stop() {
    if [[ ! -f $DIR/run/daemons ]] && compgen -G "$DIR/run/*.pid" >/dev/null; then
        echo "cluster.sh: no record of daemons started in $DIR; stopping nothing" >&2
    fi
    stop_recorded
}

[[ $# == 2 ]] || die "usage: cluster.sh start|stop DIR"
DIR=$(realpath -m "$2")
case $1 in
    start) start ;;
    stop) stop ;;
    *) die "usage: cluster.sh start|stop DIR" ;;
esac
