#!/usr/bin/env bash
# tier-clock.sh FILE start | FILE TIER | FILE report: make test's clock.
# "start" begins it; after each tier, TIER records how long that tier took
# (since the last mark) and says so; "report" prints every tier's time and
# the total, the figures the CI budget is read from (README, "Tests").
set -euo pipefail
file=$1 what=$2
now=$(date +%s)
case $what in
start)
	mkdir -p "$(dirname "$file")"
	printf 'start\t%s\n' "$now" >"$file"
	;;
report)
	first=$(awk -F'\t' '$1 == "start" { print $2 }' "$file")
	echo "make test: all tiers passed in $(((now - first) / 60)) min $(((now - first) % 60)) s:"
	awk -F'\t' '$1 != "start" { printf "    %-22s %5d s\n", $1, $3 }' "$file"
	;;
*)
	last=$(tail -1 "$file" | cut -f2)
	first=$(awk -F'\t' '$1 == "start" { print $2 }' "$file")
	printf '%s\t%s\t%s\n' "$what" "$now" "$((now - last))" >>"$file"
	echo "make test: $what passed in $((now - last)) s ($(((now - first) / 60)) min so far)"
	;;
esac
