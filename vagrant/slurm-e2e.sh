#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# slurm-e2e.sh: mpipause under Slurm's own cgroup confinement, on the
# Vagrant VMs after vagrant/provision-slurm.sh (proctrack/cgroup,
# task/cgroup,task/affinity, cgroup/v2, ConstrainCores, ConstrainRAMSpace;
# the SPANK plugin on). Runs on node0 as the MPI user (sudo for scontrol
# and the kernel reads); vagrant/boot-check.sh --slurm runs it.
#
# For Open MPI (srun --mpi=pmix) and MPICH (srun --mpi=pmi2), a 3 x 2 job:
# `scontrol suspend` pauses it (mpipause's state paused, every node's
# connections empty in its own kernel), `scontrol resume` resumes it, twice;
# every rank stays inside its Slurm job's cgroup at every step; the result
# is the serial one. The same for the first library's job suspended by
# preemption (PreemptMode=SUSPEND,GANG: a job of partition high takes the
# nodes, ends, and Slurm resumes the job). A suspend whose pause Slurm's
# SIGSTOP overtakes (emulated VMs are slow) must roll back and resume as
# without mpipause; each library must pause cleanly at least once. Then what Slurm does to a step,
# each compared with the same step run with --mpipause=no: scancel, the
# time limit, a task over its memory limit (Slurm's cgroup OOM-kills it),
# sstat's and sacct's CPU counts, and --cpu-bind. One line per check, PASS or FAIL, then "N passed, N failed".
#
# With --only suspend, the scontrol suspends alone: each library's job
# suspended and resumed until one suspend has paused it cleanly (at most
# --pauses), then its end; no preemption and none of what Slurm does to a
# step (make test's VM tier: the rest is make check-vagrant-slurm's).
#
# With --only sbatch, instead: the same 3 x 2 job launched the way most
# users do, by the library's own launcher inside an sbatch script (Open
# MPI's mpirun, MPICH's mpiexec with Hydra's slurm launcher), with what
# docs/slurm.md says a site must set for it (a drop-in giving mpid
# CAP_DAC_OVERRIDE, removed at the end): scontrol suspend of the batch job
# pauses it, every connection empty, and resume gives the unpaused result
# (sbatch_run).
#
#   slurm-e2e.sh [--nodes N] [--pauses N] [--bin DIR] [--libs LIST] [--only suspend|sbatch] [--quiet S]
#
# --quiet S (default 5): after each suspend the driver first looks at the
# pause S seconds later. It runs on node0, whose one emulated core also runs
# two of the job's ranks, and a look (mpipause status and jq) costs about
# half a second of that core: looking every half second took about a third
# of the core from the ranks the drain waits for. What the e2e reports
# is mpid's own time for the pause, which a later look does not change.
# shellcheck disable=SC2317 # the checks are run by until_ok (e2e-lib.sh)
set -uo pipefail

nodes=3 pauses=2 bin=/vagrant/bin libs=openmpi,mpich only='' quiet=5
usage() {
	echo "usage: slurm-e2e.sh [--nodes N] [--pauses N] [--bin DIR] [--libs openmpi,mpich] [--only suspend|sbatch] [--quiet S]" >&2
	exit 2
}
while [ $# -gt 0 ]; do
	case $1 in
	--nodes | --pauses | --bin | --libs | --only | --quiet)
		[ $# -ge 2 ] || usage
		case $1 in
		--quiet) quiet=$2 ;;
		--only) only=$2 ;;
		--nodes) nodes=$2 ;;
		--pauses) pauses=$2 ;;
		--bin) bin=$2 ;;
		--libs) libs=$2 ;;
		esac
		shift 2
		;;
	*) usage ;;
	esac
done
[[ $nodes =~ ^[1-9]$ && $pauses =~ ^[0-9]+$ && $quiet =~ ^[0-9]+$ && $only =~ ^(|suspend|sbatch)$ ]] || usage
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=vagrant/e2e-lib.sh
. "$here/e2e-lib.sh"
ranks=$((nodes * 2))

