#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make check-matrix: the distribution matrix (docs/vagrant.md, "The
# distribution matrix"). For each suite, a cluster of three VMs booted from
# that Debian release's box (vagrant/build-box.sh --suite), mpipause
# installed the way a site of that release gets it (the .deb of make
# deb-for, its shim and Slurm plugin compiled against the release's own libc
# and Slurm) with the test apps built against the release's own Open MPI and
# MPICH (make apps-for), then vagrant/boot-check.sh --suite: mpid check on
# every node, the cluster e2e with both libraries (every pause read from
# every VM's own kernel, the result compared with an unpaused run), and on
# Debian 13 Slurm 24.11 as well (the Slurm, scope and sbatch e2e). One
# cluster at a time. Prints one table: distribution, kernel, Open MPI,
# MPICH, Slurm, observer mode, pauses clean, result equal, checks.
#
#   matrix.sh [--suites "bullseye bookworm-stock trixie"] [--pauses N] [--logs DIR] [--table]
#
# Each suite's whole output is kept in DIR/matrix-SUITE.log (default
# /var/tmp/mpipause-matrix), its exit status in DIR/matrix-SUITE.rc;
# --table prints the table again from them, running nothing. Exits 1 if
# any suite failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

usage() {
	echo "usage: matrix.sh [--suites \"bullseye bookworm-stock trixie\"] [--pauses N] [--logs DIR] [--table]" >&2
	exit 2
}
suites="bullseye bookworm-stock trixie" pauses=3 logs=/var/tmp/mpipause-matrix table=0
while [ $# -gt 0 ]; do
	case $1 in
	--table) table=1 && shift ;;
	--suites | --pauses | --logs)
		[ $# -ge 2 ] || usage
		case $1 in
		--suites) suites=$2 ;;
		--pauses) pauses=$2 ;;
		--logs) logs=$2 ;;
		esac
		shift 2
		;;
	*) usage ;;
	esac
done
[[ $pauses =~ ^[1-9][0-9]*$ ]] || usage
for s in $suites; do
	case $s in
	bullseye | bookworm | bookworm-stock | trixie) ;;
	*) echo "matrix: unknown suite '$s' (bullseye, bookworm, bookworm-stock, trixie)" >&2 && exit 2 ;;
	esac
done
[ $table = 1 ] || [ "$(id -u)" = 0 ] || { echo "matrix: needs root (the build roots, libvirt)" >&2 && exit 1; }
mkdir -p "$logs"
say() { echo "check-matrix: [$(date +%T)] $*"; }

# stage RELEASE: vagrant/.prebuilt holds RELEASE's .deb and test apps,
# and says for which release (boot-check.sh checks it against the box).
stage() {
	local r=$1 deb
	bash scripts/deb-for.sh "$r" && bash scripts/apps-for.sh "$r" || return 1
	# The newest: deb-for leaves the .debs of earlier commits beside it.
	# shellcheck disable=SC2012 # the names are mpipause_VERSION_ARCH.deb
	deb=$(ls -t "bin/deb-$r"/mpipause_*.deb | head -1)
	rm -rf vagrant/.prebuilt && mkdir -p vagrant/.prebuilt/apps
	cp "$deb" "bin/apps-$r/libucxfinalize.so" vagrant/.prebuilt/
	find "bin/apps-$r" -maxdepth 1 -type f ! -name libucxfinalize.so -exec cp {} vagrant/.prebuilt/apps/ \;
	echo "$r" >vagrant/.prebuilt/release
}

