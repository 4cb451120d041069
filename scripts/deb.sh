#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make deb: builds bin/mpipause_VERSION_ARCH.deb from exactly what
# `make install` installs (into a staging directory), plus what Debian asks
# of a package: stripped binaries, the copyright file (with the license of
# every Go module linked into the binaries, read from the binaries
# themselves) and a changelog, DEBIAN/ from dist/deb/, the library
# dependencies from dpkg-shlibdeps, the conffiles from what is under /etc.
#
# For another Debian release (scripts/deb-for.sh, make deb-for):
#   DEB_BUILD_ROOT  a root tree of that release with gcc, make, libslurm-dev
#                   and dpkg-dev: the shim and the Slurm plugin are compiled
#                   in it (against its libc and spank.h) and dpkg-shlibdeps
#                   runs in it (its libc's version is what the package
#                   needs); mpipause and mpid are built here without cgo,
#                   so they link no library at all
#   DEB_OUT_DIR     where the .deb goes (default bin)
#   DEB_UNITDIR     where mpid's unit goes (default /lib/systemd/system)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin
umask 022

make=${MAKE:-make}
maintainer=${DEB_MAINTAINER:-mpipause maintainers <maintainers@mpipause.org>}
version=$(scripts/version.sh)
arch=$(dpkg --print-architecture)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || stat -c %Y VERSION)}
out_dir=${DEB_OUT_DIR:-bin}
out=$out_dir/mpipause_${version}_${arch}.deb
build_root=${DEB_BUILD_ROOT:-}

work=$(mktemp -d /tmp/mpipause-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/root

make_args=(install DESTDIR="$root" PREFIX=/usr)
[ -z "${DEB_UNITDIR:-}" ] || make_args+=(UNITDIR="$DEB_UNITDIR")
if [ -n "$build_root" ]; then
	# The Go binaries without cgo (they call no C): nothing of this host's
	# libc in them. Built into a directory of this run, not bin/.
	export CGO_ENABLED=0
	make_args+=(BIN="$work/bin")
fi
"$make" -s "${make_args[@]}" >/dev/null

if [ -n "$build_root" ]; then
	[ -f "$build_root/usr/include/slurm/spank.h" ] || { echo "deb: no spank.h in $build_root (libslurm-dev)" >&2; exit 1; }
	# The C parts, compiled by the release's own gcc against its headers.
	rm -rf "$build_root/tmp/mpipause-src"
	mkdir -p "$build_root/tmp/mpipause-src"
	cp -r libmpi-shim slurm "$build_root/tmp/mpipause-src/"
	chroot "$build_root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin sh -ec '
		make -s -C /tmp/mpipause-src/libmpi-shim OUT=/tmp/mpipause-src/out
		make -s -C /tmp/mpipause-src/slurm OUT=/tmp/mpipause-src/out' >/dev/null
	install -m 0644 "$build_root/tmp/mpipause-src/out/libmpipause.so" "$build_root/tmp/mpipause-src/out/mpipause_spank.so" \
		"$root/usr/lib/mpipause/"
fi

# As dh_strip does: the symbols go, the code stays byte for byte.
strip --remove-section=.comment --remove-section=.note "$root/usr/bin/mpipause" "$root/usr/sbin/mpid"
libs=("$root"/usr/lib/mpipause/*.so) # the shim, and the Slurm plugin when built
strip --remove-section=.comment --remove-section=.note --strip-unneeded "${libs[@]}"

doc=$root/usr/share/doc/mpipause
install -d "$doc"
{
	cat <<EOF
mpipause: consistent pause and resume of multi-node MPI jobs.

Copyright: the mpipause authors.
License: Apache-2.0; on Debian its text is in /usr/share/common-licenses/Apache-2.0.

The BPF programs built into mpipause and mpid (bpf/ in the source) are
licensed GPL-2.0-only OR BSD-2-Clause; the GPL-2.0 text is in
/usr/share/common-licenses/GPL-2, the BSD-2-Clause text follows.

$(cat bpf/LICENSE.BSD-2-Clause)

mpipause and mpid are Go programs: they contain the Go standard library and
the Go modules listed below, each under the license that follows its name.

--- Go standard library ($(go version "$root/usr/sbin/mpid" | awk '{print $2}'))

$(cat "$(go env GOROOT)/LICENSE")
EOF
	# The modules the binaries say they contain, not a list kept by hand.
	for m in $( (go version -m "$root/usr/bin/mpipause"; go version -m "$root/usr/sbin/mpid") |
		awk '$1 == "dep" { print $2 "@" $3 }' | sort -u); do
		lics=("$(go env GOMODCACHE)/$m"/LICENSE*)
		lic=${lics[0]}
		if [ ! -f "$lic" ]; then
			echo "deb: no LICENSE file for Go module $m in the module cache" >&2
			exit 1
		fi
		printf '\n--- Go module %s %s\n\n' "${m%@*}" "${m#*@}"
		if grep -q 'Apache License' "$lic" && grep -q 'Version 2.0' "$lic"; then
			# Debian keeps this text once, in common-licenses.
			grep -E '^\s*Copyright (\(c\) )?[0-9]' "$lic" | sed 's/^\s*//' || true
			echo "License: Apache-2.0; on Debian its text is in /usr/share/common-licenses/Apache-2.0."
		else
			cat "$lic"
		fi
	done
} > "$doc/copyright"

# A native package's changelog: which commit this is.
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo "a source tarball")
cat > "$work/changelog" <<EOF
mpipause ($version) unstable; urgency=medium

  * Built from commit $commit of mpipause.

 -- $maintainer  $(date -u -R -d "@$SOURCE_DATE_EPOCH")
