// Package quiesce is the pause protocol as pure Go: message types, the
// coordinator and node state machines (PREPARE → DRAIN → FREEZE → VERIFY →
// COMMIT, or ABORT), RESUME, the binomial-tree fan-out and reduction, per-phase
// deadlines and rollback. It has no kernel dependency, so it is tested
// in-process with thousands of simulated nodes and injected message faults.
//
// The pieces:
//
//   - [Message], [Report], [NodeReport], [Conn]: the versioned envelope and the
//     reports that travel up the tree and are reduced by [Report.Merge].
//   - [Node]: what a node daemon (mpid) implements: gates, drain report,
//     freeze, kernel verification, thaw. The protocol never talks to the
//     kernel or the shims itself.
//   - [Agent]: the node role. It serves one request per round: forwards it to
//     its children in the binomial tree (or, with [FanoutStar], a baseline
//     for benchmarks, the first node to every other), runs the local step
//     on its [Node], merges the children's reports and replies. It deduplicates retried and
//     duplicated requests and refuses stale ones, so that a late FREEZE can
//     never freeze a node after the ABORT that rolled it back.
//   - [Coordinator]: the coordinator role (in mpid, the node the job key
//     names): [Coordinator.Pause] and [Coordinator.Resume].
//   - [Transport]: request/response delivery between daemons;
//     [MemNetwork] is the in-memory implementation with injected delays,
//     duplicates and drops; [TCPTransport] and [ServeTCP] speak
//     length-prefixed frames in a tagged binary encoding (wire.go), after a
//     versioned JSON [Hello], inside TLS 1.3 under the cluster key (tls.go,
//     keys.go).
//     Retransmission lives above the transport, in the sender, so every
//     transport gets it.
//
// A VERIFY that finds bytes is followed by THAW (gates stay closed) and
// another DRAIN, FREEZE and VERIFY, at most [Options.Rethaws] times
// (docs/guarantees.md, G1). Not here: persistence of a paused job across
// daemon restarts (G5, docs/guarantees.md), which is mpid's (its state
// records); peers are authenticated here, under the cluster key (tls.go).
//
// Ordering: every request carries (Epoch, Seq). A coordinator picks a fresh
// epoch for every Pause and Resume, and a fresh Seq for every round within it.
// A node executes a local step only for a key at least as new as the newest it
// has executed for that job; older keys are answered with [ErrStale]. Since
// rounds of one coordinator are strictly ordered, this makes every message
// idempotent and makes reordered or duplicated messages harmless.
package quiesce
