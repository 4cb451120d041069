package mpid

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/quiesce"
)

// TestFailureReport: a drain timeout names the connections, the ranks at
// both ends where known, and the ranks with unread data.
func TestFailureReport(t *testing.T) {
	rep := quiesce.Report{Nodes: 3, Pending: []quiesce.NodeReport{
		{Node: "n1", Conns: []quiesce.Conn{{Node: "n1", Local: "a:1", Remote: "c:3", SendQueue: 100, Rank: 2}}},
		{Node: "n2", Conns: []quiesce.Conn{
			{Node: "n2", Local: "c:3", Remote: "a:1", Unread: 100, Rank: 5},
			{Node: "n2", Local: "c:4", Remote: "b:2", Unread: 7, Rank: 5},
		}},
	}}
	err := &quiesce.AbortError{Job: "j", Phase: quiesce.KindDrain, Cause: fmt.Errorf("%w after 9 drain rounds", quiesce.ErrNotEmpty), Report: rep}
	f := failure(err, quiesce.Result{Report: rep}, nil)
	if f.Phase != "DRAIN" || f.Node != "n1" || f.Rank != 5 || !slices.Equal(f.NotReading, []int{5}) || len(f.Conns) != 3 {
		t.Fatalf("failure %+v", f)
	}
	if f.Conns[0].Peer != 5 || f.Conns[1].Peer != 2 || f.Conns[2].Peer != -1 {
		t.Errorf("peers %d %d %d, want 5 2 -1", f.Conns[0].Peer, f.Conns[1].Peer, f.Conns[2].Peer)
	}
	for _, want := range []string{"drain timed out", "3 connections on 2 nodes", "ranks not reading what was sent to them: 5"} {
		if !strings.Contains(f.Reason, want) {
			t.Errorf("reason %q lacks %q", f.Reason, want)
		}
	}
}

// TestFailureReportViolations: a drain that timed out on bytes sent past
// the gates says so, and where, instead of "0 connections hold bytes".
func TestFailureReportViolations(t *testing.T) {
	rep := quiesce.Report{Nodes: 3, Pending: []quiesce.NodeReport{{Node: "n1", Violations: 40}}}
	err := &quiesce.AbortError{Job: "j", Phase: quiesce.KindDrain, Cause: fmt.Errorf("%w after 9 drain rounds", quiesce.ErrNotEmpty), Report: rep}
	f := failure(err, quiesce.Result{Report: rep}, nil)
	if f.Phase != "DRAIN" || f.Node != "n1" || f.Violations != 40 || len(f.Conns) != 0 {
		t.Fatalf("failure %+v; want DRAIN on n1, 40 violations, no connections", f)
	}
	want := "the drain timed out: 40 bytes sent through closed gates on n1 in the last round"
	if !strings.HasPrefix(f.Reason, want) {
		t.Errorf("reason %q; want it to start %q", f.Reason, want)
	}
	// Late bytes after the last rethaw: a path past the shim too.
	late := quiesce.Report{Nodes: 3, Pending: []quiesce.NodeReport{{Node: "n2", Late: 12}}}
	lerr := &quiesce.AbortError{Job: "j", Phase: quiesce.KindVerify, Cause: fmt.Errorf("%w: %s", quiesce.ErrNotEmpty, late), Report: late}
	if f := failure(lerr, quiesce.Result{Report: late}, nil); f.Node != "n2" || f.Violations != 12 ||
		!strings.Contains(f.Reason, "12 bytes sent through closed gates on n2") {
		t.Errorf("late bytes at the last check: %+v; want 12 violations on n2, said", f)
	}
	// A drain check that counted them stops the drain at once; late bytes
	// of the same round elsewhere are not the violation's.
	stop := quiesce.Report{Nodes: 3, Pending: []quiesce.NodeReport{{Node: "n1", Violations: 40}, {Node: "n2", Late: 8}}}
	serr := &quiesce.AbortError{Job: "j", Phase: quiesce.KindDrain, Cause: fmt.Errorf("%w: %s", quiesce.ErrThroughGates, stop), Report: stop}
	if f := failure(serr, quiesce.Result{Report: stop}, nil); f.Phase != "DRAIN" || f.Node != "n1" || f.Violations != 40 ||
		!strings.HasPrefix(f.Reason, "the drain stopped: 40 bytes sent through closed gates on n1") {
		t.Errorf("a drain stopped by a violation: %+v; want DRAIN, n1, 40 violations, said first", f)
	}
	// A report without its node's name still names a place.
	rep.Pending[0].Node = ""
	f = failure(err, quiesce.Result{Report: rep}, nil)
	if f.Node == "" || strings.Contains(f.Reason, "gates on  ") || strings.Contains(f.Reason, "on in") {
		t.Errorf("a violation of an unnamed node: node %q, reason %q; want a name in both", f.Node, f.Reason)
	}
}

