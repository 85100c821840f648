#!/usr/bin/env bash
# Two hosts over a real network (issue 58): two network namespaces joined by a veth pair, each with
# its own host name (a UTS namespace), each a host to Open MPI; mpirun starts in the first and
# reaches the second through an rsh agent that enters it, and the ranks talk over TCP only
# (--mca btl tcp,self), two on each host. GPTQ on the bundled OLMoE with 4 ranks writes the single
# process's bytes. The ranks of the second host killed mid-layer (SIGKILL): the job ends within
# --mpi-timeout naming a lost rank or its host (Open MPI ends the survivors itself there), no
# OUT_DIR, and --resume with 2 ranks (one a host) gives the same bytes. The link cut mid-layer: both ranks of the first host stop within --mpi-timeout, each
# naming ranks 2 and 3 as the ones that do not answer, no OUT_DIR, and --resume as a single
# process gives the same bytes. Everything it starts is killed and both namespaces are deleted on
# exit. Skips (77) without root, network namespaces, unshare, mpirun or an MPI build.
. "$(dirname "$0")/common.sh"
native_only "network namespaces of the host"

command -v mpirun >/dev/null || { echo "SKIP: mpirun not found (apt install openmpi-bin)"; exit 77; }
"$cli" --version | grep -q "^MPI: Open MPI" || { echo "SKIP: this moeq was built without MPI"; exit 77; }
command -v ip >/dev/null && command -v unshare >/dev/null || { echo "SKIP: no ip or unshare"; exit 77; }
[ "$(id -u)" -eq 0 ] || { echo "SKIP: network namespaces need root"; exit 77; }
a=mq$$a b=mq$$b
# every process of the two hosts is this test's: killed on exit, then the namespaces go
cleanup() {
    local p
    for p in $(ip netns pids "$a" 2>/dev/null) $(ip netns pids "$b" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    sleep 0.2
    ip netns del "$a" 2>/dev/null
    ip netns del "$b" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
if ! ip netns add "$a" 2>/dev/null || ! ip netns add "$b" 2>/dev/null; then
    echo "SKIP: cannot make network namespaces here (ip netns add failed)"
    exit 77
fi
ip link add "${a}v" type veth peer name "${b}v" && ip link set "${a}v" netns "$a" && ip link set "${b}v" netns "$b" &&
    ip -n "$a" addr add 10.88.0.1/24 dev "${a}v" && ip -n "$b" addr add 10.88.0.2/24 dev "${b}v" &&
    ip -n "$a" link set "${a}v" up && ip -n "$b" link set "${b}v" up && ip -n "$a" link set lo up &&
    ip -n "$b" link set lo up || { echo "SKIP: cannot join the namespaces with a veth pair"; exit 77; }

# the rsh agent: "HOST COMMAND..." runs COMMAND on that host (in its namespaces)
cat > "$tmp/agent" <<EOF
#!/bin/sh
host=\$1; shift
case \$host in 10.88.0.1) ns=$a ;; 10.88.0.2) ns=$b ;; *) echo "agent: unknown host \$host" >&2; exit 1 ;; esac
exec ip netns exec "\$ns" unshare --uts sh -c "hostname \$ns && \$*"
EOF
chmod +x "$tmp/agent"
printf '10.88.0.1 slots=2\n10.88.0.2 slots=2\n' > "$tmp/hosts2"
printf '10.88.0.1 slots=1\n10.88.0.2 slots=1\n' > "$tmp/hosts1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# two_hosts HOSTFILE NP ARGS...: mpirun on the first host, ranks over TCP between the hosts
# ($mpi_extra: more mpirun options)
mpi_extra=()
two_hosts() {
    local hf=$1 np=$2
    shift 2
    timeout 300 ip netns exec "$a" unshare --uts sh -c 'hostname "$0" && exec mpirun "$@"' "$a" \
        --hostfile "$hf" -np "$np" --mca plm_rsh_agent "$tmp/agent" --mca btl tcp,self \
        --mca btl_tcp_if_include 10.88.0.0/24 --mca oob_tcp_if_include 10.88.0.0/24 "${mpi_extra[@]}" "$cli" "$@"
}
# ranks HOST: the PIDs of moeq processes on a host
ranks() {
    local p exe
    exe=$(readlink -f "$cli")
    for p in $(ip netns pids "$1"); do [ "$(readlink /proc/"$p"/exe 2>/dev/null)" = "$exe" ] && echo "$p"; done
}
# mid_layer OUT: waits until the job's work manifest records layer 0 (layer 1 runs)
mid_layer() {
    local i
    for i in $(seq 1 600); do
        grep -q '"layer":[[:space:]]*0' "$1.moeq-work/manifest.json" 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}