# row SUITE LOG RC: the table's line for one suite, from its log. A pause
# is clean when it committed with every connection empty in every VM's
# kernel; a suspend's pause that Slurm's SIGSTOP overtook (rolled back,
# the job stopped as without mpipause: docs/slurm.md) counts as not clean.
row() {
	local suite=$1 log=$2 rc=$3 v kernel ompi mpich slurm obs clean lost equal checks
	v=$(grep -m1 'versions on node0' "$log" | sed 's/.*versions on node0 ([^)]*): //')
	field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" <<<"$v"; }
	kernel=$(field kernel) ompi=$(field openmpi-bin) mpich=$(field mpich) slurm=$(field slurmd)
	# mpid check's observer row (node0's, as provisioned): its mode and
	# the programs it runs.
	obs=$(grep -m1 -E '^ +observer +[a-z]+ +mode ' "$log" | sed -E 's/^ +observer +[a-z]+ +mode //')
	clean=$(grep -cE 'PASS .*: (pause [0-9]+ committed|(suspend|preempt) [0-9]+: paused within)' "$log")
	lost=$(grep -cE 'PASS .*(SIGSTOP came before the pause committed|resumed \(after a pause that failed)' "$log")
	equal=$(grep -cE 'PASS .*the same (result )?as an unpaused run' "$log")
	checks=$(grep -oE '\] [0-9]+ passed, [0-9]+ failed' "$log" | sed 's/^\] //' | paste -sd ';' | sed 's/;/; /g')
	printf '| Debian %s | %s | %s | %s | %s | %s | %s of %s | %s jobs | %s | %s |\n' \
		"$suite" "${kernel:-?}" "${ompi:-?}" "${mpich:-?}" "${slurm:-?}" "${obs:-?}" "$clean" "$((clean + lost))" "$equal" \
		"${checks:-none}" "$([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)")"
}

rows=() failed=0 start=$SECONDS
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
for s in $suites; do
	r=${s%-stock}
	log=$logs/matrix-$s.log
	if [ $table = 1 ]; then
		rc=$(cat "$logs/matrix-$s.rc" 2>/dev/null || echo "no run")
		[ "$rc" = 0 ] || failed=1
		rows+=("$(row "$s" "$log" "$rc")")
		continue
	fi
	flags=()
	# Slurm where the issue's matrix wants it: Debian 13's 24.11 with
	# cgroup/v2 (Debian 12's 22.05 is make test's own cluster).
	[ "$s" != trixie ] || flags=(--slurm --sbatch-too)
	# The observer 5.10 allows (docs/guarantees.md, "On older kernels")
	# beside the full one, on the same VMs: on Debian 12's own 6.1.
	[ "$s" != bookworm-stock ] || flags=(--degraded "sockstat,tcpiter,conniter")
	say "$s: staging Debian $r's .deb and test apps in vagrant/.prebuilt"
	if ! stage "$r" >"$log" 2>&1; then
		tail -5 "$log" >&2
		echo staging >"$logs/matrix-$s.rc"
		rows+=("| Debian $s | | | | | | | | | FAILED (staging, $log) |")
		failed=1
		continue
	fi
	say "$s: vagrant/boot-check.sh --suite $s ${flags[*]} -- --pauses $pauses (log $log)"
	t=$SECONDS
	bash vagrant/boot-check.sh --suite "$s" "${flags[@]}" -- --pauses "$pauses" 2>&1 | tee -a "$log" |
		grep --line-buffered -E 'check-vagrant-boot: |PASS|FAIL|passed, '
	rc=${PIPESTATUS[0]}
	say "$s: exit $rc after $((SECONDS - t)) s"
	echo "$rc" >"$logs/matrix-$s.rc"
	[ "$rc" = 0 ] || failed=1
	rows+=("$(row "$s" "$log" "$rc")")
done

echo
echo "check-matrix: commit $commit, $(date -u +%Y-%m-%d), $((SECONDS - start)) s; logs in $logs"
echo "| distribution | kernel | Open MPI | MPICH | Slurm | observer | pauses clean | result equal | e2e checks, in order | |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
for s in $suites; do
	grep -h 'pause times at node0' "$logs/matrix-$s.log" 2>/dev/null | sed "s/.*pause times at node0/Debian $s: pause times at node0/"
done
exit $failed
