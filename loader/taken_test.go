package loader

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/mpipause/mpipause/internal/sockdiag"
	"github.com/mpipause/mpipause/internal/testutil"
)

// TestTakenAheadOfWalk: tcp_info's count of the bytes a socket took
// (sockdiag.TCPInfo.Taken, the shim's "held from") counts bytes again
// that a transmit refused below TCP left unsent: tcpi_bytes_sent grows at
// each attempt, and the bytes stay in tcpi_notsent_bytes. The walk's count
// (write_seq less where the data starts) does not. With the sender's own
// link down (no route: every kernel refuses at once, where a peer's link
// down is refused or silently dropped depending on the driver and on
// whether the link watcher has run yet), 3,000 bytes written read as more
// than 3,000 by tcp_info and exactly 3,000 by the walk, and stay ahead
// once acknowledged. So the two are never compared with each other: a place
// in the stream read from tcp_info is compared with tcp_info's count
// (internal/node, late; docs/guarantees.md, G4).
func TestTakenAheadOfWalk(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	cli, _ := connect(t, r, client, server)
	ns, err := os.Open(filepath.Join("/run/netns", r.nsA))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	d, err := sockdiag.DialDiag(int(ns.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	const n = 3000
	compare := func(what string, acked bool) {
		t.Helper()
		cs := waitFor(t, o, what, has(cli.cookie, func(c Conn) bool { return (c.SendQueue == 0) == acked }))
		c := mustConn(t, cs, cli.cookie)
		got, ok, err := d.LookupTCP(ctx, []sockdiag.ID{{Local: c.Local, Remote: c.Remote, Cookie: c.Cookie}})
		if err != nil || !ok[0] {
			t.Fatalf("%s: lookup: found %v, %v", what, ok, err)
		}
		taken, can := got[0].Info.Taken()
		if !can {
			t.Fatalf("%s: this kernel's tcp_info has no byte counts (before 4.19, below the floor)", what)
		}
		if !c.Counted || c.BytesSent != n || taken <= n {
			t.Errorf("%s: the walk counts %d (counted %v), tcp_info %d; want %d, and tcp_info ahead", what, c.BytesSent, c.Counted, taken, n)
		}
		t.Logf("%s: the walk counts %d, tcp_info %d", what, c.BytesSent, taken)
	}
	ip(t, "-n", r.nsA, "link", "set", "eth0", "down")
	client.do("write %s %d", cli.id, n)
	compare("written, the sender's link down", false)
	ip(t, "-n", r.nsA, "link", "set", "eth0", "up")
	compare("acknowledged", true)
}
