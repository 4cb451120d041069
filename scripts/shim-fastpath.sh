#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# shim-fastpath.sh SO...: for each build of libmpipause.so named, the send
# wrappers' open-gate path as the compiler laid it out: the instructions
# from the function's entry to its first indirect call (the real send,
# through mpp_real), and the memory reads among them, named by the symbol
# the address came from. This path must stay one load of the gate word
# (then the real function's pointer, which any wrapper reads);
# `make bench-base` prints it for the base build and this one.
#
# The first indirect call is the real call only because the gate test is
# compiled as likely (GATE_IS_OPEN): the open branch falls through. If a
# build lays it out otherwise, the listing shows it.
set -euo pipefail

FUNCS=${FUNCS:-send sendto write writev sendmsg}
[ $# -ge 1 ] || { echo "usage: $0 libmpipause.so..." >&2; exit 2; }

for so in "$@"; do
	echo "== $so"
	for f in $FUNCS; do
		objdump -d --no-show-raw-insn --disassemble="$f" "$so" | awk -v fn="$f" '
			$0 ~ "<" fn ">:$" { on = 1; next }
			!on { next }
			/^$/ { exit }
			{
				sub(/^ *[0-9a-f]+:\t/, "")
				ins[++n] = $0
				# The symbol a register holds: lea sym(%rip),%reg; # <sym>.
				if ($1 == "lea" && match($0, /# [0-9a-f]+ <[^>]+>/)) {
					sym = substr($0, RSTART, RLENGTH); sub(/^# [0-9a-f]+ </, "", sym); sub(/>$/, "", sym)
					split($2, ops, ","); reg[ops[2]] = sym
				}
				# A read: a memory operand that is not the destination,
				# in anything but lea (which computes an address).
				if ($1 != "lea" && $1 !~ /^(push|pop|call|j)/ && match($2, /^(-?0x[0-9a-f]+)?\(%[a-z0-9]+\),/)) {
					m = substr($2, RSTART, RLENGTH - 1)
					off = m; sub(/\(.*/, "", off); r = m; sub(/^[^(]*\(/, "", r); sub(/\)$/, "", r)
					reads = reads (reads ? ", " : "") ((r in reg) ? reg[r] : r) (off ? "+" off : "")
				}
				# The real call itself may load the pointer: call *off(%reg).
				if ($1 == "call" && match($2, /^\*(-?0x[0-9a-f]+)?\(%[a-z0-9]+\)/)) {
					m = substr($2, RSTART + 1, RLENGTH - 1)
					off = m; sub(/\(.*/, "", off); r = m; sub(/^[^(]*\(/, "", r); sub(/\)$/, "", r)
					reads = reads (reads ? ", " : "") ((r in reg) ? reg[r] : r) (off ? "+" off : "")
				}
				if ($1 == "call" && $2 ~ /^\*/) { done = 1; exit }
			}
			END {
				if (!done) { printf "%s: no indirect call found\n", fn; exit 1 }
				printf "%s: %d instructions to the real call; memory reads: %s\n", fn, n, reads
				for (i = 1; i <= n; i++) printf "    %s\n", ins[i]
			}'
	done
done