// TestFailureBlamesRank: the rank a failed node blamed (quiesce.Fault)
// is the failure's rank, and a rank gone makes the pause's code rank-gone;
// not when the coordinator's own reason (cause) is what the user is told.
func TestFailureBlamesRank(t *testing.T) {
	gone := &node.RankGoneError{Rank: 4, Pid: 99, At: "gate state"}
	full := &node.StashFullError{Rank: 2, Pid: 98, Node: "n2", Bytes: 1 << 20, Max: 1 << 20}
	unheld := &node.UnheldError{Rank: 5, Pid: 97, Node: "n2", Call: "a send with MSG_ZEROCOPY", Fd: 9, Cookie: 0x12}
	failed := func(err quiesce.RankFault, unconfirmed bool) *quiesce.NodeError {
		fa := err.Fault()
		return &quiesce.NodeError{Failed: 2, Unconfirmed: unconfirmed,
			First: quiesce.NodeReport{Node: "n2", Err: "DRAIN: " + err.Error(), Fault: &fa}}
	}
	abort := func(cause error) error {
		return &quiesce.AbortError{Job: "j", Phase: quiesce.KindDrain, Cause: cause}
	}
	for _, tc := range []struct {
		name     string
		err      error
		cause    error
		rank     int
		rankGone bool
		reason   string
	}{
		{"rank gone", abort(failed(gone, false)), nil, 4, true, "rank 4 (pid 99) exited during the pause (at gate state)"},
		{"stash full", abort(failed(full, false)), nil, 2, false, "its shim's stash is full"},
		{"unheld", abort(failed(unheld, false)), nil, 5, false, "a send with MSG_ZEROCOPY on fd 9"},
		{"caller gone", abort(fmt.Errorf("%w (caller: %v)", failed(gone, false), context.Canceled)), context.Canceled, 4, true, "exited during the pause"},
		{"coordinator's own reason", abort(failed(gone, false)), errors.New("only 5 of the job's 6 ranks"), -1, false, "only 5 of"},
		// It cut the drain short: no drain timed out, and what the report
		// holds is not why.
		{"coordinator's own reason, drain cut short", &quiesce.AbortError{Job: "j", Phase: quiesce.KindDrain,
			Cause: fmt.Errorf("%w after 2 drain rounds", quiesce.ErrNotEmpty), Report: quiesce.Report{Nodes: 3, Pending: []quiesce.NodeReport{{Node: "n2", Violations: 3}}}},
			errors.New("only 5 of the job's 6 ranks"), -1, false, "only 5 of"},
		{"resume not confirmed", fmt.Errorf("resume of job j: %w", failed(gone, true)), nil, 4, true, "not confirmed on 2 nodes, first n2"},
		// The field decides, not the words: another release may say it
		// otherwise.
		{"reworded", abort(&quiesce.NodeError{Failed: 1, First: quiesce.NodeReport{Node: "n2", Err: "DRAIN: rank four went away",
			Fault: &quiesce.Fault{Code: node.FaultRankGone, Rank: 4}}}), nil, 4, true, "rank four went away"},
		{"blames nobody", abort(&quiesce.NodeError{Failed: 1, First: quiesce.NodeReport{Node: "n2", Err: "PREPARE: boom"}}), nil, -1, false, "boom"},
		{"not a node's", abort(fmt.Errorf("%w after 3 drain rounds", quiesce.ErrNotEmpty)), nil, -1, false, "drain timed out"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := failure(tc.err, quiesce.Result{}, tc.cause)
			if f.Rank != tc.rank || !strings.Contains(f.Reason, tc.reason) {
				t.Errorf("failure rank %d, reason %q; want rank %d, a reason with %q", f.Rank, f.Reason, tc.rank, tc.reason)
			}
			fa := fault(tc.err, tc.cause)
			if got := fa != nil && fa.Code == node.FaultRankGone; got != tc.rankGone {
				t.Errorf("rank gone %v (fault %+v), want %v", got, fa, tc.rankGone)
			}
		})
	}
	if !errors.Is(gone, node.ErrRankGone) || !errors.Is(full, node.ErrStashFull) {
		t.Error("the typed errors are not their sentinels")
	}
}

