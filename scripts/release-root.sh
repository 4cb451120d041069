# SPDX-License-Identifier: Apache-2.0
# shellcheck shell=bash
# Sourced by scripts/deb-for.sh and scripts/apps-for.sh: a build root of a
# Debian release, for compiling against that release's own libraries.
#
# release_root TOOL SUITE PACKAGES: mmdebstrap makes a minbase root of SUITE
# with PACKAGES (comma-separated, no recommends) from the host's Debian
# mirror (DEBIAN_MIRROR overrides it), in $root, which is removed when the
# caller exits. The .debs are kept in MPIPAUSE_DEB_CACHE
# (/var/tmp/mpipause-deb-cache) for the next root of that release. Needs
# root; on a failure it prints the last lines of mmdebstrap's log and exits
# 1, its lines named TOOL.
release_root() {
	local tool=$1 suite=$2 packages=$3 mirror cache
	[ "$(id -u)" = 0 ] || { echo "$tool: needs root (mmdebstrap --mode=root, chroot)" >&2 && exit 1; }
	command -v mmdebstrap >/dev/null || { echo "$tool: mmdebstrap is missing: run make deps" >&2 && exit 1; }
	mirror=$(scripts/debian-mirror.sh) || { echo "$tool: no Debian mirror (above)" >&2 && exit 1; }
	mirror=${mirror%/}
	cache=${MPIPAUSE_DEB_CACHE:-/var/tmp/mpipause-deb-cache}/debs-$suite
	mkdir -p "$cache"
	root=$(mktemp -d "/var/tmp/mpipause-$tool-root.XXXXXX")
	trap 'rm -rf "$root"' EXIT
	echo "$tool: build root of $suite from $mirror"
	# shellcheck disable=SC2016 # the hooks' $1 is mmdebstrap's to expand
	nice -n 19 mmdebstrap --mode=root --variant=minbase --format=directory \
		--aptopt='APT::Install-Recommends "false"' \
		--include="$packages" \
		--skip=download/empty \
		--setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
		--setup-hook="sync-in $cache /var/cache/apt/archives" \
		--customize-hook="sync-out /var/cache/apt/archives $cache" \
		"$suite" "$root" "deb $mirror $suite main" "deb $mirror $suite-updates main" \
		>"$root.log" 2>&1 || {
		tail -20 "$root.log" >&2
		rm -f "$root.log"
		echo "$tool: mmdebstrap $suite failed (above)" >&2
		exit 1
	}
	rm -f "$root.log"
}
