#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make check-deb: the .deb that make deb built passes lintian (no error, no
# warning), and on a fresh Debian 12 made here with debootstrap (minbase,
# from Debian's mirror) installs with apt, works, and purges without a trace
# (scripts/check-deb-inside.sh runs inside it). Fails, never skips.
#
#   DEBIAN_MIRROR   the mirror debootstrap takes Debian from (default: the
#                   host's apt source for Debian)
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
	echo "check-deb: FAIL: $*" >&2
	exit 1
}
[ "$(id -u)" = 0 ] || fail "needs root (debootstrap, chroot)"
for tool in lintian debootstrap dpkg-deb unshare chroot; do
	command -v "$tool" >/dev/null || fail "$tool is missing: run make deps"
done
deb=bin/mpipause_$(scripts/version.sh)_$(dpkg --print-architecture).deb
[ -f "$deb" ] || fail "no $deb: run make deb"

echo "check-deb: lintian $deb"
# --fail-on: an error or a warning fails; info and pedantic tags do not.
rc=0
out=$(lintian --no-cfg --fail-on error,warning "$deb" 2>&1) || rc=$?
grep -v 'running with root privileges' <<< "$out" || true
[ "$rc" = 0 ] || fail "lintian reports errors or warnings (above), exit $rc"

mirror=$(scripts/debian-mirror.sh) || fail "no Debian mirror to debootstrap from (above)"

root=$(mktemp -d /var/tmp/mpipause-check-deb.XXXXXX)
cleanup() {
	# The mounts live in the namespace of the unshare below and die with
	# it; never remove a tree that still has one.
	if grep -q " $root/" /proc/mounts; then
		echo "check-deb: $root still has mounts; not removing it" >&2
		return
	fi
	rm -rf "$root"
}
trap cleanup EXIT

echo "check-deb: debootstrap a fresh Debian 12 (bookworm, minbase) from $mirror"
start=$SECONDS
debootstrap --variant=minbase bookworm "$root" "$mirror" > "$root.log" 2>&1 ||
	{ tail -20 "$root.log" >&2; rm -f "$root.log"; fail "debootstrap"; }
rm -f "$root.log"
echo "check-deb: debootstrap took $((SECONDS - start)) s"
start=$SECONDS

cp "$deb" "$root/tmp/"
cp scripts/check-deb-inside.sh "$root/tmp/"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# A mount namespace of its own: /proc for dpkg's scripts, gone when done.
unshare --mount --propagation private --fork -- bash -c '
	mount -t proc proc "$1/proc"
	exec chroot "$1" /bin/bash /tmp/check-deb-inside.sh "/tmp/$2"
' _ "$root" "$(basename "$deb")" || fail "on a fresh Debian 12 (above)"
echo "check-deb: in the fresh Debian 12: $((SECONDS - start)) s"
echo "check-deb: ok in $SECONDS s ($deb: lintian clean; installs, works and purges clean on a fresh Debian 12)"
