// Package quiesce is the pause protocol as pure Go: message types, the
// coordinator and node state machines (PREPARE → DRAIN → FREEZE → COMMIT, or
// ABORT), the binomial-tree fan-out and reduction, timeouts and rollback. It
// has no kernel dependency, so it is tested in-process with thousands of
// simulated nodes. Its contents arrive with the consistent-pause issue.
package quiesce
