#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make check-install: `make install DESTDIR=tmp` installs exactly the expected
# files with the expected modes, for PREFIX=/usr and /usr/local; the unit
# starts the mpid that was installed; the installed mpipause finds the
# installed shim; the man pages lint clean (groff -ww, mandoc -Tlint); a
# second install keeps a changed config; uninstall removes everything but a
# changed config; and install and uninstall without DESTDIR (on overlays of
# /usr and /etc, the host untouched) leave mpid enabled by nobody. Fails,
# never skips; needs root (mount namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
make=${MAKE:-make}

fail() {
	echo "check-install: FAIL: $*" >&2
	exit 1
}
[ "$(id -u)" = 0 ] || fail "needs root (mount namespaces, overlays)"
for tool in groff mandoc man unshare zcat findmnt systemctl; do
	command -v "$tool" >/dev/null || fail "$tool is missing: run make deps"
done
tmp=$(mktemp -d /tmp/mpipause-check-install-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

files() { (cd "$1" && find . -mindepth 1 ! -type d -printf '%P %m\n' | sort); }
dirs() { (cd "$1" && find . -mindepth 1 -type d -printf '%P\n' | sort); }
install_into() {
	local dest=$1
	shift
	"$make" -s --no-print-directory install DESTDIR="$dest" "$@" > "$tmp/install.log" 2>&1 ||
		{ cat "$tmp/install.log" >&2; fail "make install DESTDIR=$dest $*"; }
}

# The Slurm SPANK plugin is installed when the tree has it (slurm/), and
# make deps installs what it needs to build (libslurm-dev).
spank=false
if [ -f slurm/Makefile ]; then
	[ -f /usr/include/slurm/spank.h ] || fail "no /usr/include/slurm/spank.h for the Slurm plugin: run make deps"
	spank=true
fi

# The table: what make install puts where, and with which mode.
for prefix in /usr /usr/local; do
	p=${prefix#/}
	unitdir=lib/systemd/system
	[ "$prefix" = /usr ] || unitdir=$p/lib/systemd/system
	want="etc/mpipause/mpid.conf 644
$unitdir/mpid.service 644
$p/bin/mpipause 755
$p/lib/mpipause/libmpipause.so 644
$p/sbin/mpid 755
$p/share/man/man1/mpipause.1.gz 644
$p/share/man/man8/mpid.8.gz 644"
	! $spank || want+=$'\n'"$p/lib/mpipause/mpipause_spank.so 644"
	d=$tmp/root$(echo "$prefix" | tr / -)
	install_into "$d" PREFIX="$prefix"
	diff -u <(echo "$want" | sort) <(files "$d") ||
		fail "make install PREFIX=$prefix installed other files or modes than the table (-want +got above)"
	cmp -s "$d/$p/sbin/mpid" bin/mpid || fail "the installed mpid is not bin/mpid"
	# The fault tests' failpoint hook is in their build (bin/test/mpid) only.
	! grep -q MPIPAUSE_FAILPOINTS "$d/$p/sbin/mpid" || fail "the installed mpid has the failpoint hook (build tag failpoints)"
	cmp -s "$d/$p/bin/mpipause" bin/mpipause || fail "the installed mpipause is not bin/mpipause"
	cmp -s "$d/$p/lib/mpipause/libmpipause.so" bin/libmpipause.so || fail "the installed shim is not bin/libmpipause.so"
	cmp -s "$d/etc/mpipause/mpid.conf" dist/mpid.conf || fail "the installed mpid.conf is not dist/mpid.conf"
	! $spank || cmp -s "$d/$p/lib/mpipause/mpipause_spank.so" bin/mpipause_spank.so || fail "the installed Slurm plugin is not bin/mpipause_spank.so"

	# The unit starts the mpid this install put in place.
	exe=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$d/$unitdir/mpid.service")
	[ "$exe" = "$prefix/sbin/mpid" ] || fail "PREFIX=$prefix: the unit's ExecStart runs \"$exe\", want $prefix/sbin/mpid"
	[ -x "$d$exe" ] || fail "PREFIX=$prefix: the unit's ExecStart $exe is not installed"

	# mpipause run finds the shim in ../lib/mpipause: in a network namespace
	# of its own no mpid answers, so it gets as far as asking one (exit 6).
	set +e
	out=$(unshare -n "$d/$p/bin/mpipause" run --launcher openmpi -- true 2>&1)
	rc=$?
	set -e
	[ "$rc" = 6 ] && [[ $out == *"no mpid at"* ]] ||
		fail "PREFIX=$prefix: the installed mpipause run exited $rc ($out), want 6 (no mpid): it did not find the installed shim"
done

d=$tmp/root-usr
# The man pages: lint clean, and man finds and renders them.
for page in usr/share/man/man1/mpipause.1.gz usr/share/man/man8/mpid.8.gz; do
	# mandoc checks the section against the file's name: keep it.
	mkdir -p "$tmp/pages"
	f=$tmp/pages/$(basename "$page" .gz)
	zcat "$d/$page" > "$f"
	w=$(groff -man -Tutf8 -ww -z "$f" 2>&1) || fail "$page: groff: $w"
	[ -z "$w" ] || fail "$page: groff -ww warns: $w"
	w=$(mandoc -Tlint -W style "$f" 2>&1) || fail "$page: mandoc -Tlint: $w"
	[ -z "$w" ] || fail "$page: mandoc -Tlint: $w"
done
for name in mpipause mpid; do
	MANPATH=$d/usr/share/man man -w "$name" > /dev/null || fail "man -w $name does not find the installed page"
	txt=$(MANPATH=$d/usr/share/man MANWIDTH=80 man "$name" 2>&1)
	for head in NAME SYNOPSIS DESCRIPTION OPTIONS COMMANDS "SEE ALSO"; do
		[ "$name" = mpipause ] && [ "$head" = OPTIONS ] && continue
		grep -q "^$head" <<< "$txt" || fail "man $name has no $head section"
	done
done

# A second install keeps the admin's config; uninstall keeps it too, and
# removes everything else.
echo "# changed by the admin" >> "$d/etc/mpipause/mpid.conf"
install_into "$d"
grep -q "changed by the admin" "$d/etc/mpipause/mpid.conf" || fail "a second make install overwrote a changed mpid.conf"
grep -q "kept $d/etc/mpipause/mpid.conf" "$tmp/install.log" || fail "make install kept mpid.conf without saying so"
"$make" -s --no-print-directory uninstall DESTDIR="$d" > "$tmp/uninstall.log" 2>&1 ||
	{ cat "$tmp/uninstall.log" >&2; fail "make uninstall"; }
diff -u <(echo "etc/mpipause/mpid.conf 644") <(files "$d") ||
	fail "make uninstall left other files than the changed config (-want +got above)"
cp dist/mpid.conf "$d/etc/mpipause/mpid.conf"
"$make" -s --no-print-directory uninstall DESTDIR="$d" > "$tmp/uninstall.log" 2>&1 ||
	{ cat "$tmp/uninstall.log" >&2; fail "make uninstall"; }
[ -z "$(files "$d")" ] || fail "make uninstall left files: $(files "$d")"
if dirs "$d" | grep -E '(^|/)mpipause$'; then
	fail "make uninstall left mpipause's own directories (above)"
fi

# The same without DESTDIR, as a user runs it: in a mount namespace of
# its own whose /usr and /etc are overlays (writes land in $tmp, the host's
# files are untouched) and where systemd looks not running (a tmpfs over
# /run/systemd), so that systemctl works on the files, not on the host's
# systemd.
mkdir -p "$tmp/ov"
cat > "$tmp/ov/inside.sh" <<'INSIDE'
set -euo pipefail
fail() { echo "check-install: FAIL: (make install without DESTDIR) $*" >&2; exit 1; }
ov=$1 want=$2 make=$3
for d in usr etc; do
	mkdir -p "$ov/$d/upper" "$ov/$d/work"
	mount -t overlay overlay -o "lowerdir=/$d,upperdir=$ov/$d/upper,workdir=$ov/$d/work" "/$d"
	[ "$(findmnt -n -o FSTYPE "/$d")" = overlay ] || fail "/$d is not an overlay: stopping before make install writes to it"
done
[ ! -d /run/systemd ] || mount -t tmpfs tmpfs /run/systemd
# Start from none of it (a host with mpipause installed has it).
rm -rf /etc/mpipause /usr/bin/mpipause /usr/sbin/mpid /usr/lib/mpipause /lib/systemd/system/mpid.service \
	/usr/share/man/man1/mpipause.1.gz /usr/share/man/man8/mpid.8.gz /etc/systemd/system/multi-user.target.wants/mpid.service
"$make" -s --no-print-directory install > "$ov/install.log" 2>&1 || { cat "$ov/install.log" >&2; fail "make install"; }
while read -r f mode; do
	[ "$(stat -c %a "/$f" 2>/dev/null)" = "$mode" ] || fail "/$f is missing or not mode $mode"
done <<< "$want"
grep -q "mpid keygen" "$ov/install.log" || fail "make install does not say that mpid needs a cluster key"
[ "$(man -w mpipause)" = /usr/share/man/man1/mpipause.1.gz ] || fail "man -w mpipause: $(man -w mpipause 2>&1)"
help=$(PATH=/usr/bin:/usr/sbin mpipause --help) && [[ $help == "usage: mpipause"* ]] || fail "mpipause --help: $help"
systemctl enable mpid.service > /dev/null 2>&1 || fail "systemctl enable mpid.service"
"$make" -s --no-print-directory uninstall > "$ov/uninstall.log" 2>&1 || { cat "$ov/uninstall.log" >&2; fail "make uninstall"; }
while read -r f mode; do
	[ ! -e "/$f" ] || fail "make uninstall left /$f"
done <<< "$want"
[ ! -e /etc/mpipause ] || fail "make uninstall left /etc/mpipause"
[ ! -L /etc/systemd/system/multi-user.target.wants/mpid.service ] || fail "make uninstall left mpid enabled"
INSIDE
want="etc/mpipause/mpid.conf 644
lib/systemd/system/mpid.service 644
usr/bin/mpipause 755
usr/lib/mpipause/libmpipause.so 644
usr/sbin/mpid 755
usr/share/man/man1/mpipause.1.gz 644
usr/share/man/man8/mpid.8.gz 644"
! $spank || want+=$'\n'"usr/lib/mpipause/mpipause_spank.so 644"
unshare --mount --propagation private -- bash "$tmp/ov/inside.sh" "$tmp/ov" "$want" "$make" ||
	fail "make install and uninstall without DESTDIR (above)"

echo "check-install: ok (PREFIX=/usr and /usr/local: the file table, the unit's ExecStart, the shim found, man pages lint clean, config kept, uninstall clean; and without DESTDIR, on overlays of /usr and /etc)"
