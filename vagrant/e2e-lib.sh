# shellcheck shell=bash
# SPDX-License-Identifier: Apache-2.0
# e2e-lib.sh: what the VM e2e scripts (slurm-e2e.sh, scope-e2e.sh) share,
# sourced: PASS/FAIL lines and their count, and a bounded wait.

passed=0 failed=0
step_timeout=${step_timeout:-120}
pass() {
	echo "PASS $*"
	passed=$((passed + 1))
}
fail() {
	echo "FAIL $*"
	failed=$((failed + 1))
}
# summary: the count; fails if any check did (then: exit).
summary() {
	echo "$passed passed, $failed failed"
	[ "$failed" -eq 0 ]
}
# until_ok CMD...: CMD every 0.5 s until it succeeds, at most the step
# timeout; 2 from CMD ends the wait at once.
until_ok() {
	local t0=$SECONDS rc
	while true; do
		"$@" && return 0
		rc=$?
		if [ "$rc" -eq 2 ] || [ $((SECONDS - t0)) -ge "$step_timeout" ]; then
			return 1
		fi
		sleep 0.5
	done
}
