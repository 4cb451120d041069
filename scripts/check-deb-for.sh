#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make check-deb-for SUITE=...: the .deb that make deb-for built for a
# Debian release (bin/deb-SUITE/) passes lintian (this host's), depends
# only on what that release has, and on a fresh root of it made here with
# mmdebstrap (minbase, from Debian's mirror) installs with apt, works, and
# purges without a trace (scripts/check-deb-inside.sh runs inside it, as
# for make check-deb).
#
#   check-deb-for.sh SUITE     SUITE: bullseye, bookworm, trixie
#
#   DEBIAN_MIRROR   the mirror (default: the host's apt source for Debian)
# shellcheck disable=SC2016 # dpkg-query's formats and the inner shells' $1 and $2
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
	echo "check-deb-for: FAIL: $*" >&2
	exit 1
}
[ $# = 1 ] || fail "usage: check-deb-for.sh SUITE"
suite=$1
[ "$(id -u)" = 0 ] || fail "needs root (mmdebstrap --mode=root, chroot)"
for tool in mmdebstrap dpkg-deb lintian unshare chroot; do
	command -v "$tool" >/dev/null || fail "$tool is missing: run make deps"
done
deb=bin/deb-$suite/mpipause_$(scripts/version.sh)_$(dpkg --print-architecture).deb
[ -f "$deb" ] || fail "no $deb: run make deb-for SUITE=$suite"
# --fail-on: an error or a warning fails, as for make check-deb.
rc=0
out=$(lintian --no-cfg --fail-on error,warning "$deb" 2>&1) || rc=$?
grep -v 'running with root privileges' <<< "$out" || true
[ "$rc" = 0 ] || fail "lintian reports errors or warnings (above), exit $rc"
echo "check-deb-for: lintian $deb: no error, no warning"
depends=$(dpkg-deb -f "$deb" Depends)
echo "check-deb-for: $deb: Depends: $depends"

mirror=$(scripts/debian-mirror.sh) || fail "no Debian mirror (above)"
mirror=${mirror%/}
root=$(mktemp -d /var/tmp/mpipause-check-deb-for.XXXXXX)
cleanup() {
	# The mounts live in the namespace of the unshare below and die with
	# it; never remove a tree that still has one.
	if grep -q " $root/" /proc/mounts; then
		echo "check-deb-for: $root still has mounts; not removing it" >&2
		return
	fi
	rm -rf "$root"
}
trap cleanup EXIT

echo "check-deb-for: mmdebstrap a fresh $suite (minbase) from $mirror"
start=$SECONDS
nice -n 19 mmdebstrap --mode=root --variant=minbase --format=directory "$suite" "$root" \
	"deb $mirror $suite main" "deb $mirror $suite-updates main" >"$root.log" 2>&1 ||
	{ tail -20 "$root.log" >&2; rm -f "$root.log"; fail "mmdebstrap $suite"; }
rm -f "$root.log"
echo "check-deb-for: mmdebstrap took $((SECONDS - start)) s; $(chroot "$root" dpkg-query -W -f='${Package} ${Version}' libc6)"

# Every library the package names is one this release has, in a version it has.
chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' > "$root.have"
IFS=, read -ra deps <<< "$depends"
for d in "${deps[@]}"; do
	d=${d# }
	pkg=${d%% *}
	have=$(awk -v p="$pkg" '$1 == p { print $2 }' "$root.have")
	[ -n "$have" ] || { rm -f "$root.have"; fail "Depends: $pkg is not in a fresh $suite"; }
	if [[ $d =~ \((\>=|\>\>|=)\ ([^\)]+)\) ]]; then
		dpkg --compare-versions "$have" "${BASH_REMATCH[1]/>>/gt}" "${BASH_REMATCH[2]}" ||
			{ rm -f "$root.have"; fail "Depends: $d, but $suite has $pkg $have"; }
	fi
	echo "check-deb-for: Depends $d: $suite has $pkg $have"
done
rm -f "$root.have"

start=$SECONDS
cp "$deb" "$root/tmp/"
cp scripts/check-deb-inside.sh "$root/tmp/"
cp /etc/resolv.conf "$root/etc/resolv.conf"
unshare --mount --propagation private --fork -- bash -c '
	mount -t proc proc "$1/proc"
	exec chroot "$1" /bin/bash /tmp/check-deb-inside.sh "/tmp/$2"
' _ "$root" "$(basename "$deb")" || fail "on a fresh $suite (above)"
echo "check-deb-for: in the fresh $suite: $((SECONDS - start)) s"
echo "check-deb-for: ok in $SECONDS s ($deb: installs, works and purges clean on a fresh $suite)"
