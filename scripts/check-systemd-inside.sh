#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# Runs inside a Debian 12 container booted with systemd as its PID 1
# (scripts/check-systemd.sh), as a service of that systemd, once the boot is
# done: installs the .deb ($1) with apt, starts mpid with its unit, sandbox
# and all, and checks that it serves and pauses a real 2-rank Open MPI job
# (xchg, $2), that systemd restarts it after a SIGKILL and that the new mpid
# resumes the job. Ends the container with its result: systemctl
# exit 0 when every check passed, 1 otherwise.
set -euo pipefail
deb=$1 xchg=$2
export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8
job=systemd-check
# The job's Open MPI: both ranks on this node, over TCP on loopback (the
# container's only interface), as root.
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,self OMPI_MCA_btl_tcp_if_include=lo \
	OMPI_MCA_oob_tcp_if_include=lo OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

rc=1
finish() {
	# Whatever happened, the container ends, and says how.
	[ "$rc" = 0 ] || journalctl -b -u mpid --no-pager -o short-monotonic | tail -40 || true
	systemctl --no-block exit "$rc"
}
trap finish EXIT
fail() {
	echo "check-systemd (in the container): FAIL: $*" >&2
	exit 1
}
step() { echo "check-systemd: [${SECONDS}s] $*"; }
# wait_for WHAT SECONDS CMD...: until CMD succeeds, or fail after SECONDS.
wait_for() {
	local what=$1 secs=$2 left=$(($2 * 10))
	shift 2
	until "$@"; do
		left=$((left - 1))
		[ "$left" -gt 0 ] || fail "no $what after $secs s"
		sleep 0.1
	done
}

step "systemd $(systemctl --version | awk 'NR == 1 { print $2 }') is PID 1: $(systemctl is-system-running --wait || true)"
state=$(systemctl is-system-running) || { systemctl --failed --no-pager; fail "the system is $state, want running"; }

step "apt-get install $deb (no cluster key: mpid not enabled)"
apt-get install -y -q --no-install-recommends "$deb" > /tmp/install.log 2>&1 || { cat /tmp/install.log; fail "apt-get install $deb"; }
[ "$(systemctl is-enabled mpid)" = disabled ] || fail "mpid is $(systemctl is-enabled mpid) without a cluster key, want disabled"

step "mpid keygen; systemctl start mpid (Type=notify: returns once mpid sent READY=1)"
mpid keygen > /dev/null
systemctl start mpid || { systemctl status mpid --no-pager || true; fail "systemctl start mpid"; }
[ "$(systemctl is-active mpid)" = active ] || fail "mpid is $(systemctl is-active mpid) after start"
systemctl show mpid -p StatusText,MainPID,NRestarts,Type
show() { systemctl show mpid -P "$1"; }
[ -n "$(show StatusText)" ] || fail "mpid gave systemd no STATUS= with its READY=1"
[ "$(show NRestarts)" = 0 ] || fail "mpid restarted $(show NRestarts) times"
pid=$(show MainPID)
[ "$pid" != 0 ] || fail "no MainPID"
[ "$(readlink "/proc/$pid/exe")" = /usr/sbin/mpid ] || fail "MainPID $pid is $(readlink "/proc/$pid/exe"), not /usr/sbin/mpid"