// TestStateAfter: every outcome the protocol reports for a failed pause has
// its state for the CLI, named, not copied.
func TestStateAfter(t *testing.T) {
	for _, tc := range []struct{ protocol, want string }{
		{quiesce.StateRunning, ctl.StateRunning},
		{quiesce.StatePaused, ctl.StatePaused},
		{quiesce.StateFailed, ctl.StateFailed},
		{"", ctl.StateRunning},
		{"frobbed", ctl.StateFailed},
	} {
		t.Run(cmp.Or(tc.protocol, "none"), func(t *testing.T) {
			if got := stateAfter(tc.protocol); got != tc.want {
				t.Errorf("stateAfter(%q) = %q, want %q", tc.protocol, got, tc.want)
			}
		})
	}
}

// TestStrangerSeesNoJob: a caller who neither owns the job nor is root
// gets, for every operation, exactly the answer about a job that does not
// exist (code, message): nothing about the job, not that it exists, not
// its owner. A job coordinated elsewhere is not forwarded for a stranger.
// The owner and root still see it.
func TestStrangerSeesNoJob(t *testing.T) {
	ctx := context.Background()
	daemon := func(jobs map[string]*job) *Daemon {
		d := newTestDaemon(t, "n0", nil, nil)
		d.reg.jobs = jobs
		return d
	}
	d := daemon(map[string]*job{
		"1000:here":      {id: "1000:here", name: "here", owner: 1000, adopted: true, coordinator: "n0", state: ctl.StatePaused, size: 2, localRanks: []int{0, 1}, nodes: []string{"n0"}},
		"1000:elsewhere": {id: "1000:elsewhere", name: "elsewhere", owner: 1000, adopted: true, coordinator: "n9", state: ctl.StateRunning, size: 2, localRanks: []int{1}},
	})
	empty := daemon(map[string]*job{})
	for _, id := range []string{"here", "elsewhere"} {
		for _, op := range []string{ctl.OpStatus, ctl.OpPause, ctl.OpResume} {
			req := ctl.Request{Version: ctl.Version, Op: op, Job: id}
			v, err := d.coord.do(ctx, req, 2000, nil)
			_, want := empty.coord.do(ctx, req, 2000, nil)
			var ce, wce *ctl.Error
			if !errors.As(err, &ce) || !errors.As(want, &wce) || ce.Code != wce.Code || ce.Message != wce.Message || v.ID != "" {
				t.Errorf("%s %s by a stranger: %+v, %v; want %v, as for no such job", op, id, v, err, want)
			}
			if err != nil && strings.Contains(err.Error(), "1000") {
				t.Errorf("%s %s by a stranger names the owner: %v", op, id, err)
			}
		}
	}
	for _, uid := range []uint32{1000, 0} {
		if v, err := d.coord.do(ctx, ctl.Request{Version: ctl.Version, Op: ctl.OpStatus, Job: "here"}, uid, nil); err != nil || v.ID != "here" || v.State != ctl.StatePaused {
			t.Errorf("status by uid %d: %+v, %v; want the job", uid, v, err)
		}
	}
	if l := d.coord.list(2000); len(l) != 0 {
		t.Errorf("list by a stranger: %+v", l)
	}
}
