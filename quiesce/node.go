package quiesce

import "context"

// Node is the local half of the protocol: what the node daemon (mpid) does to
// the job's ranks on its own machine. The protocol calls each method from one
// goroutine at a time per job, in the order the coordinator decided, and
// never calls a step a newer request has superseded.
//
// Every method must be idempotent: the protocol may repeat a call (a retried
// round, a RESUME of a job that is already running, an ABORT after a partial
// rollback), and a repeat must leave the node as one call would. Every method
// must return when ctx is done, with an error if it did not finish.
type Node interface {
	// Prepare closes the send gates of every rank of the job on this node. A
	// gate closes per socket at a send-call boundary (G2,
	// docs/guarantees.md); Prepare returns once every shim has been told,
	// not once every gate is closed: sockets still owing part of a frame are
	// reported by Drain as Ungated.
	Prepare(ctx context.Context, job string) error
	// Drain reports the job's sockets on this node as they are now: Empty, or
	// the connections still holding bytes, the sockets not yet gated and any
	// gate violation, and whether it counts every byte its connections are
	// handed from now on (NodeReport.Counted). It does not wait for the
	// queues to empty; the coordinator repeats the round.
	Drain(ctx context.Context, job string) (NodeReport, error)
	// Freeze freezes the job's ranks on this node and returns once the kernel
	// reports them frozen.
	Freeze(ctx context.Context, job string) error
	// Verify is the final check, read from the kernel after Freeze (G1,
	// docs/guarantees.md): the same report as Drain, but from a source the
	// ranks can no longer change. Its Violations are the bytes handed to
	// the kernel since the last Drain. With Message.Check, the agent calls
	// it right after Freeze, in FREEZE's round.
	Verify(ctx context.Context, job string) (NodeReport, error)
	// Thaw unfreezes the job's ranks. Thawing a job that is not frozen is a
	// successful no-op.
	Thaw(ctx context.Context, job string) error
	// Open reopens the send gates and lets held sends go out. Opening open
	// gates is a successful no-op. The protocol always thaws before it opens,
	// so the shims can flush held data as soon as the gates open.
	Open(ctx context.Context, job string) error
}

// Rethawer is a Node that must tell the thaw of another drain attempt (a
// non-empty VERIFY: the ranks run again, gates still closed, and the pause
// goes on) from the thaw of a rollback or a resume. A Node without it gets
// Thaw for both.
type Rethawer interface {
	Rethaw(ctx context.Context, job string) error
}

// DrainWaker is a Node that can say when its queues are worth checking
// again before DrainPoll has passed: DrainWake returns a channel closed
// once what the node started for the job's drain has been done (mpid:
// every rank answered the last DRAIN, its shim having drained and
// acknowledged what waited), or nil. A node waiting for its queues to
// drain checks once when the channel closes; the same channel never wakes
// it twice, and the wait between two checks is still at least the CPU
// time the last one cost (Agent.CPUTime).
type DrainWaker interface {
	DrainWake(job string) <-chan struct{}
}

// Committer is a Node that must act on COMMIT (mpid records the pause, so
// that a restart finds it): the COMMIT is acknowledged only once Commit has
// returned nil, and a failed Commit rolls the pause back everywhere, like
// any COMMIT that does not reach every node.
type Committer interface {
	Commit(ctx context.Context, job string) error
}
