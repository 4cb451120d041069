package mpid

import (
	"strings"
	"testing"

	"github.com/mpipause/mpipause/quiesce"
)

func TestWaitingOnNamesWhatHoldsBytes(t *testing.T) {
	rep := quiesce.Report{Nodes: 3, Pending: []quiesce.NodeReport{
		{Node: "node0", Ungated: 1, Conns: []quiesce.Conn{
			{Node: "node0", Local: "10.0.0.1:5000", Remote: "10.0.0.2:6000", SendQueue: 4096, Rank: 1},
			{Node: "node0", Local: "10.0.0.1:5001", Remote: "10.0.0.3:6001", Unread: 52, Rank: 0},
		}},
		{Node: "node2", Err: "no answer"},
	}}
	got := waitingOn(rep, 8)
	want := `node0: 1 socket still mid-send rank 1 10.0.0.1:5000->10.0.0.2:6000 unacked 4096, rank 0 10.0.0.1:5001->10.0.0.3:6001 unread 52; node2: error "no answer"`
	if got != want {
		t.Fatalf("waitingOn:\n got %s\nwant %s", got, want)
	}
	// A job's thousands of connections are cut to the bound, and the rest counted.
	many := quiesce.Report{Pending: []quiesce.NodeReport{{Node: "n"}}}
	for i := 0; i < 1000; i++ {
		many.Pending[0].Conns = append(many.Pending[0].Conns, quiesce.Conn{Local: "a:1", Remote: "b:2", Unread: 1, Rank: i})
	}
	got = waitingOn(many, 8)
	if n := strings.Count(got, "rank "); n != 8 || !strings.HasSuffix(got, "(and 992 more connections)") {
		t.Fatalf("waitingOn of 1000 connections lists %d and ends %q; want 8 and the other 992 counted", n, got[max(0, len(got)-40):])
	}
}
