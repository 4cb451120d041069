package mpid

import (
	"context"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/metrics"
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

// localNode is the node half of the protocol as mpid runs it (the agent's
// quiesce.Node): nodeRole's steps, timed, with the fault tests' failpoints
// around them, plus a record of every pause committed here, written before
// the COMMIT is acknowledged, so that a restarted mpid tells a committed
// pause (keep the job frozen) from one cut short (thaw it) (state.go,
// registry.adopt).
type localNode struct {
	*nodeRole
	reg     *registry
	store   *store
	metrics *metrics.Metrics
	fp      failpoints
}

var _ quiesce.Committer = (*localNode)(nil)

func (n *localNode) step(ctx context.Context, name, job string, fn func() error) error {
	n.fp.hold(ctx, name, "before", job)
	t := time.Now()
	err := fn()
	n.metrics.Step(name, time.Since(t), err)
	n.fp.hold(ctx, name, "after", job)
	return err
}

func (n *localNode) Prepare(ctx context.Context, job string) error {
	return n.step(ctx, "PREPARE", job, func() error { return n.nodeRole.Prepare(ctx, job) })
}

func (n *localNode) Drain(ctx context.Context, job string) (rep quiesce.NodeReport, err error) {
	err = n.step(ctx, "DRAIN", job, func() error { rep, err = n.nodeRole.Drain(ctx, job); return err })
	return rep, err
}

func (n *localNode) Freeze(ctx context.Context, job string) error {
	return n.step(ctx, "FREEZE", job, func() error { return n.nodeRole.Freeze(ctx, job) })
}

func (n *localNode) Verify(ctx context.Context, job string) (rep quiesce.NodeReport, err error) {
	err = n.step(ctx, "VERIFY", job, func() error { rep, err = n.nodeRole.Verify(ctx, job); return err })
	return rep, err
}

func (n *localNode) Commit(ctx context.Context, job string) error {
	return n.step(ctx, "COMMIT", job, func() error {
		n.reg.noteCommitted(job)
		n.nodeRole.Unboost(job) // frozen now: the pause step that needed them is over
		return n.recordCommit(job)
	})
}

func (n *localNode) Thaw(ctx context.Context, job string) error {
	return n.step(ctx, "THAW", job, func() error {
		// Before the thaw: a rank frozen with its SIGTSTP unsent sends it
		// as soon as it runs again.
		n.reg.noteResumed(job)
		if err := n.nodeRole.Thaw(ctx, job); err != nil {
			return err
		}
		n.store.drop(job)
		return nil
	})
}

// Rethaw thaws for another drain attempt of a pause still under way: the
// coordinator's record of it stays (a successor must still roll it back).
func (n *localNode) Rethaw(ctx context.Context, job string) error {
	return n.step(ctx, "RETHAW", job, func() error { return n.nodeRole.Thaw(ctx, job) })
}

func (n *localNode) Open(ctx context.Context, job string) error {
	return n.step(ctx, "OPEN", job, func() error { return n.nodeRole.Open(ctx, job) })
}

// recordCommit records that a pause of job committed on this node. The
// coordinator's record, written after the whole pause, adds the job's
// nodes and figures.
func (n *localNode) recordCommit(id string) error {
	return n.reg.withJob(id, func(owner uint32, coordinator string) error {
		if r, err := n.store.read(id); err == nil && r.State == ctl.StatePausing {
			// This is the coordinator, whose pause is still under way: the
			// pause holds only once every node has committed, when it says so
			// in its record; if it dies before, its successor rolls back.
			return nil
		}
		r := record{Version: recordVersion, Job: id, Owner: owner, State: ctl.StatePaused, Since: time.Now(),
			Nodes: []string{n.Name}, Coordinator: coordinator}
		for _, rk := range n.Ranks.Ranks(id) {
			r.LocalRanks = append(r.LocalRanks, rk.Rank)
			r.Ranks = rk.Size
		}
		return n.store.write(r)
	})
}
