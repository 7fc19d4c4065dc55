#!/usr/bin/env bash
# A real one-node Slurm (munge, slurmctld, slurmd from Debian's packages) for the pipeline's
# cluster test (tests/test_slurm.py) and for trying the Slurm profile by hand.
#
#   .ci/slurm-cluster.sh up   DIR    install the packages if missing, start the daemons
#   .ci/slurm-cluster.sh down DIR    cancel every job, stop the daemons by their PIDs
#   .ci/slurm-cluster.sh env  DIR    print `export SLURM_CONF=...` for this cluster
#
# SLURM_CLUSTER_CPUS=N declares N CPUs on the node instead of what slurmd detects (the test
# sets it above the machine's count: its jobs are mostly start-up and waiting, and a 2-CPU
# node would run them one or two at a time).
# Everything lives under DIR (config, state, spool, logs, munge key and socket, pid files).
# The one thing outside it is a symlink /etc/slurm/slurm.conf -> DIR/etc/slurm.conf (removed
# by `down`): Snakemake's jobstep drops SLURM_CONF before its srun inside a job, so the
# default path must lead to this cluster. A slurm.conf that is not such a link is never
# touched: `up` refuses to run on a machine with a real Slurm configuration.
# Needs root (apt-get, daemons) and no systemd. Every wait is bounded; on failure the
# daemons' logs are printed and the exit status is non-zero: 75 when another cluster of this
# script is running on the machine (one at a time: they would share the link below).
# Accounting: none (no slurmdbd). Job states come from squeue (Snakemake:
# --slurm-status-command squeue), finished jobs are kept MinJobAge=300 s and every finished
# job gets a line in DIR/log/jobcomp.log (jobcomp/filetxt); submissions are in
# DIR/log/slurmctld.log (`_slurm_rpc_submit_batch_job: JobId=N`).
set -euo pipefail

PACKAGES="slurm-wlm slurmctld slurmd slurm-client munge"
BINARIES="slurmctld slurmd sbatch squeue scancel sinfo munged mungekey munge unmunge"

die() { echo "slurm-cluster: error: $*" >&2; exit 1; }
say() { echo "slurm-cluster: $*" >&2; }

usage() { sed -n '2,9p' "$0" >&2; exit 2; }

