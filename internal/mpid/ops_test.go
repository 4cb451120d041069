package mpid

import (
	"fmt"
	"slices"
	"strings"
	"testing"

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
}
