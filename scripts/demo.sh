#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make demo: a real Open MPI job (and then a real MPICH job) on a local 3-node
# rig, with the kernel observer's live table of every rank-to-rank connection.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=$repo/bin
rig=$repo/kernel-tests/rig
iters=${DEMO_ITERS:-60}
size=${DEMO_SIZE:-4M}

[ "$(id -u)" -eq 0 ] || { echo "demo: needs root (network namespaces, cgroups, BPF); run: sudo make demo" >&2; exit 1; }

cgroot=$(awk '$(NF-2) == "cgroup2" && $4 == "/" { print $5; exit }' /proc/self/mountinfo)
[ -n "$cgroot" ] || { echo "demo: cgroup v2 is not mounted; mount it: mount -t cgroup2 none /sys/fs/cgroup" >&2; exit 1; }
cg=$cgroot/mpipause-demo
obs=
job=

cleanup() {
	# A second Ctrl-C must not cut the cleaning short and leave a rig behind.
	trap '' INT TERM
	[ -z "$obs" ] || kill -INT "$obs" 2>/dev/null || true
	if [ -d "$cg" ]; then
		# Anything left in the job cgroup is a rank or launcher of an
		# interrupted job, on any node: kill them all before waiting.
		for p in $(cat "$cg/cgroup.procs" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
	fi
	[ -z "$job" ] || kill -9 "$job" 2>/dev/null || true
	wait 2>/dev/null || true
	for _ in $(seq 100); do # SIGKILL is asynchronous: let the processes go
		[ -n "$(cat "$cg/cgroup.procs" 2>/dev/null)" ] || break
		sleep 0.05
	done
	[ ! -d "$cg" ] || rmdir "$cg" 2>/dev/null || echo "demo: could not remove $cg" >&2
	"$rig" down >/dev/null || echo "demo: 'kernel-tests/rig down' failed; run it again" >&2
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== bringing up a 3-node rig (network namespaces node0..node2 on a bridge)"
"$rig" up 3

run_job() { # LIBRARY LAUNCH-COMMAND...
	local lib=$1
	shift
	echo
	echo "== $lib: 6 ranks on node0..node2, $iters rounds of an irregular all-to-all of up to $size messages"
	mkdir -p "$cg"
	# Start the observer before the job, so that the BPF counters see every
	# byte of every connection from the moment it is established.
	"$bin/mpipause" observe --cgroup "$cg" --watch 1s &
	obs=$!
	# The launcher enters the job cgroup before it starts; every rank on every
	# node descends from it through the rig's remote agent and inherits it.
	sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cg" \
		"$rig" exec node0 -- "$@" >"/tmp/mpipause-demo-$lib.out" 2>&1 &
	job=$!
	local rc=0
	wait "$job" || rc=$?
	job=
	kill -INT "$obs" 2>/dev/null || true
	wait "$obs" 2>/dev/null || true
	obs=
	rmdir "$cg" 2>/dev/null || true
	if [ "$rc" -ne 0 ]; then
		echo "demo: the $lib job failed (exit $rc); its output:" >&2
		cat "/tmp/mpipause-demo-$lib.out" >&2
		exit 1
	fi
	local want got
	want=$("$bin/apps/xchg.$lib" -m a2a -n "$iters" -s "$size" -x 6 | grep -o 'checksum=[0-9a-f]*')
	got=$(grep -o 'checksum=[0-9a-f]*' "/tmp/mpipause-demo-$lib.out" | tail -1)
	if [ "$got" != "$want" ]; then
		echo "demo: the $lib job printed '$got', the serial computation '$want'" >&2
		exit 1
	fi
	echo "== $lib job finished: $got, the same as the serial computation"
}

run_job openmpi mpirun.openmpi -H node0:2,node1:2,node2:2 -np 6 "$bin/apps/xchg.openmpi" -m a2a -n "$iters" -s "$size"
run_job mpich mpiexec.mpich -hosts node0,node1,node2 -n 6 "$bin/apps/xchg.mpich" -m a2a -n "$iters" -s "$size"
echo
echo "== demo done; the rig is taken down"
