#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# Runs inside a fresh Debian root (scripts/check-deb.sh: Debian 12;
# scripts/check-deb-for.sh: the release of make deb-for), as root, without
# systemd running: installs the .deb ($1) with apt, checks that it works,
# then removes and purges it and checks that nothing of it is left. Twice:
# without a cluster key (mpid left disabled, the postinst says how to make
# one), and with one (mpid enabled).
set -euo pipefail
deb=$1
export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8

fail() {
	echo "check-deb (in Debian $(cat /etc/debian_version)): FAIL: $*" >&2
	exit 1
}
step() { echo "check-deb: [${SECONDS}s] $*"; }
wants=/etc/systemd/system/multi-user.target.wants/mpid.service
key=/etc/mpipause/cluster.key

step "apt-get update; install man-db (as on most machines) to check the pages"
apt-get update -q > /tmp/apt.log 2>&1 || { cat /tmp/apt.log; fail "apt-get update"; }
apt-get install -y -q --no-install-recommends man-db > /tmp/apt.log 2>&1 || { cat /tmp/apt.log; fail "apt-get install man-db"; }

# The Recommends resolve in this Debian: apt would bring an MPI.
apt-get install -s "$deb" > /tmp/apt.log 2>&1 || { cat /tmp/apt.log; fail "apt-get install -s $deb"; }
grep -Eq '^Inst (openmpi-bin|mpich) ' /tmp/apt.log || { cat /tmp/apt.log; fail "apt would not install openmpi-bin or mpich (Recommends)"; }

step "apt-get install $deb (no cluster key yet)"
apt-get install -y -q --no-install-recommends "$deb" > /tmp/install.log 2>&1 || { cat /tmp/install.log; fail "apt-get install $deb"; }
[ "$(dpkg-query -W -f='${Status}' mpipause)" = "install ok installed" ] || fail "mpipause is not installed: $(dpkg-query -W -f='${Status}' mpipause)"
grep -q "mpid keygen" /tmp/install.log || { cat /tmp/install.log; fail "the postinst does not say how to make the cluster key"; }
[ ! -e "$wants" ] || fail "mpid was enabled without a cluster key"
dpkg -L mpipause > /tmp/files

step "mpipause --help, mpid --help, mpid keygen --help, mpid check --help, --version, man -w"
# Output into a variable first: grep -q would stop reading early, and
# pipefail would count the writer's SIGPIPE as a failure.
help=$(mpipause --help) && [[ $help == "usage: mpipause"* ]] || fail "mpipause --help: $help"
help=$(mpid --help) && [[ $help == "usage: mpid"* ]] || fail "mpid --help: $help"
help=$(mpid keygen --help) && [[ $help == "usage: mpid keygen"* ]] || fail "mpid keygen --help: $help"
help=$(mpid check --help) && [[ $help == "usage: mpid check"* ]] || fail "mpid check --help: $help"
# The commands say the package's version.
pkg=$(dpkg-query -W -f='${Version}' mpipause)
[ "$(mpipause --version)" = "mpipause $pkg" ] || fail "mpipause --version: $(mpipause --version 2>&1); the package is $pkg"
[ "$(mpid --version)" = "mpid $pkg" ] || fail "mpid --version: $(mpid --version 2>&1); the package is $pkg"
[ "$(man -w mpipause)" = /usr/share/man/man1/mpipause.1.gz ] || fail "man -w mpipause: $(man -w mpipause 2>&1)"
[ "$(man -w 8 mpid)" = /usr/share/man/man8/mpid.8.gz ] || fail "man -w 8 mpid: $(man -w 8 mpid 2>&1)"
page=$(MANWIDTH=80 man mpid 2>&1) && [[ $page == *"mpid keygen"* ]] || fail "man mpid does not render mpid keygen: $page"
# mpipause run finds the packaged shim: with no mpid to ask (a network
# namespace of its own), it stops there, exit 6, not at the shim (exit 2).
rc=0
out=$(unshare -n mpipause run --launcher openmpi -- true 2>&1) || rc=$?
[ "$rc" = 6 ] && [[ $out == *"no mpid at"* ]] || fail "mpipause run: exit $rc ($out), want 6 (no mpid): no shim?"
# mpid refuses to start without a key, and says how to make one.
rc=0
out=$(mpid 2>&1) || rc=$?
[ "$rc" = 2 ] && [[ $out == *"mpid keygen"* ]] || fail "mpid without a key: exit $rc ($out), want 2 and how to make a key"

step "mpid keygen"
mpid keygen > /tmp/keygen.log 2>&1 || { cat /tmp/keygen.log; fail "mpid keygen"; }
[ -s "$key" ] && [ "$(stat -c %a "$key")" = 600 ] || fail "mpid keygen: $key missing, empty or not mode 0600"
sum=$(md5sum < "$key")
if mpid keygen > /dev/null 2>&1; then fail "a second mpid keygen overwrote $key"; fi
[ "$(md5sum < "$key")" = "$sum" ] || fail "a second mpid keygen changed $key"

purge_clean() {
	apt-get purge -y -q mpipause > /tmp/purge.log 2>&1 || { cat /tmp/purge.log; fail "apt-get purge mpipause"; }
	local status
	status=$(dpkg-query -W -f='${Status}' mpipause 2>/dev/null || true)
	case $status in
	"" | *not-installed) ;;
	*) fail "after purge, dpkg says: $status" ;;
	esac
	while read -r f; do
		[ -d "$f" ] && continue
		[ ! -e "$f" ] || fail "after purge, $f is still there"
	done < /tmp/files
	[ ! -e /etc/mpipause ] || fail "after purge, /etc/mpipause is still there: $(ls -A /etc/mpipause)"
	local left
	# (/var/cache/man is man-db's cache of formatted pages, not the
	# package's: Debian 11's man writes the page there when it is read.)
	left=$(find / -xdev \( -path /proc -o -path /tmp -o -path /var/cache/man \) -prune -o \( -name '*mpipause*' -o -name 'mpid*' \) -print)
	[ -z "$left" ] || fail "after purge, left behind: $left"
}

step "apt-get purge: every file goes, the conffile and the cluster key too"
purge_clean

step "apt-get install with a cluster key in place: mpid is enabled"
mkdir -p /etc/mpipause
head -c 32 /dev/urandom > "$key"
chmod 0600 "$key"
apt-get install -y -q --no-install-recommends "$deb" > /tmp/install.log 2>&1 || { cat /tmp/install.log; fail "apt-get install $deb"; }
! grep -q "mpid keygen" /tmp/install.log || fail "the postinst asks for a cluster key that exists"
# (/usr/lib where the package puts the unit there: Debian 13's.)
case $(readlink "$wants") in
/lib/systemd/system/mpid.service | /usr/lib/systemd/system/mpid.service) ;;
*) fail "mpid is not enabled ($wants: $(readlink "$wants"))" ;;
esac

step "apt-get remove keeps the config, purge then removes everything"
apt-get remove -y -q mpipause > /tmp/remove.log 2>&1 || { cat /tmp/remove.log; fail "apt-get remove mpipause"; }
[ -e /etc/mpipause/mpid.conf ] && [ -e "$key" ] || fail "apt-get remove removed the configuration"
[ ! -e /usr/sbin/mpid ] || fail "apt-get remove left /usr/sbin/mpid"
purge_clean
[ ! -e "$wants" ] || fail "after purge, mpid is still enabled ($wants)"

step "ok"
