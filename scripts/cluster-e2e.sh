#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The cluster e2e: on a cluster of nodes node0..node{N-1}, each with an mpid,
# a real Open MPI job and a real MPICH job launched with `mpipause run` are
# paused and resumed a few times; at every pause each node's connections of
# the job are read independently from the kernel (`mpipause observe`) and
# must all be empty, and each node's job cgroup frozen; the job's result line
# must be that of the serial computation (what an unpaused run prints).
#
# The nodes are reached through a node-exec command given after `--`, in
# which {} stands for the node's name; it must run its remaining arguments as
# a command (argv, no shell) on that node. The same script runs against
#   the netns rig:    scripts/cluster-e2e.sh -- kernel-tests/rig exec {} --
#   the Vagrant VMs:  vagrant/e2e.sh (on node0: ... --sudo -- /vagrant/vagrant/node-exec -M {})
# Needs bash, jq and timeout where it runs; mpipause, mpid (running) and the
# MPI libraries on every node; the test apps (make build: bin/apps) on node0.
set -uo pipefail

usage() {
	cat <<'EOF'
usage: cluster-e2e.sh [OPTIONS] -- NODE-EXEC...   ({} in NODE-EXEC stands for the node name)

options:
  --nodes N           nodes node0..node{N-1} (default 3)
  --ranks-per-node N  ranks on each node (default 2)
  --bin DIR           the build directory as the nodes see it: DIR/apps/xchg.openmpi,
                      DIR/apps/xchg.mpich, DIR/libucxfinalize.so (default: this repository's bin)
  --libs LIST         MPI libraries, comma-separated: openmpi, mpich (default openmpi,mpich)
  --pauses N          pauses of each job (default 3)
  --size BYTES        xchg message size (default 256K)
  --sudo              run the privileged node commands (observe, cgroup files) with sudo -n
  --step-timeout S    seconds each step may take (default 60)

Prints one line per step (PASS or FAIL), a line per node of what may differ
between nodes (INFO: kernel, interfaces and drivers, clock), then "N passed,
N failed"; exits 1 if a step failed, 2 on bad usage.
EOF
}

die_usage() {
	echo "cluster-e2e: $1; see --help" >&2
	exit 2
}

repo=$(cd "$(dirname "$0")/.." && pwd)
nodes=3 per_node=2 bin=$repo/bin libs=openmpi,mpich pauses=3 size=256K
sudo=() step_timeout=60
while [ $# -gt 0 ]; do
	case $1 in
	--nodes | --ranks-per-node | --bin | --libs | --pauses | --size | --step-timeout)
		[ $# -ge 2 ] || die_usage "$1 needs a value"
		case $1 in
		--nodes) nodes=$2 ;;
		--ranks-per-node) per_node=$2 ;;
		--bin) bin=$2 ;;
		--libs) libs=$2 ;;
		--pauses) pauses=$2 ;;
		--size) size=$2 ;;
		--step-timeout) step_timeout=$2 ;;
		esac
		shift 2
		;;
	--sudo) sudo=(sudo -n) && shift ;;
	-h | --help) usage && exit 0 ;;
	--) shift && break ;;
	*) die_usage "unknown option '$1'" ;;
	esac
done
[ $# -gt 0 ] || die_usage "no node-exec command after --"
exec_tmpl=("$@")
for v in nodes per_node pauses step_timeout; do
	[[ ${!v} =~ ^[1-9][0-9]*$ ]] || die_usage "--${v//_/-} wants a positive number, got '${!v}'"
done
[ "$nodes" -ge 2 ] || die_usage "--nodes wants 2 or more, got $nodes"
IFS=, read -r -a lib_list <<<"$libs"
for l in "${lib_list[@]}"; do
	[ "$l" = openmpi ] || [ "$l" = mpich ] || die_usage "--libs: unknown library '$l' (openmpi, mpich)"
done
case " ${exec_tmpl[*]} " in *"{}"*) ;; *) die_usage "the node-exec command has no {} for the node name" ;; esac
for t in jq timeout; do
	command -v "$t" >/dev/null || { echo "cluster-e2e: $t is not installed here (Debian: apt-get install ${t/timeout/coreutils})" >&2 && exit 1; }
