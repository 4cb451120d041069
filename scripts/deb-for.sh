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
# shellcheck source=scripts/release-root.sh
. scripts/release-root.sh
SECONDS=0
release_root deb-for "$suite" gcc,libc6-dev,make,libslurm-dev,dpkg-dev
# shellcheck disable=SC2016 # dpkg-query's ${Package} and ${Version}
echo "deb-for: build root in ${SECONDS} s: gcc $(chroot "$root" gcc -dumpfullversion), $(chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' libc6 libslurm-dev | paste -sd ' ')"

DEB_BUILD_ROOT=$root DEB_OUT_DIR=bin/deb-$suite DEB_UNITDIR=$unitdir bash scripts/deb.sh
