#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Regenerates the BPF objects and Go bindings and fails if that changes any
# of them: the committed files must be exactly what bpf/*.c produces.
set -euo pipefail
cd "$(dirname "$0")/.."
sums() { sha256sum loader/*_bpfel.go loader/*_bpfel.o 2>/dev/null | sort -k2; }
before=$(sums)
[ -n "$before" ] || { echo "check-generate: no generated files in loader/; run 'make generate'" >&2; exit 1; }
go generate ./loader/
after=$(sums)
if [ "$before" != "$after" ]; then
	diff <(echo "$before") <(echo "$after") >&2 || true
	echo "check-generate: regenerating changed the BPF files above; run 'make generate' and commit the result" >&2
	exit 1
fi
echo "check-generate: $(echo "$after" | wc -l) generated files reproduce byte for byte"