# on NODE CMD...: CMD on NODE (one kept ssh connection per node).
on() {
	local node=$1
	shift
	timeout -k 5 "$step_timeout" "$here/node-exec" -M "$node" "$@"
}
idle() { [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle$')" -ge "$nodes" ]; }
if ! until_ok idle; then
	fail "slurm: $(sinfo -h -N -o '%N %T' | tr '\n' ' ') (want $nodes nodes idle)"
	summary
	exit
fi
pass "slurm: $nodes nodes idle; $(scontrol show config | awk '$1 ~ /^(ProctrackType|TaskPlugin)$/ { printf "%s=%s ", $1, $3 }')$(grep -h '^CgroupPlugin' /etc/slurm/cgroup.conf)"
# How long Slurm waits between its SIGTSTP (mpipause's pause) and its
# SIGSTOP: from 23.02 PreemptParameters' suspend_grace_time (2 s unless
# set), before it a fixed 2 s (docs/slurm.md).
grace=$(scontrol show config | sed -n 's/^PreemptParameters *= *.*suspend_grace_time=\([0-9]*\).*/\1/p')
echo "INFO slurm: $(sinfo -V), SIGSTOP ${grace:-2} s after SIGTSTP ($([ -n "$grace" ] && echo "PreemptParameters suspend_grace_time" || echo "Slurm's default"))"

# state ID: mpipause's state of job ID, as its owner asks.
state() { mpipause status --json "$1" 2>/dev/null | jq -r .state; }
# job_state SLURMID: Slurm's state of the job.
job_state() { scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
# end_state SLURMID: the state the job ended in, once it has left
# COMPLETING (srun may return before: the state read then is a race).
end_state() {
	local st
	# shellcheck disable=SC2317 # called through until_ok
	ended() { st=$(job_state "$1") && case $st in COMPLETING | RUNNING | PENDING | CONFIGURING | SUSPENDED | "") false ;; esac; }
	until_ok ended "$1"
	echo "$st"
}
# pids_on NODE: the test app's processes on NODE (one job's at a time),
# found by name, not by Slurm, whose proctrack/cgroup would not list a rank
# that left the job's cgroup.
# The command must start with the app: srun's own command line names it too.
pids_on() { on "$1" pgrep -u "$(id -u)" -f "^[^ ]*/apps/xchg[.]" 2>/dev/null | tr '\n' ' '; }
# ranks_on NODE: "PID CGROUP" of each of the test app's processes on NODE,
# in one call (a call costs seconds on an emulated VM).
ranks_on() {
	# shellcheck disable=SC2016 # the node's shell expands them
	on "$1" sh -c 'for p in $(pgrep -u "$1" -f "$2"); do c=$(cat "/proc/$p/cgroup" 2>/dev/null) && echo "$p ${c#0::}"; done' sh "$(id -u)" "^[^ ]*/apps/xchg[.]"
}
# per_node FUNC ARGS...: FUNC NODE ARGS... on every node at once (a node's
# calls take seconds on an emulated VM, and the checks run while the job
# is frozen or after it ran on), their outputs in node order; fails if
# any failed (its output says why). Waits for its own calls only: srun
# runs in the background too.
per_node() {
	local f=$1 d k rc=0 pids=()
	shift
	d=$(mktemp -d)
	for ((k = 0; k < nodes; k++)); do
		(
			"$f" "node$k" "$@" >"$d/$k"
			echo $? >"$d/$k.rc"
		) &
		pids+=($!)
	done
	wait "${pids[@]}"
	for ((k = 0; k < nodes; k++)); do
		cat "$d/$k"
		[ "$(cat "$d/$k.rc" 2>/dev/null)" = 0 ] || rc=1
	done
	rm -rf "$d"
	return $rc
}
# ranks_at NODE: ranks_on's lines, each after the node's name.
ranks_at() { ranks_on "$1" | sed "s/^/$1 /"; }
# in_job_cgroups SLURMID: every rank on every node is inside Slurm's cgroup
# of the job (/.../job_ID/): none taken out of it.
in_job_cgroups() {
	local id=$1 n p cg bad="" found=0
	while read -r n p cg; do
		found=$((found + 1))
		case $cg in *"/job_$id/"*) ;; *) bad+=" $n:$p:$cg" ;; esac
	done < <(per_node ranks_at)
	[ "$found" = "$ranks" ] || bad+=" (found $found of the $ranks ranks)"
	[ -z "$bad" ] || {
		echo "$bad"
		return 1
	}
}
# places ID: every node's cgroups of the job as mpid placed them.
places() { mpipause status --json "$1" | jq -r '[.cgroups[]? | "\(.node):\(.placed)"] | unique | join(" ")'; }
# empty_on NODE ID: NODE's kernel sees the job's connections, all empty
# (its own mpipause observe, by the cgroups its mpid names): " NODE:N(bpf)
# NODE:N(sock_diag)", or why not.
empty_on() {
	local n=$1 id=$2 j args=() cg res kind out=''
	for cg in $(on "$n" mpipause status --json "$id" | jq -r '.node as $n | .cgroups[]? | select(.node == $n) | .dir'); do
		args+=(--cgroup "$cg")
	done
	[ ${#args[@]} -gt 0 ] || {
		printf ' %s names no cgroup of %s' "$n" "$id"
		return 1
	}
	# Both of the kernel's views: the BPF observer's and sock_diag's.
	for kind in bpf sock_diag; do
		j=$(on "$n" sudo -n mpipause observe --observer "$kind" "${args[@]}" --json) || {
			printf ' %s: observe (%s) failed' "$n" "$kind"
			return 1
		}
		res=$(echo "$j" | jq -er 'select(.summary.connections > 0 and all(.connections[]; .send_queue_bytes == 0 and .unread_bytes == 0)) | .summary.connections') || {
			printf ' %s (%s): %s connections hold bytes (or none seen)' "$n" "$kind" "$(echo "$j" | jq -c '[.connections[] | select(.send_queue_bytes > 0 or .unread_bytes > 0)] | length')"
			return 1
		}
		out+=" $n:$res($kind)"
	done
	printf '%s' "$out"
}
# empty_everywhere ID: empty_on on every node.
empty_everywhere() { per_node empty_on "$1"; }
# here_cgroups ID: --cgroup DIR for each of node0's cgroups of job ID, as
# its mpid names them (none when it names none).
here_cgroups() {
	local cg
	for cg in $(mpipause status --json "$1" 2>/dev/null | jq -r '.node as $n | .cgroups[]? | select(.node == $n) | .dir'); do
		printf -- '--cgroup\n%s\n' "$cg"
	done
}
# sent0 ID: bytes the job's connections on node0 have sent (BPF counters).
sent0() {
	local args
	mapfile -t args < <(here_cgroups "$1")
	[ ${#args[@]} -gt 0 ] && sudo -n mpipause observe "${args[@]}" --json | jq '[.connections[] | .bytes_sent] | add // 0'
}

# seen OUT: what a check that failed saw of lib_run's job (its id, sid,
# srun_pid; OUT srun's output): mpipause's, Slurm's and srun's states, the
# ranks' on every node (ps STAT and WCHAN: where a blocked rank waits in the
# kernel), node0's connections of the job, and srun's last lines.
seen() {
	local out=$1 n p ps='' conns args
	for ((k = 0; k < nodes; k++)); do
		n=node$k
		p=$(pids_on "$n" | xargs | tr ' ' ,)
		[ -z "$p" ] || ps+=$(on "$n" ps -o pid=,stat=,wchan:22= -p "$p" | awk -v n="$n" '{ printf " %s:%s:%s:%s", n, $1, $2, $3 }')
	done
	mapfile -t args < <(here_cgroups "$id")
	conns="none: no cgroup of the job on node0"
	[ ${#args[@]} = 0 ] || conns=$(sudo -n mpipause observe "${args[@]}" --json 2>&1 | jq -r .summary.connections 2>&1)
	echo "mpipause $(state "$id"), Slurm $(job_state "$sid"), srun $(kill -0 "$srun_pid" 2>/dev/null && echo running || echo ended); ranks:${ps:- none}; node0 connections: $conns; srun: $(tail -3 "$out" | tr '\n' ' ')"
}

# srun_bg OUT ARGS...: srun in the background, its output to OUT; sets
# srun_pid and, once Slurm has it, sid.
srun_bg() {
	local out=$1 name
	shift
	name=slurm-e2e-$$-$RANDOM
	srun --job-name="$name" "$@" >"$out" 2>&1 &
	srun_pid=$!
	sid=''
	got_id() { kill -0 "$srun_pid" 2>/dev/null || return 2; sid=$(squeue -h -n "$name" -o %i | head -1) && [ -n "$sid" ]; }
	until_ok got_id
}

stop=$(mktemp -d /tmp/slurm-e2e.XXXXXX)
# The job apps' stop directory must be on every node (xchg -E reads it on
# rank 0's node, node0; the others only take it as an argument).
for ((k = 1; k < nodes; k++)); do on "node$k" mkdir -p "$stop"; done
trap 'scancel -u "$(id -u)" 2>/dev/null; rm -rf "$stop"' EXIT

# lib_run LIB [HOW]: LIB's 3 x 2 job suspended and resumed, HOW scontrol
# (scontrol suspend and resume, --pauses times) or preempt (a job of the
# higher-priority partition takes the nodes, once, and ends).
lib_run() {
	local lib=$1 how=${2:-scontrol} mpi pre=() out id i j t st late ms n=$pauses what=suspend
	case $lib in
	openmpi) mpi=pmix ;;
	mpich)
		mpi=pmi2
		pre=(--export="ALL,LD_PRELOAD=$bin/libucxfinalize.so")
		;;
	esac
	out=$(mktemp)
	rm -f "$stop/stop"
	[ "$how" = scontrol ] || n=1 what=preempt
	srun_bg "$out" -N"$nodes" -n"$ranks" -O --mem=400M --mpi="$mpi" "${pre[@]}" "$bin/apps/xchg.$lib" -m a2a -s 256K -n 100000000 -E "$stop" || {
		fail "$lib: srun: $(tail -3 "$out" | tr '\n' ' ')"
		return
	}
	id=$sid.0
	registered() { kill -0 "$srun_pid" 2>/dev/null || return 2; mpipause status --json "$id" 2>/dev/null | jq -e --argjson r "$ranks" '.ranks == $r' >/dev/null; }
	if ! until_ok registered; then
		fail "$lib: job $sid: $ranks ranks never registered: $(tail -3 "$out" | tr '\n' ' ')"
		return
	fi
	pass "$lib: job $sid (mpipause $id): $ranks ranks registered, placed $(places "$id")"
	if ! j=$(in_job_cgroups "$sid"); then
		fail "$lib: running: ranks outside Slurm's job cgroup:$j"
		return
	fi
	local base now
	exchanging() { kill -0 "$srun_pid" 2>/dev/null || return 2; base=$(sent0 "$id") && [ "$base" -gt 0 ]; }
	until_ok exchanging || {
		fail "$lib: no bytes exchanged: $(seen "$out")"
		return
	}
	local high high_pid hout
	for ((i = 1; i <= n; i++)); do
		t=$SECONDS
		if [ "$how" = preempt ]; then
			hout=$(mktemp)
			high=slurm-e2e-high-$$-$i
			# It holds the nodes until cancelled: the checks of the
			# suspended job take longer under emulation than any fixed
			# time (a 20 s job ended mid-check once, and the job resumed).
			srun -p high --job-name="$high" --mpipause=no -N"$nodes" -n"$nodes" sleep 3600 >"$hout" 2>&1 &
			high_pid=$!
		elif ! sudo -n scontrol suspend "$sid"; then
			fail "$lib: scontrol suspend $sid"
			return
		fi
		# Paused; or the pause failed with the job suspended: Slurm
		# 22.05 sends its SIGSTOP (the step cgroup's freeze) 2 s after
		# its SIGTSTP, and a pause on these emulated VMs takes 0.4 to
		# 3.3 s (mpid's total_ms). A rank stopped before the drain has
		# read what was sent to it makes the drain time out and the
		# pause roll back: the job stops where it is, as without
		# mpipause, and Slurm's resume continues it (docs/slurm.md). Only
		# a step that ran out of time is that race: any other failure
		# (bytes through closed gates, a rank lost) fails the check.
		settled() { st=$(state "$id") && { [ "$st" = paused ] || { [ "$st" = failed ] && [ "$(job_state "$sid")" = SUSPENDED ]; }; }; }
		# Not a wait for readiness (until_ok is): node0's core is left
		# to the ranks while the pause runs (--quiet, above).
		sleep "$quiet"
		if ! until_ok settled; then
			fail "$lib: $what $i: not paused: $(seen "$out")"
			return
		fi
		if ! in_job_cgroups "$sid" >/dev/null; then
			fail "$lib: $what $i: ranks outside Slurm's job cgroup"
			return
		fi
		late=''
		if [ "$st" = paused ]; then
			if ! j=$(empty_everywhere "$id"); then
				fail "$lib: $what $i: $j"
				return
			fi
			clean[$lib]=$((${clean[$lib]:-0} + 1))
			js=$(mpipause status --json "$id")
			ms=$(jq -r '.total_ms | floor' <<<"$js")
			# Where the time went: mpid's phases (round, rounds, ms).
			ph=$(jq -r '[.phases // [] | .[] | "\(.name) \(.ms | floor)"] | join(", ")' <<<"$js")
			if [ "$how" = scontrol ]; then
				pause_ms+=("$ms")
				while read -r name pms; do
					phase_ms[$name]=$((${phase_ms[$name]:-0} + pms))
				done < <(jq -r '.phases // [] | .[] | "\(.name) \(.ms | floor)"' <<<"$js")
			fi
			pass "$lib: $what $i: paused within $((SECONDS - t)) s (mpid: $ms ms: $ph), Slurm $(job_state "$sid"); connections empty on$j; ranks in Slurm's job cgroup"
		else
			[ "$how" != scontrol ] || lost=$((lost + 1))
			late=$(mpipause status --json "$id" | jq -r '.failure | "\(.phase): \(.reason)"')
			# Lost to Slurm: the drain ran out of time, or found a rank
			# with bytes waiting for it that Slurm's freeze (or SIGSTOP)
			# already holds, which rolls back at once (docs/slurm.md).
			case $late in
			*"timed out"* | *"deadline exceeded"* | *"i/o timeout"* | *"frozen by its cgroup"* | *"stopped by a signal"*) ;;
			*)
				fail "$lib: $what $i: the pause failed, neither for time nor for a rank Slurm holds: $late"
				return
				;;
			esac
		fi
		base=$(sent0 "$id")
		if [ "$how" = preempt ]; then
			# The resume is Slurm's, when the preempting job ends.
			if ! kill -0 "$high_pid" 2>/dev/null; then
				fail "$lib: preempt $i: the high-priority job ended before the checks: $(tail -2 "$hout" | tr '\n' ' ')"
				return
			fi
			scancel -n "$high"
			wait "$high_pid"
			rm -f "$hout"
		elif ! sudo -n scontrol resume "$sid"; then
			fail "$lib: scontrol resume $sid"
			return
		fi
		moved() { [ "$(state "$id")" = running ] && now=$(sent0 "$id") && [ "$now" -gt "$base" ]; }
		if ! until_ok moved; then
			fail "$lib: $what $i: resume: no new bytes: $(seen "$out")"
			return
		fi
		if [ -z "$late" ]; then
			pass "$lib: $what $i: resumed: running and exchanging, Slurm $(job_state "$sid")"
		else
			pass "$lib: $what $i: Slurm's SIGSTOP came before the pause committed ($late): rolled back, ranks in Slurm's job cgroup, resumed by Slurm as without mpipause: running and exchanging"
		fi
		# One clean pause is what --only suspend asks of a library.
		[ "$only" != suspend ] || [ "${clean[$lib]:-0}" = 0 ] || break
	done
	touch "$stop/stop"
	wait "$srun_pid"
	local rc=$? got want iters
	got=$(grep -m1 '^xchg mode=' "$out")
	iters=$(echo "$got" | sed -n 's/.* iters=\([0-9]*\) .*/\1/p')
	want=$("$bin/apps/xchg.$lib" -m a2a -s 256K -n "${iters:-0}" -x "$ranks")
	if [ "$rc" != 0 ] || [ -z "$got" ] || [ "$got" != "$want" ]; then
		fail "$lib: end: exit $rc, '$got', an unpaused (serial) run '$want'"
		return
	fi
	pass "$lib: end: exit 0, the same result as an unpaused run ($iters iterations)"
	rm -f "$out"
}


# rank_envs: "NODE:PID:STAT:MPIPAUSE_JOBID:LD_PRELOAD has the shim:CGROUP"
# of each of the test app's processes on every node (what a check of an
# sbatch job that failed saw).
rank_envs() {
	local n
	for ((k = 0; k < nodes; k++)); do
		n=node$k
		# shellcheck disable=SC2016 # the node's shell expands them
		on "$n" sh -c 'for p in $(pgrep -u "$1" -f "$2"); do e=$(tr "\0" "\n" <"/proc/$p/environ" 2>/dev/null); j=$(echo "$e" | sed -n "s/^MPIPAUSE_JOBID=//p"); case $(echo "$e" | sed -n "s/^LD_PRELOAD=//p") in *libmpipause*) s=shim ;; *) s=noshim ;; esac; c=$(cat "/proc/$p/cgroup" 2>/dev/null); echo "$3:$p:$(ps -o stat= -p "$p"):${j:-none}:$s:${c#0::}"; done' sh "$(id -u)" "^[^ ]*/apps/xchg[.]" "$n" | tr '\n' ' '
	done
}

# procs: "NODE:PID:PPID:STAT:COMM" of each of the user's processes on
# every node.
procs() {
	for ((k = 0; k < nodes; k++)); do
		on "node$k" ps -u "$(id -u)" -o pid=,ppid=,stat=,comm= | awk -v n="node$k" '{ printf "%s:%s:%s:%s:%s ", n, $1, $2, $3, $4 }'
	done
}

# sbatch_run LIB: LIB's 3 x 2 job started by the library's own launcher in an
# sbatch script (Open MPI: mpirun, whose orted daemons srun starts as the
# tasks of step 0; MPICH: mpiexec with Hydra's slurm launcher, whose proxies
# are the tasks of step 0), suspended and resumed by scontrol, --pauses
# times; the result is the serial one.
sbatch_run() {
	local lib=$1 script out sid id i t st j base now late launch env_line=''
	case $lib in
	openmpi) launch="mpirun.openmpi -np $ranks --map-by ppr:2:node" ;;
	mpich)
		# libucxfinalize.so (MPICH 4.0 ch4:ucx's hang in MPI_Finalize
		# over TCP) first in the script's LD_PRELOAD, before what the
		# script has (the shim): Hydra hands mpiexec's environment on
		# to the ranks.
		env_line="export LD_PRELOAD=$bin/libucxfinalize.so\${LD_PRELOAD:+:\$LD_PRELOAD}"
		launch="mpiexec.mpich -launcher slurm -n $ranks -ppn 2"
		;;
	esac
	rm -f "$stop/stop"
	script=$stop/job-$lib.sh out=$stop/job-$lib.out
	printf '#!/bin/bash\n%s\n%s %s -m a2a -s 256K -n 100000000 -E %s\n' "$env_line" "$launch" "$bin/apps/xchg.$lib" "$stop" >"$script"
	if ! sid=$(sbatch --parsable -J "slurm-e2e-$$-sbatch" -N"$nodes" -n"$ranks" -O --mem=400M -o "$out" "$script" 2>&1); then
		fail "sbatch $lib: sbatch: $sid"
		return
	fi
	sid=${sid%%;*}
	# The job id mpipause knows the job by: what the ranks were given.
	id=''
	all_up() {
		case $(job_state "$sid") in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) return 2 ;; esac
		local e
		e=$(rank_envs)
		[ "$(echo "$e" | wc -w)" -ge "$ranks" ]
	}
	# A launcher's start takes longer than a step's (the batch script, then
	# the daemons' step, then the ranks) on the emulated VMs.
	if ! step_timeout=$((step_timeout * 3)) until_ok all_up; then
		fail "sbatch $lib: job $sid: not $ranks ranks running: Slurm $(job_state "$sid"); ranks: $(rank_envs); $(tail -3 "$out" 2>/dev/null | tr '\n' ' ')"
		return
	fi
	local envs ids
	envs=$(rank_envs)
	ids=$(echo "$envs" | tr ' ' '\n' | awk -F: 'NF { print $4 }' | sort -u | xargs)
	echo "     sbatch $lib: job $sid: steps $(squeue -h -s -j "$sid" -o '%i:%j' | xargs); ranks (node:pid:stat:MPIPAUSE_JOBID:preload:cgroup): $envs"
	echo "     sbatch $lib: processes (node:pid:ppid:stat:comm): $(procs)"
	case $ids in
	none | *" "* | "")
		fail "sbatch $lib: job $sid: the ranks do not all name one mpipause job: MPIPAUSE_JOBID ${ids:-none} (mpipause list: $(mpipause list 2>&1 | tr '\n' ' '))"
		id=''
		;;
	*) id=$ids ;;
	esac
	if [ -n "$id" ]; then
		reg() { mpipause status --json "$id" 2>/dev/null | jq -e --argjson r "$ranks" '.ranks == $r' >/dev/null; }
		if until_ok reg; then
			pass "sbatch $lib: job $sid (mpipause $id): $ranks ranks registered, placed $(places "$id")"
		else
			fail "sbatch $lib: job $sid (mpipause $id): not $ranks ranks registered: $(mpipause status --json "$id" 2>&1 | jq -c '{state, ranks, local_ranks, nodes}' 2>&1)"
			id=''
		fi
	fi
	for ((i = 1; i <= pauses; i++)); do
		t=$SECONDS
		if [ -n "$id" ]; then
			exchanging() { base=$(sent0 "$id") && [ "$base" -gt 0 ]; }
			until_ok exchanging || {
				fail "sbatch $lib: no bytes exchanged"
				break
			}
		fi
		sudo -n scontrol suspend "$sid" || {
			fail "sbatch $lib: scontrol suspend $sid"
			break
		}
		if [ -z "$id" ]; then
			# What Slurm's suspend did to the ranks, mpipause aside.
			sleep 8
			echo "     sbatch $lib: suspend $i (no mpipause job): Slurm $(job_state "$sid"); ranks: $(rank_envs)"
			echo "     sbatch $lib: processes: $(procs)"
			fail "sbatch $lib: suspend $i: no mpipause job to pause"
			sudo -n scontrol resume "$sid"
			continue
		fi
		settled() { st=$(state "$id") && { [ "$st" = paused ] || { [ "$st" = failed ] && [ "$(job_state "$sid")" = SUSPENDED ]; }; }; }
		# Not a wait for readiness (until_ok is): node0's core is left
		# to the ranks while the pause runs (--quiet, above).
		sleep "$quiet"
		if ! until_ok settled; then
			fail "sbatch $lib: suspend $i: not paused: mpipause $(state "$id"), Slurm $(job_state "$sid"); ranks: $(rank_envs); processes: $(procs)"
			sudo -n scontrol resume "$sid"
			continue
		fi
		late=''
		if [ "$st" = paused ]; then
			if ! j=$(empty_everywhere "$id"); then
				fail "sbatch $lib: suspend $i: $j"
				sudo -n scontrol resume "$sid"
				continue
			fi
			clean[sbatch-$lib]=$((${clean[sbatch-$lib]:-0} + 1))
			pass "sbatch $lib: suspend $i: paused within $((SECONDS - t)) s, Slurm $(job_state "$sid"); connections empty on$j"
		else
			late=$(mpipause status --json "$id" | jq -r '.failure | "\(.phase): \(.reason)"')
			echo "     sbatch $lib: suspend $i: the pause failed: $late; ranks: $(rank_envs)"
		fi
		base=$(sent0 "$id")
		sudo -n scontrol resume "$sid" || {
			fail "sbatch $lib: scontrol resume $sid"
			break
		}
		moved() { [ "$(state "$id")" = running ] && now=$(sent0 "$id") && [ "$now" -gt "$base" ]; }
		if ! until_ok moved; then
			fail "sbatch $lib: suspend $i: resume: no new bytes: mpipause $(state "$id"), Slurm $(job_state "$sid"); ranks: $(rank_envs)"
			break
		fi
		pass "sbatch $lib: suspend $i: resumed${late:+ (after a pause that failed: $late)}: running and exchanging, Slurm $(job_state "$sid")"
	done
	touch "$stop/stop"
	local got want iters
	st=$(end_state "$sid")
	got=$(grep -m1 '^xchg mode=' "$out")
	iters=$(echo "$got" | sed -n 's/.* iters=\([0-9]*\) .*/\1/p')
	want=$("$bin/apps/xchg.$lib" -m a2a -s 256K -n "${iters:-0}" -x "$ranks")
	if [ "$st" != COMPLETED ] || [ -z "$got" ] || [ "$got" != "$want" ]; then
		fail "sbatch $lib: end: Slurm $st, '$got', an unpaused (serial) run '$want'; the job's output: $(tail -5 "$out" | tr '\n' ' ')"
		return
	fi
	pass "sbatch $lib: end: COMPLETED, the same result as an unpaused run ($iters iterations)"
}