step "mpid's capabilities are the unit's CapabilityBoundingSet, no more, no fewer"
want=$(sed -n 's/^CapabilityBoundingSet=//p' /lib/systemd/system/mpid.service | tr ' A-Z' '\na-z' | sort | paste -sd,)
have=$(capsh --decode="$(awk '$1 == "CapEff:" { print $2 }' "/proc/$pid/status")" | sed 's/.*=//' | tr , '\n' | sort | paste -sd,)
echo "CapEff of mpid ($pid): $have"
[ -n "$want" ] && [ "$have" = "$want" ] || fail "mpid's effective capabilities are $have, the unit's set is $want"
# The sandbox is in force: / is read-only for mpid, /run/mpipause not.
grep -q ' / ro,' "/proc/$pid/mountinfo" || fail "/ is not read-only for mpid (ProtectSystem=strict)"
[ "$(awk '$1 == "NoNewPrivs:" { print $2 }' "/proc/$pid/status")" = 1 ] || fail "mpid runs without no_new_privs"
[ "$(awk '$1 == "Seccomp:" { print $2 }' "/proc/$pid/status")" = 2 ] || fail "mpid runs without its system call filter"
[ -d /run/mpipause ] || fail "no /run/mpipause (RuntimeDirectory=)"
# The sockets are there, in a directory only root may write (no user can
# take them while mpid restarts), and anyone may connect.
[ "$(stat -c '%U %a' /run/mpipause)" = "root 755" ] || fail "/run/mpipause is $(stat -c '%U %a' /run/mpipause), want root 755"
for s in rank.sock ctl.sock; do
	[ -S "/run/mpipause/$s" ] && [ "$(stat -c %a "/run/mpipause/$s")" = 666 ] || fail "/run/mpipause/$s is not a socket of mode 666: $(ls -l /run/mpipause)"
done
[ "$(wc -l < /sys/fs/cgroup/system.slice/mpid.service/cgroup.procs)" = 1 ] || fail "mpid.service's cgroup holds more than mpid"

step "the unit's bounds are systemd's: MemoryMax=, TasksMax= (docs/security.md)"
unit_value() { sed -n "s/^$1=//p" /lib/systemd/system/mpid.service; }
mem=$(unit_value MemoryMax) tasks=$(unit_value TasksMax)
[ -n "$mem" ] && [ -n "$tasks" ] || fail "the unit sets no MemoryMax= ($mem) or no TasksMax= ($tasks)"
mem=$(numfmt --from=iec "$mem")
systemctl show mpid -p MemoryMax,TasksMax,MemoryHigh
[ "$(show MemoryMax)" = "$mem" ] || fail "systemd has MemoryMax=$(show MemoryMax) for mpid, the unit says $mem bytes"
[ "$(show TasksMax)" = "$tasks" ] || fail "systemd has TasksMax=$(show TasksMax) for mpid, the unit says $tasks"
# Go's share of MemoryMax reaches mpid, which reads it back to refuse new
# connections near it (docs/security.md, "Bounded resources").
gomem=$(unit_value Environment | sed -n 's/^GOMEMLIMIT=//p')
[ -n "$gomem" ] || fail "the unit sets no Environment=GOMEMLIMIT="
tr '\0' '\n' < "/proc/$(show MainPID)/environ" | grep -qx "GOMEMLIMIT=$gomem" ||
	fail "mpid runs without GOMEMLIMIT=$gomem: $(tr '\0' ' ' < "/proc/$(show MainPID)/environ")"
