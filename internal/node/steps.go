package node

import (
	"context"
	"log/slog"
	"time"

	"github.com/mpipause/mpipause/quiesce"
)

// FailpointsEnv names a directory of failpoints, for the fault tests
// (kernel-tests/faulttable_test.go), read only by an mpid built with
// -tags failpoints (bin/test/mpid; failpoints.go): a file <dir>/<node>/<STEP>
// holding "before" or "after" makes this node's mpid stop at that point of
// its next local STEP (PREPARE, DRAIN, FREEZE, VERIFY, COMMIT, THAW, OPEN),
// create <STEP>.reached, and hold until the file goes (or the step's
// deadline passes), so that a test can kill or cut it off there. The
// production mpid has no such hook: it never reads this variable.
const FailpointsEnv = "MPIPAUSE_FAILPOINTS"

// Steps is the node half of the protocol as mpid runs it (the agent's
// quiesce.Node): Role's steps, timed, with the fault tests' failpoints
// around them, plus a record of every pause committed here, written before
// the COMMIT is acknowledged, so that a restarted mpid tells a committed
// pause (keep the job frozen) from one cut short (thaw it). Make it with
// NewSteps.
type Steps struct {
	*Role
	// Records are mpid's records of paused jobs.
	Records Records

	fp failpoints
}

// Records are mpid's records of paused jobs, which a restarted mpid reads.
type Records interface {
	// Pausing says whether the job's record is of a pause this node
	// coordinates and that is still under way.
	Pausing(job string) bool
	// WriteCommit records c.
	WriteCommit(c Commit) error
	// Drop removes the job's record.
	Drop(job string)
}

// Commit is the record of a pause committed on this node. The
// coordinator's record, written after the whole pause, adds the job's
// nodes and figures.
type Commit struct {
	Job         string
	Owner       uint32
	Coordinator string
	Node        string
	Since       time.Time
	// Ranks is the job's size; LocalRanks the ranks registered here.
	Ranks      int
	LocalRanks []int
	// Cgroups are the frozen cgroups, for an mpid restarted before the
	// resume to find and thaw: they need not be mpid's own.
	Cgroups []string
}

// NewSteps makes the Steps around role with its failpoints (none outside
// a failpoints build) for role.Name, logged to log. The caller sets
// Records before the agent runs a step.
func NewSteps(role *Role, log *slog.Logger) *Steps {
	return &Steps{Role: role, fp: hookFor(role.Name, log)}
}

var _ quiesce.Committer = (*Steps)(nil)

func (n *Steps) step(ctx context.Context, name, job string, fn func() error) error {
	return n.stepNoted(ctx, name, job, func() (string, error) { return "", fn() })
}

// stepNoted is step for a step whose outcome says more than its error (a
// drain check: clean or not), for the timeline.
func (n *Steps) stepNoted(ctx context.Context, name, job string, fn func() (string, error)) error {
	n.fp.hold(ctx, name, "before", job)
	t := time.Now()
	note, err := fn()
	took := time.Since(t)
	n.Metrics.Step(name, took, err)
	if n.Timelines != nil {
		if err != nil {
			note = "failed"
		}
		n.Timelines.step(job, name, t, took, note)
	}
	n.fp.hold(ctx, name, "after", job)
	return err
}

func (n *Steps) Prepare(ctx context.Context, job string) error {
	return n.step(ctx, "PREPARE", job, func() error { return n.Role.Prepare(ctx, job) })
}

func (n *Steps) Drain(ctx context.Context, job string) (rep quiesce.NodeReport, err error) {
	err = n.stepNoted(ctx, "DRAIN", job, func() (string, error) {
		rep, err = n.Role.Drain(ctx, job)
		return cleanNote(rep), err
	})
	return rep, err
}

// cleanNote is a drain check's outcome in a timeline.
func cleanNote(rep quiesce.NodeReport) string {
	if rep.Clean() {
		return "clean"
	}
	return "unclean"
}

func (n *Steps) Freeze(ctx context.Context, job string) error {
	return n.step(ctx, "FREEZE", job, func() error { return n.Role.Freeze(ctx, job) })
}

func (n *Steps) Verify(ctx context.Context, job string) (rep quiesce.NodeReport, err error) {
	err = n.stepNoted(ctx, "VERIFY", job, func() (string, error) {
		rep, err = n.Role.Verify(ctx, job)
		return cleanNote(rep), err
	})
	return rep, err
}

// Commit and Open end the operation on this node: its timeline is logged
// once they have done so.
func (n *Steps) Commit(ctx context.Context, job string) error {
	err := n.step(ctx, "COMMIT", job, func() error {
		n.Jobs.Committed(job)
		return n.recordCommit(job)
	})
	n.endTimeline(job, err)
	return err
}

func (n *Steps) Thaw(ctx context.Context, job string) error {
	return n.step(ctx, "THAW", job, func() error {
		// Before the thaw: a rank frozen with its SIGTSTP unsent sends it
		// as soon as it runs again.
		n.Jobs.Thawing(job)
		if err := n.Role.Thaw(ctx, job); err != nil {
			return err
		}
		return n.dropRecord(job)
	})
}

// Rethaw thaws for another drain attempt of a pause still under way: the
// coordinator's record of it stays (a successor must still roll it back).
func (n *Steps) Rethaw(ctx context.Context, job string) error {
	return n.step(ctx, "RETHAW", job, func() error { return n.Role.Thaw(ctx, job) })
}

func (n *Steps) Open(ctx context.Context, job string) error {
	err := n.step(ctx, "OPEN", job, func() error { return n.Role.Open(ctx, job) })
	n.endTimeline(job, err)
	return err
}

// endTimeline logs job's timeline once its operation ended well here; a
// failed COMMIT or OPEN leaves it open for the rollback or retry that
// follows, as part of the same line.
func (n *Steps) endTimeline(job string, err error) {
	if err == nil {
		n.Timelines.end(job, n.Name, n.Log)
	}
}

// recordCommit records that a pause of job committed on this node.
func (n *Steps) recordCommit(id string) error {
	cgs, err := n.Jobs.Cgroups(id)
	if err != nil {
		return err
	}
	return n.Jobs.WithJob(id, func(owner uint32, coordinator string) error {
		if n.Records.Pausing(id) {
			// This is the coordinator, whose pause is still under way: the
			// pause holds only once every node has committed, when it says so
			// in its record; if it dies before, its successor rolls back.
			return nil
		}
		c := Commit{Job: id, Owner: owner, Coordinator: coordinator, Node: n.Name, Since: time.Now(), Cgroups: cgs}
		for _, rk := range n.Ranks.Ranks(id) {
			c.LocalRanks = append(c.LocalRanks, rk.Rank)
			c.Ranks = rk.Size
		}
		return n.Records.WriteCommit(c)
	})
}

// dropRecord removes the record of a pause committed here once the job is
// thawed here. Not on the job's coordinator: its record is of the whole
// pause (its nodes), and stays until the resume or rollback is confirmed on
// every node, which only the coordinator's operation knows; a successor of
// its mpid that found none would leave the nodes that did not confirm
// paused.
func (n *Steps) dropRecord(id string) error {
	return n.Jobs.WithJob(id, func(_ uint32, coordinator string) error {
		if coordinator != n.Name {
			n.Records.Drop(id)
		}
		return nil
	})
}