done

passed=0 failed=0
pass() {
	echo "PASS $*"
	passed=$((passed + 1))
}
fail() {
	echo "FAIL $*"
	failed=$((failed + 1))
}

# on NODE CMD...: CMD on NODE through the node-exec command, cut at the step timeout.
on() {
	local node=$1 w argv=()
	shift
	for w in "${exec_tmpl[@]}"; do argv+=("${w//\{\}/$node}"); done
	timeout -k 5 "$step_timeout" "${argv[@]}" "$@"
}
# onroot NODE CMD...: the same, as root (--sudo).
onroot() {
	local node=$1
	shift
	on "$node" "${sudo[@]}" "$@"
}

node_list=() hosts=
for ((k = 0; k < nodes; k++)); do
	node_list+=("node$k")
	hosts+=${hosts:+,}node$k:$per_node
done
ranks=$((nodes * per_node))
# The job's cgroups on each node, as its mpid reports them (mpipause status
# --json: the .cgroups of the answering .node; the coordinator lists every
# node's): where the node's ranks are watched and frozen, inside
# the cgroups their launcher gave them. made_cgs are the ones mpid made
# (placed inner or created), which must go with the job; the others are
# the resource manager's.
declare -A job_cgs made_cgs
# cgroups_of NODE ID: fills job_cgs[NODE] and made_cgs[NODE].
cgroups_of() {
	local j
	j=$(on "$1" mpipause status --json "$2") || return 1
	j=$(echo "$j" | jq -c '.node as $n | [.cgroups[]? | select(.node == $n)]')
	job_cgs[$1]=$(echo "$j" | jq -r '[.[].dir] | join(" ")')
	made_cgs[$1]=$(echo "$j" | jq -r '[.[] | select(.placed == "inner" or .placed == "created") | .dir] | join(" ")')
	placed_line+=" $1:$(echo "$j" | jq -r '[.[].placed] | unique | join("+")')"
	[ -n "${job_cgs[$1]}" ]
}

# observe NODE ID: the kernel's view of the job's connections on NODE (JSON).
# By the absolute path found by the preflight: sudo's secure_path may not
# have the directory of mpipause.
declare -A mpipause_at
observe() {
	local args=() cg
	for cg in ${job_cgs[$1]}; do args+=(--cgroup "$cg"); done
	onroot "$1" "${mpipause_at[$1]}" observe "${args[@]}" --json
}
# sent NODE ID: bytes the job's connections on NODE have sent and received
# (BPF counters); on failure, what went wrong (and status 1). A degraded
# observer (a kernel without iter/tcp: docs/guarantees.md, "On older
# kernels") counts nothing of a connection made before it attached, which
# is every connection of the job for a new `mpipause observe`: then the
# kernel's own tcp_info counters of the job's cgroups, as ss reads them
# (acknowledged and received bytes: they grow while the job exchanges).
sent() {
	local j cg n=0 m
	if ! j=$(observe "$1" "$2" 2>&1); then
		echo "$j"
		return 1
	fi
	if ! echo "$j" | jq -e 'any(.connections[]; .counted | not)' >/dev/null; then
		echo "$j" | jq '[.connections[] | .bytes_sent + .bytes_received] | add // 0'
		return
	fi
	for cg in ${job_cgs[$1]}; do
		m=$(onroot "$1" ss -tinH cgroup "${cg#/sys/fs/cgroup}" | { grep -oE 'bytes_(acked|received):[0-9]+' || true; } |
			awk -F: '{ s += $2 } END { print s + 0 }') || return 1
		n=$((n + m))
	done
	echo "$n"
}

# until_ok CMD...: run CMD every 0.2 s until it succeeds, at most the
# step timeout; a CMD that returns 2 ends the wait at once.
until_ok() {
	local t0=$SECONDS rc
	while true; do
		"$@" && return 0
		rc=$?
		# 2: what it waits for can no longer happen (the job ended).
		if [ "$rc" -eq 2 ] || [ $((SECONDS - t0)) -ge "$step_timeout" ]; then
			return 1
		fi
		sleep 0.2
	done
}

