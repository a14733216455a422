#!/usr/bin/env bash
# Start or stop a SLURM cluster on this machine (for megatron-lns's tests).
#
#   cluster.sh start DIR [--nodes N]
#       install SLURM + munge from Debian packages if missing, then start munged,
#       slurmctld and slurmd with state, logs and pid files under DIR, check that these
#       very daemons answer on the cluster's ports, and wait until every node is idle.
#       Clients need `export SLURM_CONF=DIR/slurm.conf`; the ports are in DIR/ports.env.
#       N=1 (the default): this machine is the only node, on 127.0.0.1.
#       N>=2: N nodes, each a slurmd in its own network namespace with its own address
#       (on a private /24 behind a bridge), hostname and /etc/hosts (see start_node and
#       docs/cluster.md); the names made are in DIR/run/network.
#   cluster.sh kill-node DIR I
#       take node I off the network and kill everything in its namespace (its slurmd,
#       and the job steps and ranks it started), as a lost machine.
#   cluster.sh revive-node DIR I
#       bring node I back on the network and start its slurmd again.
#   cluster.sh stop DIR
#       stop the daemons that `start DIR` started (and only those), kill what is left in
#       its nodes' namespaces, and remove the namespaces, links and bridge it made.
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
# The node namespaces' subnet is 10.A.B.0/24 for some free A in this range and any B.
SUBNET_FIRST_OCTET=(200 250)
CTLD_HOST_NUMBER=254  # the bridge's (and slurmctld's) address in that subnet

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