[ "$(numfmt --from=iec-i "${gomem%B}")" -lt "$mem" ] || fail "GOMEMLIMIT=$gomem is not below MemoryMax ($mem bytes)"
echo "mpid's GOMEMLIMIT: $gomem"
# The kernel enforces them only where the controllers are in the cgroup v2
# hierarchy; a hybrid host keeps memory and pids in v1 and gives the
# container neither. Where they are, mpid's cgroup must carry the values.
cgdir=/sys/fs/cgroup/system.slice/mpid.service
for f in "memory.max:$mem" "pids.max:$tasks"; do
	file=${f%%:*} value=${f#*:}
	if [ -e "$cgdir/$file" ]; then
		[ "$(cat "$cgdir/$file")" = "$value" ] || fail "$cgdir/$file is $(cat "$cgdir/$file"), want $value"
		echo "$file of mpid's cgroup: $value"
	else
		echo "$file: not in this container's cgroup v2 hierarchy (controllers: $(cat /sys/fs/cgroup/cgroup.controllers)): set, not enforced here"
	fi
done

step "the journal has mpid's lines, with their priorities"
# mpid's own lines (not systemd's about the unit): the serving line, at
# PRIORITY 6 (info) from mpid's own "<6>" prefix, which journald took off.
serving=$(journalctl -u mpid _COMM=mpid -o json --no-pager | jq -c 'select(.MESSAGE | test("msg=serving"))')
[ -n "$serving" ] || fail "mpid's serving line is not in the journal: $(journalctl -u mpid -o cat --no-pager)"
[ "$(jq -r .PRIORITY <<< "$serving")" = 6 ] || fail "mpid's serving line has priority $(jq -r .PRIORITY <<< "$serving"), want 6 (info): $serving"
[[ "$(jq -r .MESSAGE <<< "$serving")" == level=INFO\ msg=serving* ]] || fail "mpid's serving line is not as journald should show it: $(jq -r .MESSAGE <<< "$serving")"
# Every line of mpid's: its priority is its level's (checked again at the end).
priorities_right() {
	local bad
	bad=$(journalctl -u mpid _COMM=mpid -o json --no-pager | jq -r '
		{"DEBUG": "7", "INFO": "6", "WARN": "4", "ERROR": "3"} as $p
		| select((.MESSAGE | capture("^level=(?<l>[A-Z]+) ").l) as $l | $p[$l] != .PRIORITY)
		| "\(.PRIORITY): \(.MESSAGE)"')
	[ -z "$bad" ] || fail "lines of mpid's with the wrong priority in the journal: $bad"
}
priorities_right

step "mpipause list answers through the control socket"
mpipause list || fail "mpipause list"

step "a 2-rank Open MPI job under mpipause run: JOIN loads and attaches its BPF programs"
args=(-m a2a -n 400 -s 64K -z 20000)
sum=$("$xchg" -x 2 "${args[@]}")
mpipause run --jobid "$job" -- mpirun.openmpi -np 2 "$xchg" "${args[@]}" > /tmp/job.out 2>&1 &
jobpid=$!
joined() { mpipause status --json "$job" 2>/dev/null | jq -e '(.local_ranks // []) | length == 2' > /dev/null; }
wait_for "2 joined ranks of job $job" 60 joined
mpipause status "$job"
# This check runs as a unit of systemd's, and so does the job it launches:
# mpid places the ranks inside the unit's cgroup, which holds this script
# too ("inner", docs/mpid.md "Cgroups"), never out of it.
unit_cg=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)
placed=$(mpipause status --json "$job" | jq -r '.cgroups[0] | "\(.placed) \(.dir)"')
[ "$(mpipause status --json "$job" | jq '.cgroups | length')" = 1 ] || fail "job $job has ranks on this node alone, and status lists cgroups $(mpipause status --json "$job" | jq -c .cgroups)"
read -r how cg <<< "$placed"
echo "job cgroup: $cg, placed $how ($(wc -l < "$cg/cgroup.procs") processes), inside this unit's $unit_cg"
[ "$how" = inner ] && [ "$cg" = "$unit_cg/mpipause-0:$job" ] || fail "job $job's ranks placed '$placed', want inner, in $unit_cg/mpipause-0:$job"
[ "$(wc -l < "$cg/cgroup.procs")" -ge 2 ] || fail "the ranks are not in $cg"
# The job's BPF state, pinned by the job's key, a sockops link per cgroup.
pins=/sys/fs/bpf/mpipause/job-0:$job
echo "pins of job $job: $pins: $(ls "$pins" 2>/dev/null | paste -sd ' ')"
compgen -G "$pins/link_sockops_*" > /dev/null || fail "no sockops link of job $job pinned at $pins: $(find /sys/fs/bpf | paste -sd ' ')"

step "mpipause pause"
out=$(mpipause pause --json "$job") || fail "mpipause pause: $out"
state=$(jq -r .state <<< "$out")
[ "$state" = paused ] || fail "after pause, job $job is $state: $out"
jq -r '"paused in \(.total_ms) ms: \(.connections) connections checked, \(.drained_bytes) bytes drained"' <<< "$out"
# The observer saw the ranks' TCP connection (sockops and iterators at work).
[ "$(jq .connections <<< "$out")" -ge 1 ] || fail "the pause checked no connection of job $job: $out"
[ "$(cat "$cg/cgroup.freeze")" = 1 ] || fail "job $job is paused but $cg is not frozen"

step "mpid killed (SIGKILL) while the job is paused: systemd restarts it, the new mpid resumes the job"
kill -KILL "$pid"
# Restart=on-failure, after RestartSec=; RuntimeDirectoryPreserve= keeps
# the record of the pause in /run/mpipause for the new mpid.
restarted() { [ "$(show NRestarts)" = 1 ] && [ "$(systemctl is-active mpid)" = active ]; }
wait_for "restart of mpid by systemd" 60 restarted
newpid=$(show MainPID)
[ "$newpid" != "$pid" ] || fail "mpid's MainPID is still $pid after its restart"
echo "mpid restarted: MainPID $pid, now $newpid, NRestarts $(show NRestarts)"
# mpid names a job by its owner's uid and id (root's here).
[ -f "/run/mpipause/mpid-$(hostname)/0:$job.json" ] || fail "the record of the pause is gone from /run/mpipause: $(find /run/mpipause | paste -sd ' ')"
out=$(mpipause status --json "$job") || fail "mpipause status after mpid's restart: $out"
[ "$(jq -r .state <<< "$out")" = paused ] || fail "after mpid's restart, job $job is $(jq -r .state <<< "$out"), want paused: $out"
[ "$(cat "$cg/cgroup.freeze")" = 1 ] || fail "after mpid's restart, $cg is not frozen"
pid=$newpid
# What the journal says from here on (the kill and the restart are behind).
journalctl -u mpid -o cat --no-pager --cursor-file=/tmp/journal.cursor > /dev/null
out=$(mpipause resume --json "$job") || fail "mpipause resume: $out"
state=$(jq -r .state <<< "$out")
[ "$state" = running ] || fail "after resume, job $job is $state: $out"
wait "$jobpid" || { cat /tmp/job.out; fail "the job failed after its pause and resume"; }
grep -qxF "$sum" /tmp/job.out || { cat /tmp/job.out; fail "the job's result is not the serial one ($sum)"; }
echo "the job's result is the serial one: $sum"

step "a job launched in a transient scope (systemd-run --scope -p MemoryMax= -p TasksMax=): it keeps its scope, limits and accounting, and pauses"
# The scope is systemd's: the ranks must stay inside it at every step, its
# limits stay what systemd set, and its accounting counts the ranks.
sjob=scoped-check sunit=mpipause-scoped-check
systemd-run --scope --unit "$sunit" -p MemoryMax=512M -p TasksMax=200 -p MemoryAccounting=yes -p CPUAccounting=yes \
	mpipause run --jobid "$sjob" -- mpirun.openmpi -np 2 "$xchg" "${args[@]}" > /tmp/scoped.out 2>&1 &
sjobpid=$!
sjoined() { mpipause status --json "$sjob" 2>/dev/null | jq -e '(.local_ranks // []) | length == 2' > /dev/null; }
wait_for "2 joined ranks of job $sjob" 60 sjoined
scope_cg=/sys/fs/cgroup$(systemctl show -P ControlGroup "$sunit.scope")
[ "$scope_cg" != /sys/fs/cgroup ] || fail "systemd has no cgroup for $sunit.scope"
read -r how cg <<< "$(mpipause status --json "$sjob" | jq -r '.cgroups[0] | "\(.placed) \(.dir)"')"
[ "$how" = inner ] && [ "$cg" = "$scope_cg/mpipause-0:$sjob" ] || fail "job $sjob placed '$how' in '$cg', want inner, in $scope_cg/mpipause-0:$sjob"
mapfile -t sranks < "$cg/cgroup.procs"
[ "${#sranks[@]}" -ge 2 ] || fail "the ranks of $sjob are not in $cg: ${sranks[*]}"
# in_scope WHEN: every rank's /proc/PID/cgroup is inside the scope's.
in_scope() {
	local p c
	for p in "${sranks[@]}"; do
		c=/sys/fs/cgroup$(sed -n 's/^0:://p' "/proc/$p/cgroup")
		case $c in "$scope_cg"/*) ;; *) fail "$1: rank pid $p is in $c, outside its scope $scope_cg" ;; esac
	done
}
# limits WHEN: systemd still holds the scope's limits (and the kernel, where
# the controllers are in cgroup v2: not on a hybrid host).
limits() {
	[ "$(systemctl show -P MemoryMax "$sunit.scope")" = 536870912 ] || fail "$1: the scope's MemoryMax is $(systemctl show -P MemoryMax "$sunit.scope")"
	[ "$(systemctl show -P TasksMax "$sunit.scope")" = 200 ] || fail "$1: the scope's TasksMax is $(systemctl show -P TasksMax "$sunit.scope")"
	[ ! -f "$scope_cg/memory.max" ] || [ "$(cat "$scope_cg/memory.max")" = 536870912 ] || fail "$1: $scope_cg/memory.max is $(cat "$scope_cg/memory.max")"
	[ ! -f "$scope_cg/pids.max" ] || [ "$(cat "$scope_cg/pids.max")" = 200 ] || fail "$1: $scope_cg/pids.max is $(cat "$scope_cg/pids.max")"
}
usage() { awk '$1 == "usage_usec" { print $2 }' "$1/cpu.stat"; }
in_scope running
limits running
echo "job $sjob: ranks ${sranks[*]} in $cg (inner) inside $scope_cg; memory.max $(cat "$scope_cg/memory.max" 2>/dev/null || echo 'not in v2 here'), pids.max $(cat "$scope_cg/pids.max" 2>/dev/null || echo 'not in v2 here')"
out=$(mpipause pause --json "$sjob") || fail "mpipause pause $sjob: $out"
[ "$(jq -r .state <<< "$out")" = paused ] || fail "after pause, job $sjob is $(jq -r .state <<< "$out"): $out"
[ "$(cat "$cg/cgroup.freeze")" = 1 ] || fail "job $sjob is paused but $cg is not frozen"
[ "$(cat "$scope_cg/cgroup.freeze")" = 0 ] || fail "mpid froze the whole scope $scope_cg, launcher and all"
in_scope paused
limits paused
out=$(mpipause resume --json "$sjob") || fail "mpipause resume $sjob: $out"
[ "$(jq -r .state <<< "$out")" = running ] || fail "after resume, job $sjob is $(jq -r .state <<< "$out"): $out"
in_scope resumed
limits resumed
# The scope's CPU time counts its ranks' (cgroup v2 keeps cpu.stat without
# any controller): the scope used at least what the ranks' cgroup used.
ranks_us=$(usage "$cg") scope_us=$(usage "$scope_cg")
[ "$ranks_us" -gt 0 ] && [ "$scope_us" -ge "$ranks_us" ] || fail "the scope's CPU time ($scope_us us) does not count its ranks' ($ranks_us us)"
wait "$sjobpid" || { cat /tmp/scoped.out; fail "job $sjob failed after its pause and resume"; }
grep -qxF "$sum" /tmp/scoped.out || { cat /tmp/scoped.out; fail "job $sjob's result is not the serial one ($sum)"; }
echo "job $sjob: ranks stayed in the scope at every step, its limits held, its CPU time counts the ranks' ($ranks_us of $scope_us us); the result is the serial one"

step "systemctl stop mpid: a clean stop"
systemctl stop mpid
[ "$(systemctl is-active mpid)" = inactive ] || fail "mpid is $(systemctl is-active mpid) after stop, want inactive"
# Inactive, the unit may be unloaded, its Result= gone: the journal says
# how it stopped. A clean stop is mpid exiting 0 on SIGTERM; not an exit
# status, a signal, nor a timeout and SIGKILL.
stopped=$(journalctl -u mpid -o cat --no-pager --cursor-file=/tmp/journal.cursor)
grep -qF 'mpid.service: Deactivated successfully.' <<< "$stopped" || fail "mpid did not stop cleanly: $(tail -5 <<< "$stopped")"
! grep -E 'mpid.service: (Main process exited|Failed with result|State .* timed out)' <<< "$stopped" || fail "mpid did not stop cleanly (above)"
journalctl -u mpid -o cat --no-pager | tail -5

priorities_right
echo "mpid's lines in the journal, by priority: $(journalctl -u mpid _COMM=mpid -o json --no-pager | jq -r .PRIORITY | sort | uniq -c | paste -sd ' ')"

step "systemd-analyze security mpid"
systemd-analyze security --no-pager mpid | tail -1
rc=0
step "ok"
