#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prints the Debian mirror debootstrap should take a fresh Debian 12 from:
# $DEBIAN_MIRROR, else the first Debian archive in this machine's apt
# sources (deb822 or one-line; not the security archive). Exits 1 with one
# line when there is none. Used by check-deb.sh and check-systemd.sh.
set -euo pipefail
if [ -n "${DEBIAN_MIRROR:-}" ]; then
	echo "$DEBIAN_MIRROR"
	exit 0
fi
sources=()
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
	[ -f "$f" ] && sources+=("$f")
done
mirror=
[ ${#sources[@]} = 0 ] ||
	mirror=$(awk '($1 == "URIs:" || $1 == "deb") && !found { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\/.*\/debian\/?$/) { print $i; found = 1; break } }' "${sources[@]}")
if [ -z "$mirror" ]; then
	echo "no Debian mirror in the host's apt sources (/etc/apt/sources.list*): set DEBIAN_MIRROR=URL" >&2
	exit 1
fi
echo "$mirror"