# describe NODE: what may differ between nodes and between rigs (the netns
# rig's nodes share one kernel and clock; VMs have their own, and real
# NICs), on one line: the kernel, each interface's address and driver, and
# the node's clock against this script's.
describe() {
	local out lines clk
	# shellcheck disable=SC2016 # sh's own $ words, expanded on the node
	out=$(on "$1" sh -c 'uname -r
		ip -o -4 addr show scope global | while read -r _ i _ a _; do
			d=$(readlink "/sys/class/net/$i/device/driver" 2>/dev/null) && d=${d##*/} ||
				d=$(ip -d -o link show dev "$i" | grep -owE "veth|bridge|macvlan|ipvlan|vxlan|dummy" | head -1)
			printf "%s %s %s, " "$i" "${a%/*}" "${d:-virtual}"
		done; echo' 2>&1)
	mapfile -t lines <<<"$out"
	if [ ${#lines[@]} -ne 2 ]; then
		echo "INFO $1: (not described: $out)"
		return
	fi
	clk=$(clock_of "$1") || clk="not read"
	echo "INFO $1: kernel ${lines[0]}; ${lines[1]%, }; clock $clk from where this runs"
}

# clock_of NODE: NODE's clock against this script's, as "+X ms (within Y
# ms)". One session to the node answers each line it reads with its time:
# a reading is bracketed by the round trip on an open session, not by the
# node-exec command's own start (seconds, for ssh to a VM under software
# emulation); the least of a few round trips bounds it best.
clock_of() {
	local best='' t0 t1 r i
	coproc CLK { on "$1" sh -c 'while read -r _; do date +%s%6N; done' 2>/dev/null; }
	# The first answer waits for the session itself: not a reading.
	for ((i = 0; i < 6; i++)); do
		t0=${EPOCHREALTIME/./}
		# A node-exec that ended unsets CLK.
		{ [ -n "${CLK[1]:-}" ] && { echo >&"${CLK[1]}"; } 2>/dev/null && IFS= read -r -t "$step_timeout" r <&"${CLK[0]}"; } || break
		t1=${EPOCHREALTIME/./}
		[[ $r =~ ^[0-9]+$ ]] || break
		if [ "$i" -gt 0 ] && { [ -z "$best" ] || [ $((t1 - t0)) -lt "${best% *}" ]; }; then
			best="$((t1 - t0)) $((r - (t0 + t1) / 2))"
		fi
	done
	[ -z "${CLK[1]:-}" ] || eval "exec ${CLK[1]}>&-"
	[ -z "${CLK_PID:-}" ] || wait "$CLK_PID" 2>/dev/null
	[ -n "$best" ] || return 1
	awk -v rtt="${best% *}" -v d="${best#* }" 'BEGIN { printf "%+.1f ms (within %.1f ms)", d / 1e3, rtt / 2e3 }'
}

# Preflight: every node answers, has an mpid, and the cgroup v2 mount.
for n in "${node_list[@]}"; do
	if ! out=$(on "$n" sh -c 'command -v mpipause && mpipause list >/dev/null' 2>&1); then
		fail "$n: mpipause list (mpipause and an mpid on the node): $out"
		continue
	fi
	mpipause_at[$n]=$(echo "$out" | head -1)
	# shellcheck disable=SC2016 # awk's $ fields, expanded on the node
	root=$(on "$n" awk '$(NF-2) == "cgroup2" && $4 == "/" { print $5; exit }' /proc/self/mountinfo)
	if [ -z "$root" ]; then
		fail "$n: no cgroup v2 mount"
		continue
	fi
	pass "$n: mpid answers, cgroup v2 at $root"
	describe "$n"
done
if [ "$failed" -gt 0 ]; then
	echo "$passed passed, $failed failed"
	exit 1
fi

job='' job_pid='' out_file=''
cleanup_job() {
	[ -n "$job" ] || return 0
	on node0 mpipause resume "$job" >/dev/null 2>&1
	local n
	local cg
	for n in "${node_list[@]}"; do
		for cg in ${job_cgs[$n]:-}; do
			# shellcheck disable=SC2016 # sh's $1, expanded on the node
			onroot "$n" sh -c 'test ! -e "$1" || echo 1 >"$1"' sh "$cg/cgroup.kill" >/dev/null 2>&1
		done
	done
	[ -z "$job_pid" ] || { kill "$job_pid" 2>/dev/null; wait "$job_pid" 2>/dev/null; }
	job='' job_pid=''
}
trap 'cleanup_job; rm -f "$out_file"' EXIT
trap 'exit 130' INT TERM

# run_lib LIB: the whole story for one library; returns at its first failure.
run_lib() {
	local lib=$1 app=$bin/apps/xchg.$1 pre=() launch
	case $lib in
	openmpi) launch=(mpirun.openmpi -H "$hosts" -np "$ranks") ;;
	mpich)
		# MPICH 4.0 ch4:ucx can hang in MPI_Finalize over TCP (docs/rig.md);
		# libucxfinalize.so is the fix: mpipause run puts the shim after it
		# in the ranks' LD_PRELOAD.
		pre=(env "LD_PRELOAD=$bin/libucxfinalize.so")
		launch=(mpiexec.mpich -hosts "$hosts" -n "$ranks")
		;;
	esac
	local id stop n cg
	id=e2e-$lib-$$
	if ! on node0 test -x "$app" || { [ "$lib" = mpich ] && ! on node0 test -f "$bin/libucxfinalize.so"; }; then
		fail "$lib: node0 has no $app or $bin/libucxfinalize.so (make build; --bin)"
		return
	fi
	if ! stop=$(on node0 mktemp -d /tmp/cluster-e2e.XXXXXX); then
		fail "$lib: cannot make a stop directory on node0"
		return
	fi
	out_file=$(mktemp)
	# The job runs until $stop/stop exists; the caps on iterations and time
	# only end a job the script lost.
	timeout -k 10 $((step_timeout * (pauses + 4))) "${exec_tmpl[@]//\{\}/node0}" \
		"${pre[@]}" mpipause run --jobid "$id" -- "${launch[@]}" "$app" -m a2a -s "$size" -n 100000000 -E "$stop" >"$out_file" 2>&1 &
	job=$id job_pid=$!
	registered() {
		kill -0 "$job_pid" 2>/dev/null || return 2
		on node0 mpipause status --json "$id" 2>/dev/null |
			jq -e --argjson r "$ranks" --argjson n "$nodes" '.ranks == $r and (.nodes | length) == $n' >/dev/null
	}
	if ! until_ok registered; then
		fail "$lib: launch ($id, $ranks ranks on ${node_list[*]}): $(tail -5 "$out_file" | tr '\n' ' ')"
		return
	fi
	pass "$lib: launch: job $id, $ranks ranks registered on ${node_list[*]}"
	placed_line=
	for n in "${node_list[@]}"; do
		if ! until_ok cgroups_of "$n" "$id"; then
			fail "$lib: $n: mpid names no cgroup of the job (mpipause status --json $id: .cgroups)"
			return
		fi
	done
	pass "$lib: the job's cgroups on every node:$placed_line (e.g. node0: ${job_cgs[node0]})"
	local base
	exchanging() { base=$(sent node0 "$id") && [ "$base" -gt 0 ]; }
	if ! until_ok exchanging; then
		fail "$lib: the job exchanges data: no bytes on node0's connections ($base)"
		return
	fi
	pass "$lib: exchanging ($base bytes so far on node0)"

	local i j res
	for ((i = 1; i <= pauses; i++)); do
		if ! j=$(on node0 mpipause "$id" --json 2>&1); then
			fail "$lib: pause $i: $(echo "$j" | jq -r '.error.message // .failure.reason // .' 2>/dev/null | head -3)"
			return
		fi
		if ! res=$(echo "$j" | jq -er --argjson n "$nodes" \
			'select(.state == "paused" and .inflight_bytes == 0 and .connections > 0 and (.nodes | length) == $n)
			| "\(.connections) connections checked, \(.drained_bytes) bytes drained, \(.total_ms) ms"'); then
			fail "$lib: pause $i: mpipause reports $(echo "$j" | jq -c '{state, inflight_bytes, connections, nodes}')"
			return
		fi
		pass "$lib: pause $i committed: $res"
		for n in "${node_list[@]}"; do
			if ! j=$(observe "$n" "$id" 2>&1); then
				fail "$lib: pause $i: $n: mpipause observe: $j"
				return
			fi
			# Every connection empty, and there are connections: a wrong
			# cgroup must not pass as an empty one.
			if ! res=$(echo "$j" | jq -er 'select(.summary.connections > 0
				and all(.connections[]; .send_queue_bytes == 0 and .unread_bytes == 0))
				| "\(.summary.connections) connections, all send queues and unread counts 0 (\(.observer))"'); then
				fail "$lib: pause $i: $n: the kernel sees $(echo "$j" | jq -c '[.connections[] | select(.send_queue_bytes > 0 or .unread_bytes > 0) | {local, remote, send_queue_bytes, unread_bytes}] | if length == 0 then "no connection" else . end')"
				return
			fi
			for cg in ${job_cgs[$n]}; do
				if ! on "$n" grep -qx 'frozen 1' "$cg/cgroup.events"; then
					fail "$lib: pause $i: $n: the job's cgroup $cg is not frozen"
					return
				fi
			done
			pass "$lib: pause $i: $n: $res; cgroups frozen"
		done
		if ! base=$(sent node0 "$id"); then
			fail "$lib: pause $i: node0: mpipause observe: $base"
			return
		fi
		if ! j=$(on node0 mpipause resume --json "$id" 2>&1) || ! echo "$j" | jq -e '.state == "running"' >/dev/null; then
			fail "$lib: resume $i: $j"
			return
		fi
		moved() {
			local now
			now=$(sent node0 "$id") && [ "$now" -gt "$base" ]
		}
		if ! until_ok moved; then
			fail "$lib: resume $i: the job does not exchange again"
			return
		fi
		pass "$lib: resume $i: running and exchanging again"
	done

	if ! on node0 touch "$stop/stop"; then
		fail "$lib: stop: cannot create $stop/stop on node0"
		return
	fi
	local t0=$SECONDS rc=0
	while kill -0 "$job_pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "$step_timeout" ]; do sleep 0.2; done
	if kill -0 "$job_pid" 2>/dev/null; then
		fail "$lib: end: the job did not end within ${step_timeout}s of being told to stop: $(tail -3 "$out_file" | tr '\n' ' ')"
		return
	fi
	wait "$job_pid" || rc=$?
	job_pid=
	on node0 rm -rf "$stop"
	local got iters want
	got=$(grep -m1 '^xchg mode=' "$out_file")
	if [ "$rc" -ne 0 ] || [ -z "$got" ]; then
		fail "$lib: end: exit status $rc, result '$got': $(tail -5 "$out_file" | tr '\n' ' ')"
		return
	fi
	pass "$lib: end: exit 0, $got"
	iters=$(echo "$got" | sed -n 's/.* iters=\([0-9]*\) .*/\1/p')
	want=$(on node0 "$app" -m a2a -s "$size" -n "$iters" -x "$ranks")
	if [ "$got" != "$want" ]; then
		fail "$lib: result: the job printed '$got', an unpaused (serial) run '$want'"
		return
	fi
	pass "$lib: result: the same as an unpaused run ($iters iterations)"
	gone() {
		local n
		local cg
		for n in "${node_list[@]}"; do
			for cg in ${made_cgs[$n]}; do
				on "$n" test ! -e "$cg" || return 1
			done
		done
	}
	if ! until_ok gone; then
		fail "$lib: after the end: the job's cgroups are still there"
		return
	fi
	job=
	pass "$lib: after the end: no cgroup mpid made for the job left on any node"
}

for l in "${lib_list[@]}"; do
	run_lib "$l"
	cleanup_job
	rm -f "$out_file"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