EOF
gzip -9n -c "$work/changelog" > "$doc/changelog.gz"

# dpkg-shlibdeps reads debian/control of a source package: give it one.
mkdir -p "$work/src/debian"
printf 'Source: mpipause\n\nPackage: mpipause\nArchitecture: any\n' > "$work/src/debian/control"
# (The Slurm plugin's spank_* symbols come from slurmstepd, which loads it:
# dpkg-shlibdeps says so on stderr, and rightly adds no dependency.)
if [ -z "$build_root" ]; then
	depends=$(cd "$work/src" && dpkg-shlibdeps -O -e"$root/usr/bin/mpipause" -e"$root/usr/sbin/mpid" \
		"${libs[@]/#/-e}" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
else
	# In the release's root: its dpkg's record of its libraries' versions.
	rm -rf "$build_root/tmp/mpipause-stage"
	cp -a "$work/src" "$build_root/tmp/mpipause-stage"
	cp -a "$root" "$build_root/tmp/mpipause-stage/root"
	# shellcheck disable=SC2016 # the $f and $@ are the chroot's shell's
	depends=$(chroot "$build_root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin sh -c '
		cd /tmp/mpipause-stage && set -- && for f in root/usr/lib/mpipause/*.so; do set -- "$@" "-e$f"; done &&
		dpkg-shlibdeps -O -eroot/usr/bin/mpipause -eroot/usr/sbin/mpid "$@"' \
		2>/dev/null | sed -n 's/^shlibs:Depends=//p')
	rm -rf "$build_root/tmp/mpipause-stage" "$build_root/tmp/mpipause-src"
fi
if [ -z "$depends" ]; then
	echo "deb: dpkg-shlibdeps found no library dependencies (the binaries link libc)" >&2
	exit 1
fi

if [ -n "$build_root" ]; then
	# Go's own PIEs without cgo need no library, not even libc: lintian
	# takes a PIE without one for a shared library that lacks its own.
	install -d "$root/usr/share/lintian/overrides"
	printf 'mpipause: shared-library-lacks-prerequisites [%s]\n' usr/bin/mpipause usr/sbin/mpid \
		>"$root/usr/share/lintian/overrides/mpipause"
fi

install -d "$root/DEBIAN"
sed -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" -e "s|@MAINTAINER@|$maintainer|" \
	-e "s|@INSTALLED_SIZE@|$(du -sk --apparent-size "$root" | cut -f1)|" -e "s|@DEPENDS@|$depends|" \
	dist/deb/control > "$root/DEBIAN/control"
install -m 0755 dist/deb/postinst dist/deb/prerm dist/deb/postrm "$root/DEBIAN/"
(cd "$root" && find etc -type f | sort | sed 's|^|/|') > "$root/DEBIAN/conffiles"
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) > "$root/DEBIAN/md5sums"

mkdir -p "$out_dir"
rm -f "$out_dir"/mpipause_*.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$out" >/dev/null
echo "deb: $out ($depends)"