IFS=, read -r -a lib_list <<<"$libs"
# clean[LIB]: the suspends of LIB's jobs that paused before Slurm's SIGSTOP.
declare -A clean
# pause_ms: mpid's time (total_ms) of each scontrol suspend's committed
# pause; lost: the suspends whose pause Slurm's SIGSTOP overtook.
pause_ms=() lost=0
# phase_ms[PHASE]: the ms of PHASE summed over those pauses.
declare -A phase_ms
# dac_override on|off: mpid's unit on every node with (a drop-in) or
# without CAP_DAC_OVERRIDE, mpid restarted (docs/slurm.md, "Launching MPI
# under Slurm").
dac_override() {
	local n k cmd
	if [ "$1" = on ]; then
		cmd='mkdir -p /etc/systemd/system/mpid.service.d && printf "[Service]\nCapabilityBoundingSet=CAP_DAC_OVERRIDE\n" >/etc/systemd/system/mpid.service.d/sbatch.conf'
	else
		cmd='rm -f /etc/systemd/system/mpid.service.d/sbatch.conf'
	fi
	for ((k = 0; k < nodes; k++)); do
		n=node$k
		on "$n" sudo -n sh -c "$cmd && systemctl daemon-reload && systemctl restart mpid" ||
			fail "sbatch: CAP_DAC_OVERRIDE $1 for mpid on $n"
	done
}
if [ "$only" = sbatch ]; then
	dac_override on
	for l in "${lib_list[@]}"; do
		sbatch_run "$l"
		scancel -u "$(id -u)" 2>/dev/null
	done
	for l in "${lib_list[@]}"; do
		[ "${clean[sbatch-$l]:-0}" -gt 0 ] || fail "sbatch $l: no suspend paused before Slurm's SIGSTOP"
	done
	dac_override off
	summary
	exit