[ $# -eq 2 ] || usage
CMD=$1
DIR=$(realpath -m "$2")
CONF=$DIR/etc/slurm.conf
SYSCONF=/etc/slurm/slurm.conf

missing_binaries() {
    local b out=""
    for b in $BINARIES; do command -v "$b" >/dev/null 2>&1 || out="$out $b"; done
    echo "$out"
}

install_packages() {
    [ -z "$(missing_binaries)" ] && return 0
    [ "$(id -u)" -eq 0 ] || die "Slurm is not installed ($(missing_binaries) missing) and installing it needs root"
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it"
    say "installing $PACKAGES"
    export DEBIAN_FRONTEND=noninteractive
    local apt="timeout -k 10 300 apt-get -q -y -o Dpkg::Use-Pty=0"
    if ! $apt install --no-install-recommends $PACKAGES >"$DIR/log/apt.log" 2>&1; then
        # a fresh machine may have no (or stale) package lists
        $apt update >>"$DIR/log/apt.log" 2>&1 || { tail -20 "$DIR/log/apt.log" >&2; die "apt-get update failed"; }
        $apt install --no-install-recommends $PACKAGES >>"$DIR/log/apt.log" 2>&1 \
            || { tail -20 "$DIR/log/apt.log" >&2; die "apt-get install $PACKAGES failed"; }
    fi
    [ -z "$(missing_binaries)" ] || die "still missing after install:$(missing_binaries)"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

pick_ports() {
    # the standard ports, unless another Slurm (or anything) holds them
    local base
    for base in 6817 16817 26817 36817 46817; do
        if ! port_in_use "$base" && ! port_in_use $((base + 1)); then
            echo "$base"; return 0
        fi
    done
    die "no free port pair for slurmctld/slurmd (tried 6817, 16817, ..., 46817)"
}

write_config() {
    local host node_line mem port
    host=$(hostname -s)
    # CPU topology as slurmd sees it, RealMemory at 90% of what it reports
    node_line=$(slurmd -C | head -1)
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
    [ -n "$mem" ] || die "cannot read RealMemory from 'slurmd -C': $node_line"
    node_line=$(sed -e "s/RealMemory=[0-9]*/RealMemory=$((mem * 9 / 10))/" -e "s/^NodeName=[^ ]*/NodeName=$host/" <<<"$node_line")
    local overrides=""
    if [ -n "${SLURM_CLUSTER_CPUS:-}" ]; then
        [[ $SLURM_CLUSTER_CPUS =~ ^[1-9][0-9]*$ ]] || die "SLURM_CLUSTER_CPUS must be a positive integer"
        node_line="NodeName=$host CPUs=$SLURM_CLUSTER_CPUS RealMemory=$((mem * 9 / 10))"
        overrides=$'# SLURM_CLUSTER_CPUS: more CPUs than the machine has\nSlurmdParameters=config_overrides'
    fi
    port=$(pick_ports)
    cat >"$CONF" <<EOF
# One-node cluster written by .ci/slurm-cluster.sh; everything under $DIR.
ClusterName=compatlas
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
ReturnToService=2
# squeue reports finished jobs for MinJobAge seconds: Snakemake's squeue status mode needs it
MinJobAge=300
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
MailProg=/bin/true
PlugStackConfig=$DIR/etc/plugstack.conf
$overrides
# a request the node can never satisfy is refused by sbatch at once instead of pending for ever
EnforcePartLimits=ALL
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    : >"$DIR/etc/plugstack.conf"
    echo "export SLURM_CONF=$CONF" >"$DIR/env.sh"
}

link_sysconf() {
    local target other
    if [ -e "$SYSCONF" ] || [ -L "$SYSCONF" ]; then
        target=$(readlink "$SYSCONF" || true)
        other=$(dirname "$(dirname "${target:-/nonexistent/x/y}")")
        # ours: a link into a folder of this script, or a dangling one left by a run that died
        if ! { [ -n "$target" ] && [ -f "$other/.compatlas-slurm-cluster" ]; } \
            && ! { [ ! -e "$SYSCONF" ] && [[ $target == */etc/slurm.conf ]] && [ ! -e "$other" ]; }; then
            die "$SYSCONF exists and is not a link written by this script: not touching a real Slurm setup"
        fi
        if [ "$other" != "$DIR" ] && pid_alive "$other/run/slurmctld.pid"; then
            echo "slurm-cluster: busy: another cluster of this script is running from $other" \
                 "('$0 down $other' stops it)" >&2
            exit 75  # EX_TEMPFAIL: one cluster a machine (the link above); try again later
        fi
    fi
    mkdir -p "$(dirname "$SYSCONF")"
    ln -sfn "$CONF" "$SYSCONF"
}

unlink_sysconf() {
    [ "$(readlink "$SYSCONF" 2>/dev/null || true)" = "$CONF" ] && rm -f "$SYSCONF"
    return 0
}

start_munge() {
    local m=$DIR/munge
    install -d -m 0755 -o munge -g munge "$m"  # the socket dir must be world-executable
    mungekey --create --keyfile="$m/munge.key" --force 2>/dev/null || dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$m/munge.key"
    chmod 0600 "$m/munge.key"
    runuser -u munge -- munged --socket="$m/munge.socket.2" --key-file="$m/munge.key" \
        --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" \
        || { cat "$m/munged.log" >&2 2>/dev/null || true; die "munged did not start"; }
    local i
    for i in $(seq 1 50); do
        if munge -S "$m/munge.socket.2" -n 2>/dev/null | unmunge -S "$m/munge.socket.2" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.2
    done
    cat "$m/munged.log" >&2 2>/dev/null || true
    die "munge does not answer on $m/munge.socket.2 after 10 s"
}

node_state() { timeout -k 2 10 sinfo -h -o %T 2>/dev/null | head -1; }

up() {
    [ "$(id -u)" -eq 0 ] || die "bringing up Slurm needs root (apt-get install, daemons); this is uid $(id -u)"
    if pid_alive "$DIR/run/slurmctld.pid"; then
        die "a cluster is already running in $DIR (down it first)"
    fi
    install -d -m 0755 "$DIR" "$DIR/etc" "$DIR/log" "$DIR/run" "$DIR/state" "$DIR/spool"
    touch "$DIR/.compatlas-slurm-cluster"
    local t0=$SECONDS
    install_packages
    write_config
    link_sysconf
    export SLURM_CONF=$CONF
    start_munge
    slurmctld -f "$CONF" || die "slurmctld did not start: $(tail -5 "$DIR/log/slurmctld.log" 2>/dev/null)"
    # the node name is the short hostname in slurm.conf; -N says so whatever slurmd thinks
    slurmd -f "$CONF" -N "$(hostname -s)" || die "slurmd did not start: $(tail -5 "$DIR/log/slurmd.log" 2>/dev/null)"
    local i state=""
    for i in $(seq 1 120); do
        state=$(node_state)
        case $state in idle*|mixed*|allocated*) break ;; esac
        sleep 0.5
    done
    case $state in
        idle*|mixed*|allocated*) ;;
        *) say "node state after 60 s: '${state:-no answer}'"
           tail -20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 2>/dev/null || true
           down_daemons
           unlink_sysconf
           die "the node did not become idle within 60 s" ;;
    esac
    say "cluster up in $((SECONDS - t0)) s: $(timeout -k 2 10 sinfo -h -o '%P %D %c CPUs %m MB %T')"
    echo "export SLURM_CONF=$CONF"
}

stop_pid() {
    # stop one daemon by the PID in its pid file: TERM, up to 10 s, then KILL
    local name=$1 pidfile=$2 pid i
    [ -f "$pidfile" ] || return 0
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        if kill -0 "$pid" 2>/dev/null; then
            say "$name ($pid) ignored TERM for 10 s: KILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$pidfile"
}

down_daemons() {
    stop_pid slurmd "$DIR/run/slurmd.pid"
    stop_pid slurmctld "$DIR/run/slurmctld.pid"
    stop_pid munged "$DIR/munge/munged.pid"
}

down() {
    [ -d "$DIR" ] || { say "nothing in $DIR"; return 0; }
    export SLURM_CONF=$CONF
    if pid_alive "$DIR/run/slurmctld.pid"; then
        # jobs first: a job's slurmstepd outlives slurmd
        local jobs i
        jobs=$(timeout -k 2 10 squeue -h -t PENDING,RUNNING,SUSPENDED,COMPLETING -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            say "cancelling jobs: $(echo $jobs)"
            timeout -k 2 10 scancel $jobs 2>/dev/null || true
            for i in $(seq 1 60); do
                [ -z "$(timeout -k 2 10 squeue -h -t PENDING,RUNNING,SUSPENDED,COMPLETING -o %i 2>/dev/null)" ] && break
                sleep 0.5
            done
        fi
    fi
    down_daemons
    unlink_sysconf
    say "cluster in $DIR stopped"
}

case $CMD in
    up) up ;;
    down) down ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) usage ;;
esac
