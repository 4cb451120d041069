#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make deb: builds bin/mpipause_VERSION_ARCH.deb from exactly what
# `make install` installs (into a staging directory), plus what Debian asks
# of a package: stripped binaries, the copyright file (with the license of
# every Go module linked into the binaries, read from the binaries
# themselves) and a changelog, DEBIAN/ from dist/deb/, the library
# dependencies from dpkg-shlibdeps, the conffiles from what is under /etc.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin
umask 022

make=${MAKE:-make}
maintainer=${DEB_MAINTAINER:-mpipause maintainers <maintainers@mpipause.org>}
version=$(scripts/version.sh)
arch=$(dpkg --print-architecture)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || stat -c %Y VERSION)}
out=bin/mpipause_${version}_${arch}.deb

work=$(mktemp -d /tmp/mpipause-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/root

"$make" -s install DESTDIR="$root" PREFIX=/usr >/dev/null

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
depends=$(cd "$work/src" && dpkg-shlibdeps -O -e"$root/usr/bin/mpipause" -e"$root/usr/sbin/mpid" \
	"${libs[@]/#/-e}" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
if [ -z "$depends" ]; then
	echo "deb: dpkg-shlibdeps found no library dependencies (the binaries link libc)" >&2
	exit 1
fi

install -d "$root/DEBIAN"
sed -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" -e "s|@MAINTAINER@|$maintainer|" \
	-e "s|@INSTALLED_SIZE@|$(du -sk --apparent-size "$root" | cut -f1)|" -e "s|@DEPENDS@|$depends|" \
	dist/deb/control > "$root/DEBIAN/control"
install -m 0755 dist/deb/postinst dist/deb/prerm dist/deb/postrm "$root/DEBIAN/"
(cd "$root" && find etc -type f | sort | sed 's|^|/|') > "$root/DEBIAN/conffiles"
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) > "$root/DEBIAN/md5sums"

rm -f bin/mpipause_*.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$out" >/dev/null
echo "deb: $out ($depends)"