fi
runs=("${lib_list[@]}")
[ "$only" = suspend ] || runs+=("${lib_list[0]} preempt")
for l in "${runs[@]}"; do
	# shellcheck disable=SC2086 # LIB [HOW]
	lib_run $l
	# A run that failed leaves its job: it would hold the nodes.
	scancel -u "$(id -u)" 2>/dev/null
	[ -z "${srun_pid:-}" ] || wait "$srun_pid" 2>/dev/null
done
# What a site's suspend costs on these VMs: mpid's pause time over the
# scontrol suspends that paused (nearest rank), and those lost to the race.
if [ "${#pause_ms[@]}" -gt 0 ]; then
	mapfile -t sorted < <(printf '%s\n' "${pause_ms[@]}" | sort -n)
	pct() { echo "${sorted[$(((${#sorted[@]} * $1 + 99) / 100 - 1))]}"; }
	echo "INFO scontrol suspends: $((${#sorted[@]} + lost)), paused ${#sorted[@]}, lost to Slurm's SIGSTOP $lost; mpid's pause: p50 $(pct 50) ms, p99 $(pct 99) ms, max ${sorted[-1]} ms"
	sum=0
	for v in "${pause_ms[@]}"; do sum=$((sum + v)); done
	shares=''
	for name in "${!phase_ms[@]}"; do
		shares+=" $name $((phase_ms[$name] * 100 / (sum > 0 ? sum : 1)))%"
	done
	echo "INFO where those pauses' time went (mpid's phases, share of their total):$shares"
