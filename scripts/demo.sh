#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make demo: the whole story on a local 3-node rig, for Open MPI and then MPICH:
# a real MPI job launched with `mpipause run`, paused in the middle of a heavy
# all-to-all (the kernel-verified report), a few seconds paused with the ranks
# using no CPU and every connection empty, resumed, and the job's result
# compared with the serial computation (what an unpaused run prints).
set -Eeuo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=$repo/bin
rig=$repo/kernel-tests/rig
export MPIPAUSE_RIG=demo
iters=${DEMO_ITERS:-300}
size=${DEMO_SIZE:-1M}
paused_for=${DEMO_PAUSED_SECONDS:-3}

[ "$(id -u)" -eq 0 ] || { echo "demo: needs root (network namespaces, cgroups, BPF); run: sudo make demo" >&2; exit 1; }

cgroot=$(awk '$(NF-2) == "cgroup2" && $4 == "/" { print $5; exit }' /proc/self/mountinfo)
[ -n "$cgroot" ] || { echo "demo: cgroup v2 is not mounted; mount it: mount -t cgroup2 none /sys/fs/cgroup" >&2; exit 1; }
job=

cleanup() {
	# A second Ctrl-C must not cut the cleaning short and leave a rig behind.
	trap '' INT TERM
	[ -z "$job" ] || kill "$job" 2>/dev/null || true
	# down kills what runs in the nodes (ranks, mpids) and removes the cgroups.
	"$rig" down >/dev/null || echo "demo: 'kernel-tests/rig down' failed; run MPIPAUSE_RIG=demo kernel-tests/rig down" >&2
	wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Any command that fails ends the demo: say which, not only the exit code
# (a function's own `return 1` has said why already).
trap '[[ $BASH_COMMAND == return* ]] || echo "demo: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

node0() { "$rig" exec node0 -- "$@"; }

# usage_usec of the job's cgroups on every node, summed: where they are is
# mpid's to say (the coordinator lists every node's), not a name to guess.
cpu_usec() {
	local dirs d s=0 u
	dirs=$(node0 mpipause status --json "$1" | jq -r '.cgroups[]?.dir') ||
		{ echo "demo: mpipause status --json $1 failed" >&2; return 1; }
	[ -n "$dirs" ] || { echo "demo: mpipause status names no cgroup of job $1" >&2; return 1; }
	for d in $dirs; do
		u=$(awk '$1 == "usage_usec" { print $2 }' "$d/cpu.stat") ||
			{ echo "demo: cannot read $d/cpu.stat" >&2; return 1; }
		s=$((s + u))
	done
	echo "$s"
}

echo "== bringing up a 3-node rig (network namespaces node0..node2 on a bridge, an mpid in each)"
"$rig" up 3

run_job() { # LIBRARY LAUNCH-COMMAND...
	local lib=$1 id=demo-$1
	shift
	local out=/tmp/mpipause-demo-$lib.out
	echo
	echo "== $lib: 6 ranks on node0..node2, $iters rounds of an irregular all-to-all of messages up to $size"
	echo "\$ mpipause run --jobid $id -- $*"
	node0 mpipause run --jobid "$id" -- "$@" >"$out" 2>&1 &
	job=$!
	# Wait for the job to be in full swing: every rank registered and the
	# exchange running (the pause refuses a job with ranks still starting).
	local t0=$SECONDS
	until node0 mpipause status "$id" 2>/dev/null | grep -q "here: 0,1"; do
		kill -0 "$job" 2>/dev/null || { echo "demo: the $lib job ended early:" >&2; cat "$out" >&2; exit 1; }
		[ $((SECONDS - t0)) -lt 60 ] || { echo "demo: the $lib job did not register with mpid in 60 s:" >&2; cat "$out" >&2; exit 1; }
		sleep 0.2
	done
	sleep 1 # let the exchange run: the pause lands in the middle of it

	echo
	echo "\$ mpipause $id"
	node0 mpipause "$id"
	local c0 c1
	c0=$(cpu_usec "$id")
	echo
	echo "== paused: every connection of the job, read from the kernel on every node:"
	"$bin/mpipause" observe --cgroup "mpipause-rig/demo" | tail -n 4
	sleep "$paused_for"
	c1=$(cpu_usec "$id")
	echo "== the ranks used $(((c1 - c0) / 1000)) ms of CPU in the $paused_for s they were paused"

	echo
	echo "\$ mpipause resume $id"
	node0 mpipause resume "$id"

	local rc=0
	wait "$job" || rc=$?
	job=
	if [ "$rc" -ne 0 ]; then
		echo "demo: the $lib job failed (exit $rc); its output:" >&2
		cat "$out" >&2
		exit 1
	fi
	local want got
	want=$("$bin/apps/xchg.$lib" -m a2a -n "$iters" -s "$size" -x 6 | grep -o 'checksum=[0-9a-f]*')
	got=$(grep -o 'checksum=[0-9a-f]*' "$out" | tail -1)
	if [ "$got" != "$want" ]; then
		echo "demo: the $lib job printed '$got', the serial computation '$want'" >&2
		exit 1
	fi
	echo
	echo "== $lib job finished: $got, the same as the serial computation (an unpaused run)"
}

run_job openmpi mpirun.openmpi -H node0:2,node1:2,node2:2 -np 6 "$bin/apps/xchg.openmpi" -m a2a -n "$iters" -s "$size"
run_job mpich mpiexec.mpich -hosts node0:2,node1:2,node2:2 -n 6 "$bin/apps/xchg.mpich" -m a2a -n "$iters" -s "$size"
echo
echo "== demo done; the rig is taken down"
