package quiesce

import (
	"context"
	"fmt"
	"time"
)

// What a caller gives the coordinator (Options) and gets back: a Result
// with each phase's cost, the errors that say where a pause failed, and the
// progress of its rounds as they go (WithProgress).

// Options are the coordinator's per-phase deadlines and pacing. A zero field
// takes its value from DefaultOptions.
type Options struct {
	Prepare time.Duration `json:"prepare_ns"`
	// Drain bounds all DRAIN rounds together: it is the user's --timeout.
	Drain time.Duration `json:"drain_ns"`
	// DrainInterval is the pause between DRAIN rounds that found bytes.
	DrainInterval time.Duration `json:"drain_interval_ns"`
	// DrainWait, if not 0, is how long each node may hold its DRAIN answer
	// while its queues drain (Message.Wait); at most a quarter of the drain
	// time left. 0: nodes answer at once, and rounds poll.
	DrainWait time.Duration `json:"drain_wait_ns,omitempty"`
	Freeze    time.Duration `json:"freeze_ns"`
	Verify    time.Duration `json:"verify_ns"`
	Commit    time.Duration `json:"commit_ns"`
	// Abort bounds the rollback. It runs even when the caller's context is
	// cancelled, because leaving ranks frozen is the worse outcome (G3,
	// docs/guarantees.md).
	Abort  time.Duration `json:"abort_ns"`
	Resume time.Duration `json:"resume_ns"`
	// Rethaws bounds the attempts after a VERIFY that found bytes: THAW
	// (gates stay closed), DRAIN within what is left of Drain, FREEZE,
	// VERIFY again. 0 means the default (2); negative, none.
	Rethaws int         `json:"rethaws,omitempty"`
	Retry   RetryPolicy `json:"retry"`
	// Fanout is how the first node sends each request on to the others:
	// the binomial tree (FanoutTree, the default) or, as a baseline to
	// measure the tree against, FanoutStar.
	Fanout Fanout `json:"fanout,omitempty"`
}

// DefaultOptions are sized for a LAN cluster and an MPI job that drains in
// well under a second.
var DefaultOptions = Options{
	Prepare:       5 * time.Second,
	Drain:         10 * time.Second,
	DrainInterval: 2 * time.Millisecond,
	Freeze:        10 * time.Second,
	Verify:        5 * time.Second,
	Commit:        5 * time.Second,
	Abort:         30 * time.Second,
	Resume:        30 * time.Second,
	Rethaws:       2,
	Retry:         DefaultRetry,
}

func (o Options) withDefaults() Options {
	d := DefaultOptions
	set := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
	}
	set(&o.Prepare, d.Prepare)
	set(&o.Drain, d.Drain)
	set(&o.DrainInterval, d.DrainInterval)
	set(&o.Freeze, d.Freeze)
	set(&o.Verify, d.Verify)
	set(&o.Commit, d.Commit)
	set(&o.Abort, d.Abort)
	set(&o.Resume, d.Resume)
	if o.Rethaws == 0 {
		o.Rethaws = d.Rethaws
	}
	o.Retry = o.Retry.normalized()
	return o
}

// States of a Result.
const (
	StatePaused  = "paused"  // committed: every node frozen and verified empty
	StateRunning = "running" // resumed, or a failed pause rolled back everywhere
	StateFailed  = "failed"  // the rollback or resume could not be confirmed on some node
)

// PhaseStat is the cost of one phase.
type PhaseStat struct {
	Phase   Kind          `json:"phase"`
	Rounds  int           `json:"rounds"`
	Elapsed time.Duration `json:"elapsed_ns"`
	Err     string        `json:"err,omitempty"`
}

// Result describes one Pause or Resume, for the CLI's --json and status.
type Result struct {
	Job   string `json:"job"`
	Epoch uint64 `json:"epoch"`
	State string `json:"state"`
	Nodes int    `json:"nodes"`
	// Phases in the order they ran, including ABORT if it ran.
	Phases []PhaseStat   `json:"phases"`
	Total  time.Duration `json:"total_ns"`
	// Report is the last complete report: on commit, the kernel check after
	// the freeze (empty); on abort, what made the pause fail.
	Report Report `json:"report"`
	// Unconfirmed lists nodes whose rollback or resume was not acknowledged.
	Unconfirmed []NodeReport `json:"unconfirmed,omitempty"`
	Error       string       `json:"error,omitempty"`
}

// AbortError is returned by Pause when the pause was rolled back.
type AbortError struct {
	Job   string
	Phase Kind
	// Cause is why; errors.Is(err, ErrNotEmpty) etc. see through it.
	Cause error
	// Report is the last complete report of the failed phase, naming the
	// nodes and connections that held bytes or failed.
	Report Report
	// Unconfirmed lists nodes the rollback could not confirm; empty means
	// every node acknowledged thaw and open.
	Unconfirmed []NodeReport
}

func (e *AbortError) Error() string {
	s := fmt.Sprintf("pause of job %s aborted in %s: %v", e.Job, e.Phase, e.Cause)
	if e.Report.Nodes > 0 && !e.Report.Empty() {
		s += " (" + e.Report.String() + ")"
	}
	if len(e.Unconfirmed) > 0 {
		s += "; rollback not confirmed on " + firstOf(len(e.Unconfirmed), e.Unconfirmed[0])
	}
	return s
}

func (e *AbortError) Unwrap() error { return e.Cause }

// NodeError is ErrNodeFailed with the report of the first of the nodes
// that failed a step (or, Unconfirmed, did not confirm a resume): what it
// blames on a rank (First.Fault) travels as a field, not as text.
type NodeError struct {
	Failed      int
	First       NodeReport
	Unconfirmed bool
}

func (e *NodeError) Error() string {
	if e.Unconfirmed {
		return ErrNodeFailed.Error() + ": not confirmed on " + firstOf(e.Failed, e.First)
	}
	return ErrNodeFailed.Error() + ": " + firstOf(e.Failed, e.First)
}

func (e *NodeError) Unwrap() error { return ErrNodeFailed }

// Progress is what a coordinator tells a WithProgress listener: after every
// round (Done false, Report the round's reduction) and at the end of every
// phase (Done true, Stat its cost and error).
type Progress struct {
	Job    string
	Phase  Kind
	Round  int
	Report Report
	Done   bool
	Stat   PhaseStat
}

type progressKey struct{}

// WithProgress returns a context under which Coordinator.Pause and Resume
// call f as the rounds happen, on the caller's goroutine: f must be quick.
// Per call rather than per coordinator, because one daemon's coordinator
// serves many users at once, each watching their own job.
func WithProgress(ctx context.Context, f func(Progress)) context.Context {
	return context.WithValue(ctx, progressKey{}, f)
}