fi
# A suspend may lose the race with Slurm's SIGSTOP now and then (above),
# not every one of a library's.
for l in "${lib_list[@]}"; do
	[ "${clean[$l]:-0}" -gt 0 ] || fail "$l: no suspend of its jobs paused before Slurm's SIGSTOP"
done
if [ "$only" = suspend ]; then
	summary
	exit
fi

# What Slurm does to a step, with mpipause and without (--mpipause=no).
# outcomes SRUN-ARGS...: "JobState exit" of a one-task step with mpipause,
# then of the same without, on a line each; both run at once, each on a
# node of its own (a time limit is a minute at the least, and Slurm's kill
# of it takes another half).
outcomes() {
	local outs=() pids=() sids=() p i rc
	for p in yes no; do
		outs+=("$(mktemp)")
		if srun_bg "${outs[-1]}" --mpipause=$p "$@"; then
			pids+=("$srun_pid") sids+=("$sid")
		else
			pids+=("") sids+=("")
		fi
	done
	for i in 0 1; do
		if [ -z "${pids[i]}" ]; then
			echo "no job: $(tail -2 "${outs[i]}" | tr '\n' ' ')"
			continue
		fi
		wait "${pids[i]}"
		rc=$?
		echo "$(end_state "${sids[i]}") exit=$rc"
	done
	rm -f "${outs[@]}"
}
# cancelled yes|no SRUN-ARGS...: "JobState left=N" of the step, with
# mpipause or without, cancelled once all its ranks run (with mpipause:
# registered), N its processes left on the nodes.
cancelled() {
	local p=$1 out
	shift
	out=$(mktemp)
	srun_bg "$out" --mpipause="$p" "$@" || {
		echo "no job"
		return
	}
	if [ "$p" = yes ]; then
		reg() { kill -0 "$srun_pid" 2>/dev/null || return 2; mpipause status --json "$sid.0" 2>/dev/null | jq -e --argjson r "$ranks" '.ranks == $r' >/dev/null; }
		until_ok reg
	else
		started() { kill -0 "$srun_pid" 2>/dev/null || return 2; [ "$(for ((k = 0; k < nodes; k++)); do pids_on "node$k"; done | wc -w)" -ge "$ranks" ]; }
		until_ok started
	fi
	scancel "$sid"
	wait "$srun_pid"
	echo "$(end_state "$sid") left=$(for ((k = 0; k < nodes; k++)); do pids_on "node$k"; done | wc -w)"
	rm -f "$out"
}
for c in "scancel" "time limit" "memory limit"; do
	case $c in
	scancel)
		args=(-N"$nodes" -n"$ranks" -O --mpi=pmix "$bin/apps/xchg.openmpi" -m a2a -s 64K -n 100000000)
		;;
	"time limit") args=(-t 1 -N1 -n1 sleep 600) ;;
	"memory limit") args=(--mem=64M -N1 -n1 awk 'BEGIN { s = "x"; for (i = 0; i < 40; i++) s = s s; print length(s) }') ;;
	esac
	if [ "$c" = scancel ]; then
		# Its job takes every node: one after the other.
		got=("$(cancelled yes "${args[@]}")" "$(cancelled no "${args[@]}")")
	else
		mapfile -t got < <(outcomes "${args[@]}")
	fi
	if [ "${#got[@]}" = 2 ] && [ "${got[0]}" = "${got[1]}" ]; then
		pass "$c: with mpipause as without: ${got[0]}"
	else
		fail "$c: with mpipause '${got[0]:-}', without '${got[1]:-}'"
	fi