# port_sockets PORT [PID]: the inodes of the TCP sockets bound to PORT (listening, or
# bound and not yet listening) in PID's network namespace (default: this one's).
port_sockets() {
    local hex net=/proc/${2:-self}/net
    hex=$(printf ':%04X' "$1")
    awk -v port="$hex" 'FNR > 1 && substr($2, length($2) - 4) == port \
        && ($4 == "0A" || $4 == "07") { print $10 }' "$net/tcp" "$net/tcp6"
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

# record NAME PIDFILE [NODE]: wait until the daemon has written its pid file, then record
# it (a slurmd with the node it runs).
record() {
    local name=$1 pidfile=$2 node=${3:-} pid started
    for _ in $(seq 60); do
        pid=$(cat "$pidfile" 2>/dev/null || true)
        if [[ -n $pid ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] \
            && started=$(start_time "$pid"); then
            echo "$name $pid $started${node:+ $node}" >> "$DIR/run/daemons"
            return
        fi
        sleep 0.5
    done
    die "$name did not start (no live $name named in $pidfile; logs in $DIR/log)"
}

recorded() {  # recorded NAME [NODE]: "PID STARTED" of the NAME (of NODE) started here
    awk -v name="$1" -v node="${2:-}" '$1 == name && $4 == node { print $2, $3 }' \
        "$DIR/run/daemons" 2>/dev/null
}

# alive_on NAME PORT [NODE]: the recorded NAME is still running and holds PORT itself
# (in its own network namespace).
alive_on() {
    local name=$1 port=$2 node=${3:-} pid started inode
    read -r pid started <<< "$(recorded "$name" "$node")"
    is_ours "$name" "$pid" "$started" || die "$name${node:+ of $node} (pid $pid) exited;" \
        "see $DIR/log"
    for inode in $(port_sockets "$port" "$pid"); do
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

# Every node's own slurmd holds the slurmd port, and SLURM reports every node idle.
nodes_idle() {
    local node states
    for node in "${NODES[@]}"; do
        alive_on slurmd "$SLURMD_PORT" "$node" || return 1
    done
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
    [[ $(grep -c ' idle$' <<< "$states") == "${#NODES[@]}" ]]
}

# Stop the daemons recorded in DIR, newest first, each only while it is still that process.
stop_recorded() {
    local name pid started
    [[ -f $DIR/run/daemons ]] || return 0
    tac "$DIR/run/daemons" | while read -r name pid started _; do
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
    rm -f "$DIR/run/daemons" "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd*.pid \
        "$DIR"/munge/munged.pid
}

# --- the nodes' network (N >= 2) ----------------------------------------------------------

ip_number() {  # ip_number A.B.C.D: the address as one integer
    local a b c d
    IFS=. read -r a b c d <<< "$1"
    echo $(((a << 24) | (b << 16) | (c << 8) | d))
}

# The IPv4 networks this machine already has (addresses and routes, every table), as
# "FIRST LAST" integer pairs.
networks_in_use() {
    local net addr len first
    { ip -4 -o addr show | awk '{ print $4 }'
      ip -4 route show table all | awk '$1 ~ /^[0-9.]+(\/[0-9]+)?$/ { print $1 }'
    } | while read -r net; do
        addr=${net%/*} len=32
        [[ $net == */* ]] && len=${net#*/}
        first=$(( $(ip_number "$addr") & ~((1 << (32 - len)) - 1) & 0xFFFFFFFF ))
        echo "$first $((first + (1 << (32 - len)) - 1))"
    done
}

# A /24 (its first three octets, "10.A.B") that overlaps none of this machine's networks.
choose_subnet() {
    local in_use low=${SUBNET_FIRST_OCTET[0]} high=${SUBNET_FIRST_OCTET[1]}
    local prefix first clash net_first net_last
    in_use=$(networks_in_use)
    for _ in $(seq 200); do
        prefix="10.$((low + RANDOM % (high - low))).$((RANDOM % 256))"
        first=$(ip_number "$prefix.0")
        clash=0
        while read -r net_first net_last; do
            [[ -n $net_first ]] && ((net_first <= first + 255 && first <= net_last)) \
                && { clash=1; break; }
        done <<< "$in_use"
        ((clash)) || { echo "$prefix"; return; }
    done
    die "no free /24 found in 10.$low-$((high - 1)).x.0"
}

# A short id for this cluster's names (namespaces, links, nodes) that none has yet.
choose_id() {
    local id
    for _ in $(seq 100); do
        id=$(printf '%04x' $((RANDOM % 65536)))
        if [[ ! -e /run/netns/lns${id}n1 ]] && ! ip link show "lns${id}br" >/dev/null 2>&1; then
            echo "$id"
            return
        fi
    done
    die "no unused cluster id found"
}

# made KIND NAME: record a namespace or link as this cluster's once it is made (so that a
# failure later removes it, and nothing that another cluster made is ever removed).
made() { echo "$1 $2" >> "$DIR/run/network"; }

# make_network ID PREFIX: the bridge (slurmctld's address), one namespace per node with a
# veth into the bridge, and the hosts file every node sees as /etc/hosts.
make_network() {
    local id=$1 prefix=$2 bridge="lns$1br" i ns
    ip link add "$bridge" type bridge
    made link "$bridge"
    ip addr add "$prefix.$CTLD_HOST_NUMBER/24" dev "$bridge"
    ip link set "$bridge" up
    printf '127.0.0.1 localhost\n%s %s\n' "$prefix.$CTLD_HOST_NUMBER" "$CTLD_HOST" \
        > "$DIR/hosts"
    for i in $(seq "${#NODES[@]}"); do
        ns=${NODES[i - 1]}
        ip netns add "$ns"
        made netns "$ns"
        ip link add "lns${id}v$i" type veth peer name eth0 netns "$ns"
        made link "lns${id}v$i"
        ip link set "lns${id}v$i" master "$bridge" up
        ip -n "$ns" addr add "$prefix.$i/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        echo "$prefix.$i $ns" >> "$DIR/hosts"
    done
    chmod 644 "$DIR/hosts"
}

# Kill every process in node namespace NS (only ours can be there: we made it).
kill_namespace() {
    local ns=$1 pids
    [[ -e /run/netns/$ns ]] || return 0
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
}

# Remove what DIR/run/network records (newest first), each only if it still exists.
remove_network() {
    local kind name
    [[ -f $DIR/run/network ]] || return 0
    tac "$DIR/run/network" | while read -r kind name; do
        case $kind in
            netns) kill_namespace "$name"
                   [[ ! -e /run/netns/$name ]] || ip netns del "$name" ;;
            link) ! ip link show "$name" >/dev/null 2>&1 || ip link del "$name" ;;
        esac
    done
    rm -f "$DIR/run/network"
}

# start_node NODE: the node's slurmd, in its namespace with its own hostname (UTS namespace)
# and DIR/hosts as /etc/hosts (mount namespace), so every name in the job's node list
# resolves there to that node's address, and gloo binds to it.
start_node() {
    local node=$1
    mkdir -p "$DIR/spool/$node"
    # nsenter rather than `ip netns exec`, which mounts a new /sys without the cgroup
    # file system slurmd needs.
    # shellcheck disable=SC2016
    nsenter --net="/run/netns/$node" unshare --uts --mount sh -c \
        'mount --bind "$1" /etc/hosts && hostname "$2" && exec /usr/sbin/slurmd -N "$2"' \
        sh "$DIR/hosts" "$node"
    record slurmd "$DIR/run/slurmd-$node.pid" "$node"
}

# --- start and stop --------------------------------------------------------------------

render_conf() {  # render_conf NODE_LINE CTLD_ADDR SLURMD_TIMEOUT
    sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$CTLD_HOST|g" -e "s|@CTLD_ADDR@|$2|g" \
        -e "s|@NODES@|$1|g" -e "s|@SLURMD_TIMEOUT@|$3|g" \
        -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
        "$HERE/slurm.conf.template" > "$DIR/slurm.conf"
}

# One node: this machine as `slurmd -C` describes it, on 127.0.0.1.
configure_this_machine() {
    local node
    node=$(slurmd -C | head -n 1)
    [[ $node == NodeName=* ]] || die "unexpected 'slurmd -C' output: $node"
    NODES=("$(sed 's/^NodeName=\([^ ]*\).*/\1/' <<< "$node")")
    render_conf "$node NodeAddr=127.0.0.1" 127.0.0.1 300
}

# N nodes lns<id>n1..N in their namespaces, with 2 CPUs each whatever this machine has
# (config_overrides; the tests' ranks are tiny). A lost node is noticed within ~20 s.
configure_namespaces() {
    local id prefix nodes i
    id=$(choose_id)
    prefix=$(choose_subnet)
    NODES=()
    for i in $(seq "$NODE_COUNT"); do NODES+=("lns${id}n$i"); done
    nodes="NodeName=lns${id}n[1-$NODE_COUNT] NodeAddr=$prefix.[1-$NODE_COUNT]"
    nodes+=" CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=1000"
    render_conf "$nodes" "$prefix.$CTLD_HOST_NUMBER" 20
    echo "SlurmdParameters=config_overrides" >> "$DIR/slurm.conf"
    make_network "$id" "$prefix"
}

start() {
    [[ $(id -u) == 0 ]] || die "must run as root (slurmd runs as root)"
    [[ $NODE_COUNT =~ ^[1-9][0-9]?$ ]] || die "--nodes $NODE_COUNT: give 1 to 99 nodes"
    local name pid started
    while read -r name pid started _; do
        ! is_ours "$name" "$pid" "$started" || die "already running in $DIR ($name, pid $pid)"
    done < <(cat "$DIR/run/daemons" 2>/dev/null)
    [[ ! -s $DIR/run/network ]] || die "$DIR/run/network lists a network still there;" \
        "run cluster.sh stop $DIR first"
    CTLD_PORT=$(choose_port SLURM_TEST_CTLD_PORT "")
    SLURMD_PORT=$(choose_port SLURM_TEST_SLURMD_PORT "$CTLD_PORT")
    [[ $CTLD_PORT != "$SLURMD_PORT" ]] || die "slurmctld and slurmd need two ports, not one"
    install_slurm
    mkdir -p "$DIR"/{state,spool,log,run,munge}
    rm -f "$DIR/run/daemons" "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd*.pid \
        "$DIR"/munge/munged.pid
    # From here on, a failure stops whatever this start started.
    trap 'stop_recorded; remove_network' EXIT
    # munged runs as the munge user and insists on owning its socket directory.
    chmod 755 "$DIR"
    chown munge:munge "$DIR/munge"
    chmod 755 "$DIR/munge"  # clients need to reach the socket

    CTLD_HOST=$(hostname -s)
    if ((NODE_COUNT == 1)); then configure_this_machine; else configure_namespaces; fi
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
    local node
    if ((NODE_COUNT == 1)); then
        mkdir -p "$DIR/spool/${NODES[0]}"
        /usr/sbin/slurmd
        record slurmd "$DIR/run/slurmd-${NODES[0]}.pid" "${NODES[0]}"
    else
        for node in "${NODES[@]}"; do start_node "$node"; done
    fi
    wait_for 60 "every node to be idle (slurmd on port $SLURMD_PORT)" nodes_idle
    trap - EXIT
    echo "cluster.sh: SLURM is up on ports $CTLD_PORT/$SLURMD_PORT with" \
        "$NODE_COUNT node(s) (export SLURM_CONF=$DIR/slurm.conf)" >&2
}

stop() {
    if [[ ! -f $DIR/run/daemons ]] && compgen -G "$DIR/run/*.pid" >/dev/null; then
        echo "cluster.sh: no record of daemons started in $DIR; stopping nothing" >&2
    fi
    stop_recorded
    remove_network
}

# node_name I: node I's name (its namespace and hostname), from DIR/run/network.
node_name() {
    local node
    node=$(awk -v i="$1" '$1 == "netns" && $2 ~ ("n" i "$") { print $2 }' \
        "$DIR/run/network" 2>/dev/null)
    [[ -n $node ]] || die "no node $1 in $DIR/run/network (needs a cluster started with" \
        "--nodes 2 or more)"
    echo "$node"
}

# A lost node, as when a machine dies: first off the network (so no connection of its
# processes is closed in an orderly way: its peers see nothing), then everything on it
# killed. SLURM notices after SlurmdTimeout.
kill_node() {
    local node
    node=$(node_name "$1")
    ip link set "lns${node:3:4}v$1" down
    kill_namespace "$node"
    echo "cluster.sh: node $node is off the network and everything on it is killed" >&2
}

# A lost node back: on the network and its slurmd started (SLURM returns it to service
# when it registers, ReturnToService=2).
revive_node() {
    local node
    node=$(node_name "$1")
    export SLURM_CONF=$DIR/slurm.conf
    ip link set "lns${node:3:4}v$1" up
    sed -i "/^slurmd [0-9]* [0-9]* $node\$/d" "$DIR/run/daemons"
    start_node "$node"
    echo "cluster.sh: node $node is back" >&2
}

usage="usage: cluster.sh start DIR [--nodes N] | kill-node DIR I | revive-node DIR I | stop DIR"
(($# >= 2)) || die "$usage"
COMMAND=$1
DIR=$(realpath -m "$2")
shift 2
NODE_COUNT=1
case $COMMAND in
    start)
        if (($# == 2)) && [[ $1 == --nodes ]]; then NODE_COUNT=$2
        elif (($# != 0)); then die "$usage"; fi
        start ;;
    kill-node) (($# == 1)) || die "$usage"; kill_node "$1" ;;
    revive-node) (($# == 1)) || die "$usage"; revive_node "$1" ;;
    stop) (($# == 0)) || die "$usage"; stop ;;
    *) die "$usage" ;;
esac
