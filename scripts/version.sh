#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prints mpipause's version: VERSION's, as it is when HEAD is the release's
# tag (vVERSION) or when there is no git history (a source tarball); else
# VERSION~gitYYYYMMDD.HASH (the commit's date and hash), which sorts before
# the release and after the previous one, so apt upgrades between builds.
set -euo pipefail
cd "$(dirname "$0")/.."
v=$(tr -d ' \n' < VERSION)
if [[ ! $v =~ ^[0-9][0-9A-Za-z.+]*$ ]]; then
	echo "version: VERSION holds \"$v\"; want a Debian upstream version such as 0.1.0" >&2
	exit 1
fi
if ! git rev-parse --verify -q HEAD >/dev/null 2>&1 || git describe --exact-match --tags --match "v$v" HEAD >/dev/null 2>&1; then
	echo "$v"
	exit 0
fi
echo "$v~git$(git log -1 --format=%cd --date=format:%Y%m%d HEAD).$(git rev-parse --short=7 HEAD)"