done

# sstat counts the CPU of a running step's tasks, sacct the finished
# step's, and --cpu-bind binds them: the same with mpipause as without.
# The task spins for 20 s of its wall clock (sh's loop, on a node's one CPU).
declare -A live total bind
secs() { awk -F'[:.-]' '{ s = 0; for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+$/) s = s * 60 + $i; print s }' <<<"${1%.*}"; }
for p in yes no; do
	out=$(mktemp)
	# shellcheck disable=SC2016 # the task's shell expands them
	srun_bg "$out" --mpipause=$p --cpu-bind=cores -N1 -n1 sh -c 'grep Cpus_allowed_list /proc/self/status; timeout 20 sh -c "while :; do :; done"; echo done'
	ave=''
	counting() { kill -0 "$srun_pid" 2>/dev/null || return 2; ave=$(sstat -n -P -j "$sid.0" -o AveCPU 2>/dev/null | head -1) && [ -n "$ave" ] && [ "$(secs "$ave")" -gt 0 ]; }
	if until_ok counting; then live[$p]="AveCPU $ave"; else live[$p]="nothing (${ave:-no line})"; fi
	wait "$srun_pid"
	bind[$p]=$(grep -m1 Cpus_allowed_list "$out" | tr -s '\t ' ' ')
	cpu=''
	stored() { cpu=$(sacct -n -P -j "$sid.0" -o TotalCPU,State 2>/dev/null | head -1) && [[ $cpu == *"|COMPLETED" ]] && [ "$(secs "${cpu%%|*}")" -gt 0 ]; }
	if until_ok stored; then total[$p]=$(secs "${cpu%%|*}"); else total[$p]="nothing (${cpu:-no line})"; fi
	rm -f "$out"
done
if [[ ${live[yes]} == AveCPU* && ${live[no]} == AveCPU* ]]; then
	pass "sstat: counts the running step's CPU with mpipause (${live[yes]}) as without (${live[no]})"
else
	fail "sstat: with mpipause '${live[yes]}', without '${live[no]}'"
fi
# Both spun for 20 s: each must have most of it (the VM's CPU is the
# host's, shared; half is far from a task left uncounted).
if [[ ${total[yes]} =~ ^[0-9]+$ && ${total[no]} =~ ^[0-9]+$ ]] && [ "${total[yes]}" -ge 10 ] && [ "${total[no]}" -ge 10 ]; then
	pass "sacct: TotalCPU of the 20 s spin ${total[yes]} s with mpipause, ${total[no]} s without"
else
	fail "sacct: TotalCPU with mpipause '${total[yes]}', without '${total[no]}' (want 10 s or more of the 20 s spin)"
fi
if [ -n "${bind[yes]}" ] && [ "${bind[yes]}" = "${bind[no]}" ]; then
	pass "--cpu-bind=cores: with mpipause as without (${bind[yes]})"
else
	fail "--cpu-bind=cores: with mpipause '${bind[yes]}', without '${bind[no]}'"
fi

summary

exit
