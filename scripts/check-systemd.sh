#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make check-systemd: mpid's unit (dist/systemd/mpid.service), sandbox and
# all, under a real systemd. Boots a fresh Debian 12 (debootstrap, minbase,
# from Debian's mirror, with systemd and Open MPI) with systemd-nspawn,
# systemd its PID 1; scripts/check-systemd-inside.sh then runs there as a
# service: installs the .deb that make deb built with apt, starts mpid with
# systemctl, pauses a 2-rank Open MPI job through it, kills it (systemd
# restarts it) and resumes the job through the new one. Fails,
# never skips; leaves nothing behind (the container, its root, its cgroups
# and its mounts go; the host's network is never touched: the container has
# a network namespace of its own, loopback only).
#
#   DEBIAN_MIRROR   the mirror debootstrap takes Debian from (default: the
#                   host's apt source for Debian)
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
	echo "check-systemd: FAIL: $*" >&2
	exit 1
}
[ "$(id -u)" = 0 ] || fail "needs root (debootstrap, systemd-nspawn)"
for tool in debootstrap systemd-nspawn unshare timeout; do
	command -v "$tool" >/dev/null || fail "$tool is missing: run make deps"
done
deb=bin/mpipause_$(scripts/version.sh)_$(dpkg --print-architecture).deb
[ -f "$deb" ] || fail "no $deb: run make deb"
xchg=bin/apps/xchg.openmpi
[ -x "$xchg" ] || fail "no $xchg: run make build"

mirror=$(scripts/debian-mirror.sh) || fail "no Debian mirror to debootstrap from (above)"

# The cgroup v2 hierarchy, wherever it is mounted (/sys/fs/cgroup, or
# /sys/fs/cgroup/unified on a hybrid host): the container's systemd runs in
# a cgroup of this check's own there (nspawn makes its "payload" and
# "supervisor" under it), a cgroup namespace its root.
cgroup2=$(awk '{ for (i = 7; i <= NF; i++) if ($i == "-") break; if ($(i + 1) == "cgroup2" && $4 == "/") { print $5; exit } }' /proc/self/mountinfo)
[ -n "$cgroup2" ] || fail "no cgroup v2 hierarchy mounted (/proc/self/mountinfo): mpid and the container's systemd need one"

work=$(mktemp -d /var/tmp/mpipause-check-systemd.XXXXXX)
root=$work/root
cg=$cgroup2/$(basename "$work")
cleanup() {
	local rc=$?
	if [ -d "$cg" ]; then
		# Whatever is left of the container dies with its cgroups.
		[ ! -e "$cg/cgroup.kill" ] || echo 1 > "$cg/cgroup.kill" || true
		for _ in $(seq 50); do
			find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
			[ -d "$cg" ] || break
			sleep 0.1
		done
		[ ! -d "$cg" ] || { echo "check-systemd: $cg is still there" >&2; rc=1; }
	fi
	# The mounts live in the namespace of the unshare below and die with
	# it; never remove a tree that still has one.
	if grep -q " $work/" /proc/mounts; then
		echo "check-systemd: $work still has mounts; not removing it" >&2
		exit 1
	fi
	rm -rf "$work"
	exit "$rc"
}
trap cleanup EXIT

echo "check-systemd: debootstrap a fresh Debian 12 (bookworm, minbase, systemd, Open MPI) from $mirror"
start=$SECONDS
# capsh: mpid's capabilities by name; jq: mpipause's --json.
debootstrap --variant=minbase --include=systemd,systemd-sysv,openmpi-bin,libcap2-bin,jq \
	bookworm "$root" "$mirror" > "$work/debootstrap.log" 2>&1 ||
	{ tail -20 "$work/debootstrap.log" >&2; fail "debootstrap"; }
echo "check-systemd: debootstrap took $((SECONDS - start)) s"
start=$SECONDS

cp "$deb" "$xchg" scripts/check-systemd-inside.sh "$root/root/"
# A host name of its own that resolves, as Debian's installer sets it up:
# mpid dials the job's nodes by name, this one too.
echo mpipause-check > "$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tmpipause-check\n' > "$root/etc/hosts"
# The check runs as a service once the boot is done, its output on the
# container's console (here) and in its journal.
cat > "$root/etc/systemd/system/mpipause-check.service" << EOF
[Unit]
Description=make check-systemd: mpid under this systemd
After=multi-user.target

[Service]
Type=exec
ExecStart=/bin/bash /root/check-systemd-inside.sh /root/$(basename "$deb") /root/$(basename "$xchg")
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
EOF
ln -s ../mpipause-check.service "$root/etc/systemd/system/multi-user.target.wants/"
# No login prompt on that console, nor the status lines of boot and shutdown.
ln -s /dev/null "$root/etc/systemd/system/console-getty.service"
mkdir -p "$root/etc/systemd/system.conf.d"
printf '[Manager]\nShowStatus=no\n' > "$root/etc/systemd/system.conf.d/check-systemd.conf"

mkdir "$cg" "$work/bpf"
# systemd-nspawn, in the cgroup made for it, in a mount namespace of its
# own with a bpffs of its own (gone with it) bound on the container's
# /sys/fs/bpf, where systemd would have mounted one on a host:
#   SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1  the container gets the cgroup v2
#       hierarchy alone, as mpid wants it (the host may be hybrid)
#   --register=no --keep-unit  the host needs no systemd nor machined
#   --private-network  loopback only: the host's network stays untouched
#   --capability  CAP_BPF and CAP_PERFMON, which nspawn keeps from its
#       containers by default; mpid's unit takes its six from those
#   --system-call-filter=bpf  nspawn's own filter refuses bpf(2) (EPERM)
#       to every process of the container, systemd and mpid's unit too
#   a tmpfs on /run: nspawn's /run/systemd/nspawn stays out of the host's
#   the container's exit status is the check's: systemctl exit in it.
rc=0
(
	echo "$BASHPID" > "$cg/cgroup.procs"
	exec unshare --mount --propagation private -- bash -c 'mount -t bpf bpf "$1" && mount -t tmpfs tmpfs /run && shift && exec "$@"' _ "$work/bpf" \
		env SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 timeout -k 10 240 \
		systemd-nspawn --quiet --directory="$root" --machine=mpipause-check --register=no --keep-unit \
		--private-network --capability=CAP_BPF,CAP_PERFMON --system-call-filter=bpf \
		--bind="$work/bpf:/sys/fs/bpf" --console=read-only --boot < /dev/null
) || rc=$?
echo "check-systemd: the container ran $((SECONDS - start)) s"
[ "$rc" = 0 ] || fail "in the container (above): exit $rc"
echo "check-systemd: ok in $SECONDS s (mpid's unit, sandbox and all, under systemd $(systemd-nspawn --version | awk 'NR == 1 { print $2 }') as PID 1: started, served, paused a 2-rank Open MPI job, restarted after a SIGKILL, resumed the job, stopped)"