# gone_within HOST SECONDS: waits until no rank runs on HOST; says how long that took
gone_within() {
    local t0=$SECONDS
    while [ -n "$(ranks "$1")" ]; do
        [ $((SECONDS - t0)) -gt "$2" ] && { echo "$((SECONDS - t0))"; return 1; }
        sleep 0.2
    done
    echo "$((SECONDS - t0))"
}
# end_job PID: gives mpirun (PID) 15 s to end and report, then kills what is left of the job on both
# hosts (mpirun may wait on a lost host for ever)
end_job() {
    local p i
    for i in $(seq 1 75); do kill -0 "$1" 2>/dev/null || break; sleep 0.2; done
    for p in $(ip netns pids "$a") $(ip netns pids "$b"); do kill -9 "$p" 2>/dev/null; done
    wait 2>/dev/null
}

calib=$repo/data/demo-calib.txt
timeout_s=10
args=(--scheme nvfp4a16 --method gptq --calib "$calib" --nsamples 4 --seqlen 32 --threads 1
      --mpi-timeout $timeout_s --quiet)
"$cli" quantize "$model" --out "$tmp/base" "${args[@]}" || fail "the single-process run exited $?"
two_hosts "$tmp/hosts2" 4 quantize "$model" --out "$tmp/np4" "${args[@]}" > "$tmp/np4.log" 2>&1 ||
    fail "4 ranks on 2 hosts exited $?: $(tail -5 "$tmp/np4.log")"
same_checkpoint "$tmp/base" "$tmp/np4" "4 ranks on 2 hosts" "the single-process run"

# the second host's ranks killed mid-layer
two_hosts "$tmp/hosts2" 4 quantize "$model" --out "$tmp/k" "${args[@]}" > "$tmp/kill.log" 2>&1 &
job=$!
if mid_layer "$tmp/k"; then
    kill -9 $(ranks "$b")
    took=$(gone_within "$a" $((timeout_s + 20))) || fail "killed host: the first host's ranks still run after $took s"
    echo "killed host: the first host's ranks gone $took s after the kill (--mpi-timeout $timeout_s)"
    end_job $job
    # Open MPI's TCP transport ends a rank whose peer disconnects, before moeq's own wait can: the
    # job names the lost rank (mpirun: "process rank 2 ... exited on signal 9") or its host (the
    # transport: "Peer host: 10.88.0.2"), whichever of them reports first
    grep -qE "process rank (2|3) with PID|Peer host: +10\.88\.0\.2" "$tmp/kill.log" ||
        fail "killed host: neither a lost rank nor its host named: $(cat "$tmp/kill.log")"
else
    fail "killed host: the job never finished layer 0: $(tail -5 "$tmp/kill.log")"
fi
end_job $job
[ -e "$tmp/k" ] && fail "killed host: OUT_DIR exists"
[ -f "$tmp/k.moeq-work/manifest.json" ] || fail "killed host: no work manifest"
two_hosts "$tmp/hosts1" 2 quantize "$model" --out "$tmp/k" "${args[@]}" --resume > "$tmp/kres.log" 2>&1 ||
    fail "killed host: --resume with 2 ranks exited $?: $(tail -5 "$tmp/kres.log")"
same_checkpoint "$tmp/base" "$tmp/k" "killed host, resumed with 2 ranks" "the single-process run"

# the link cut mid-layer: the first host's ranks stop on their own, naming the second host's (mpirun
# told not to end the job at the first rank that fails, so that each says it: by default it ends
# the others as soon as one stops)
mpi_extra=(--mca orte_abort_on_non_zero_status false --mca orte_allowed_exit_without_sync true)
two_hosts "$tmp/hosts2" 4 quantize "$model" --out "$tmp/c" "${args[@]}" > "$tmp/cut.log" 2>&1 &
job=$!
mpi_extra=()
if mid_layer "$tmp/c"; then
    ip -n "$b" link set "${b}v" down
    # within the timeout of the step they wait at, which may begin a layer's computation later
    took=$(gone_within "$a" $((timeout_s + 20))) || fail "cut link: the first host's ranks still run after $took s"
    echo "cut link: the first host's ranks gone $took s after the cut (--mpi-timeout $timeout_s)"
    end_job $job
    for r in 0 1; do
        grep -q "error: rank $r: the other ranks did not reach '.*' within $timeout_s s; ranks 2 and 3 do not answer" \
            "$tmp/cut.log" || fail "cut link: rank $r did not name ranks 2 and 3: $(cat "$tmp/cut.log")"
    done
else
    fail "cut link: the job never finished layer 0: $(tail -5 "$tmp/cut.log")"
fi
end_job $job
ip -n "$b" link set "${b}v" up
[ -e "$tmp/c" ] && fail "cut link: OUT_DIR exists"
[ -f "$tmp/c.moeq-work/manifest.json" ] || fail "cut link: no work manifest"
"$cli" quantize "$model" --out "$tmp/c" "${args[@]}" --resume || fail "cut link: --resume as one process exited $?"
same_checkpoint "$tmp/base" "$tmp/c" "cut link, resumed as one process" "the single-process run"

exit $((fails > 0))
