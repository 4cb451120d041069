#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make deb-for SUITE=...: the .deb of this tree for a Debian release, as a
# site of that release gets it, in bin/deb-SUITE/mpipause_VERSION_ARCH.deb.
# mmdebstrap makes a build root of the release (gcc, make, libslurm-dev,
# dpkg-dev); scripts/deb.sh compiles the shim and the Slurm plugin in it,
# against the release's libc and Slurm, and takes the package's library
# dependencies from its dpkg-shlibdeps; mpipause and mpid are built here,
# without cgo (they link no library, so any release runs them).
#
#   deb-for.sh SUITE        SUITE: bullseye (Debian 11), bookworm (12), trixie (13)
#
#   DEBIAN_MIRROR        the mirror (default: the host's apt source for Debian)
#   MPIPAUSE_DEB_CACHE   where the build roots' .debs are kept
#                        (default /var/tmp/mpipause-deb-cache)
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
	echo "deb-for: $*" >&2
	exit 1
}
[ $# = 1 ] || die "usage: deb-for.sh SUITE (bullseye, bookworm, trixie)"
suite=$1
case $suite in
bullseye | bookworm) unitdir=/lib/systemd/system ;;
# Debian 13 ships nothing in /lib (its /usr is merged, and its systemd
# looks in /usr/lib only).
trixie) unitdir=/usr/lib/systemd/system ;;
*) die "unknown suite '$suite' (bullseye, bookworm, trixie)" ;;
esac
[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap --mode=root, chroot)"
command -v mmdebstrap >/dev/null || die "mmdebstrap is missing: run make deps"

mirror=$(scripts/debian-mirror.sh) || die "no Debian mirror (above)"
mirror=${mirror%/}
cache=${MPIPAUSE_DEB_CACHE:-/var/tmp/mpipause-deb-cache}/debs-$suite
mkdir -p "$cache"
root=$(mktemp -d /var/tmp/mpipause-deb-root.XXXXXX)
trap 'rm -rf "$root"' EXIT

SECONDS=0
echo "deb-for: build root of $suite from $mirror"
# shellcheck disable=SC2016 # the hooks' $1 is mmdebstrap's to expand
nice -n 19 mmdebstrap --mode=root --variant=minbase --format=directory \
	--aptopt='APT::Install-Recommends "false"' \
	--include=gcc,libc6-dev,make,libslurm-dev,dpkg-dev \
	--skip=download/empty \
	--setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
	--setup-hook="sync-in $cache /var/cache/apt/archives" \
	--customize-hook="sync-out /var/cache/apt/archives $cache" \
	"$suite" "$root" "deb $mirror $suite main" "deb $mirror $suite-updates main" \
	>"$root.log" 2>&1 || {
	tail -20 "$root.log" >&2
	rm -f "$root.log"
	die "mmdebstrap $suite failed (above)"
}
rm -f "$root.log"
# shellcheck disable=SC2016 # dpkg-query's ${Package} and ${Version}
echo "deb-for: build root in ${SECONDS} s: gcc $(chroot "$root" gcc -dumpfullversion), $(chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' libc6 libslurm-dev | paste -sd ' ')"

DEB_BUILD_ROOT=$root DEB_OUT_DIR=bin/deb-$suite DEB_UNITDIR=$unitdir bash scripts/deb.sh
