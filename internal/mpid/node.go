package mpid

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/quiesce"
)

// FailpointsEnv names a directory of failpoints, for the fault tests
// (kernel-tests/faulttable_test.go): a file <dir>/<node>/<STEP> holding
// "before" or "after" makes this node's mpid stop at that point of its
// next local STEP (PREPARE, DRAIN, FREEZE, VERIFY, COMMIT, THAW, OPEN),
// write <STEP>.reached, and hold until the file goes (or the step's
// deadline passes), so that a test can kill or cut it off there. Unset,
// no file is ever looked at.
const FailpointsEnv = "MPIPAUSE_FAILPOINTS"

// failpointHold bounds a hold whose file nobody removes.
const failpointHold = time.Minute

type failpoints struct {
	dir string
	log *slog.Logger
}

func (f failpoints) hold(ctx context.Context, step, where, job string) {
	if f.dir == "" {
		return
	}
	p := filepath.Join(f.dir, step)
	b, err := os.ReadFile(p)
	if err != nil || strings.TrimSpace(string(b)) != where {
		return
	}
	if err := os.WriteFile(p+".reached", []byte(job), 0o644); err != nil {
		f.log.Error("failpoint", "error", err)
		return
	}
	f.log.Warn("failpoint reached; holding", "step", step, "where", where, "job", job)
	end := time.Now().Add(failpointHold)
	for time.Now().Before(end) && ctx.Err() == nil {
		if _, err := os.Stat(p); err != nil {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// localNode is the node half of the protocol as mpid runs it: node.Local,
// plus a record of every pause committed here, written before the COMMIT
// is acknowledged, so that a restarted mpid tells a committed pause (keep
// the job frozen) from one cut short (thaw it) (state.go, adopt).
type localNode struct {
	*node.Local
	d  *Daemon
	fp failpoints
}

var _ quiesce.Committer = (*localNode)(nil)

func (n *localNode) step(ctx context.Context, name, job string, fn func() error) error {
	n.fp.hold(ctx, name, "before", job)
	t := time.Now()
	err := fn()
	n.d.metrics.Step(name, time.Since(t), err)
	n.fp.hold(ctx, name, "after", job)
	return err
}

func (n *localNode) Prepare(ctx context.Context, job string) error {
	return n.step(ctx, "PREPARE", job, func() error { return n.Local.Prepare(ctx, job) })
}

func (n *localNode) Drain(ctx context.Context, job string) (rep quiesce.NodeReport, err error) {
	err = n.step(ctx, "DRAIN", job, func() error { rep, err = n.Local.Drain(ctx, job); return err })
	return rep, err
}

func (n *localNode) Freeze(ctx context.Context, job string) error {
	return n.step(ctx, "FREEZE", job, func() error { return n.Local.Freeze(ctx, job) })
}

func (n *localNode) Verify(ctx context.Context, job string) (rep quiesce.NodeReport, err error) {
	err = n.step(ctx, "VERIFY", job, func() error { rep, err = n.Local.Verify(ctx, job); return err })
	return rep, err
}

func (n *localNode) Commit(ctx context.Context, job string) error {
	return n.step(ctx, "COMMIT", job, func() error {
		n.Local.Unboost(job) // frozen now: the pause step that needed them is over
		return n.d.recordCommit(job)
	})
}

func (n *localNode) Thaw(ctx context.Context, job string) error {
	return n.step(ctx, "THAW", job, func() error {
		if err := n.Local.Thaw(ctx, job); err != nil {
			return err
		}
		n.d.dropRecord(job)
		return nil
	})
}

// Rethaw thaws for another drain attempt of a pause still under way: the
// coordinator's record of it stays (a successor must still roll it back).
func (n *localNode) Rethaw(ctx context.Context, job string) error {
	return n.step(ctx, "RETHAW", job, func() error { return n.Local.Thaw(ctx, job) })
}

func (n *localNode) Open(ctx context.Context, job string) error {
	return n.step(ctx, "OPEN", job, func() error { return n.Local.Open(ctx, job) })
}

// recordCommit records that a pause of job committed on this node. The
// coordinator's record, written after the whole pause, adds the job's
// nodes and figures.
func (d *Daemon) recordCommit(id string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if r, err := readRecord(recordPath(d.stateDir(), id)); err == nil && r.State == ctl.StatePausing {
		// This is the coordinator, whose pause is still under way: the
		// pause holds only once every node has committed, when it says so
		// in its record; if it dies before, its successor rolls back.
		return nil
	}
	r := record{Version: recordVersion, Job: id, State: ctl.StatePaused, Since: time.Now(), Nodes: []string{d.cfg.Node}}
	if j := d.jobs[id]; j != nil {
		r.Owner = j.owner
	}
	for _, rk := range d.ranks.Ranks(id) {
		r.LocalRanks = append(r.LocalRanks, rk.Rank)
		r.Ranks, r.Coordinator = rk.Size, rk.Root
	}
	return writeRecord(d.stateDir(), r)
}
