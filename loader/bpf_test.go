package loader

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/testutil"
)

// openBPF opens a BPF observer for the test, closed (or detached, when
// pinned) at cleanup.
func openBPF(tb testing.TB, cfg Config) *BPFObserver {
	tb.Helper()
	o, err := OpenBPF(context.Background(), cfg)
	if err != nil {
		tb.Fatalf("OpenBPF: %v", err)
	}
	tb.Cleanup(func() { o.Detach() })
	return o
}

// waitFor polls Snapshot until cond holds or a deadline passes.
func waitFor(tb testing.TB, o Observer, what string, cond func([]Conn) bool) []Conn {
	tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		cs, err := o.Snapshot(context.Background())
		if err != nil {
			tb.Fatalf("Snapshot: %v", err)
		}
		if cond(cs) {
			return cs
		}
		if time.Now().After(deadline) {
			tb.Fatalf("timed out waiting for %s; last snapshot:\n%s", what, dump(cs))
		}
		time.Sleep(5 * time.Millisecond) // poll interval, not a readiness guess
	}
}

func dump(cs []Conn) string {
	var b strings.Builder
	for _, c := range cs {
		fmt.Fprintf(&b, "  %d %s %s->%s %s cg=%d sendq=%d unread=%d sent=%d recv=%d counted=%v retrans=%d\n",
			c.Cookie, c.Netns, c.Local, c.Remote, c.State, c.Cgroup, c.SendQueue, c.Unread, c.BytesSent, c.BytesRecv, c.Counted, c.Retransmits)
	}
	return b.String()
}

// storedCookies returns the cookies of every socket with a conns entry, in
// any network namespace; where the kernel refuses map iterators
// (ScansTCP), of every live job socket in the observer's namespaces, which
// is all an iter/tcp pass can see.
func storedCookies(tb testing.TB, o *BPFObserver) map[uint64]bool {
	tb.Helper()
	var recs []record
	if o.ScansTCP() {
		nss, err := o.ns.list()
		if err != nil {
			tb.Fatal(err)
		}
		for _, ns := range nss {
			rs, err := o.readTCPIter(ns)
			if err != nil {
				tb.Fatal(err)
			}
			recs = append(recs, rs...)
		}
	} else {
		var err error
		if recs, err = o.readConnIter(); err != nil {
			tb.Fatal(err)
		}
	}
	out := map[uint64]bool{}
	for _, r := range recs {
		out[r.Cookie] = true
	}
	return out
}

// pinCount is how many pins a complete set of o's has with watched cgroups
// watched (a sockops link each): the maps, and a link of each program of
// the whole job that the kernel loads (Features).
func pinCount(o *BPFObserver, watched int) int {
	n := len(mapPins) + watched
	for _, on := range []bool{o.features.State, o.features.Adoption, !o.ScansTCP()} {
		if on {
			n++
		}
	}
	return n
}

func byCookie(cs []Conn, cookie uint64) (Conn, bool) {
	for _, c := range cs {
		if c.Cookie == cookie {
			return c, true
		}
	}
	return Conn{}, false
}

// mustConn returns the connection with cookie from cs or fails.
func mustConn(tb testing.TB, cs []Conn, cookie uint64) Conn {
	tb.Helper()
	c, ok := byCookie(cs, cookie)
	if !ok {
		tb.Fatalf("cookie %d not in snapshot:\n%s", cookie, dump(cs))
	}
	return c
}

// has returns a condition that holds when cookie's connection satisfies f.
func has(cookie uint64, f func(Conn) bool) func([]Conn) bool {
	return func(cs []Conn) bool {
		c, ok := byCookie(cs, cookie)
		return ok && f(c)
	}
}

// connect makes a connection from a helper in the rig's a to one in b.
func connect(tb testing.TB, r *rig, client, server *helper) (cli, srv tcpConn) {
	tb.Helper()
	addr := server.do("listen %s:0", addrB)[0]
	cli = client.conn("dial %s", addr)
	srv = server.conn("accept")
	return cli, srv
}

// TestBPFTraffic checks what the observer reports against what two
// processes of the job cgroup, in two network namespaces, did.
func TestBPFTraffic(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})

	start := time.Now()
	cli, srv := connect(t, r, client, server)

	// n fits the receiver's initial window: the server reads nothing in
	// the first stage, and on a slow kernel (5.10 under emulation) the
	// window had not grown past 98,944 bytes when the test looked.
	const n, k, peekN, back = 60000, 30000, 20000, 5000
	// Each stage starts where the one before left the connection: after a
	// failed one, the rest would only report its consequences.
	for _, stage := range []struct {
		name string
		run  func(t *testing.T, client, server *helper)
	}{
		{"one way, delivered and acknowledged", func(t *testing.T, client, server *helper) {
			client.do("write %s %d", cli.id, n)
			cs := waitFor(t, o, "all bytes delivered and acknowledged", func(cs []Conn) bool {
				c, ok1 := byCookie(cs, cli.cookie)
				s, ok2 := byCookie(cs, srv.cookie)
				return ok1 && ok2 && c.SendQueue == 0 && s.Unread == n
			})
			c, s := mustConn(t, cs, cli.cookie), mustConn(t, cs, srv.cookie)
			for _, x := range []struct {
				name      string
				got, want any
			}{
				{"client local", c.Local.String(), cli.local},
				{"client remote", c.Remote.String(), cli.remote},
				{"server local", s.Local.String(), srv.local},
				{"server remote", s.Remote.String(), srv.remote},
				{"client netns", c.Netns, r.nsA},
				{"server netns", s.Netns, r.nsB},
				{"client state", c.State, StateEstablished},
				{"client cgroup", c.Cgroup, r.cgroupID},
				{"server cgroup", s.Cgroup, r.cgroupID},
				{"client counted", c.Counted, true},
				{"server counted", s.Counted, true},
				{"client sent", c.BytesSent, uint64(n)},
				{"client recv", c.BytesRecv, uint64(0)},
				{"server sent", s.BytesSent, uint64(0)},
				{"server recv", s.BytesRecv, uint64(0)},
				{"client acked all", c.SndUna, c.WriteSeq},
				{"seq match", s.RcvNxt, c.SndNxt},
			} {
				if x.got != x.want {
					t.Errorf("%s = %v, want %v", x.name, x.got, x.want)
				}
			}
			if c.Established.Before(start.Add(-time.Second)) || c.Established.After(time.Now()) {
				t.Errorf("client established at %v, want between %v and now", c.Established, start)
			}
		}},
		// Peeked bytes stay unread and uncounted.
		{"read in part, then peeked", func(t *testing.T, client, server *helper) {
			server.do("read %s %d", srv.id, k)
			if got := server.do("peek %s %d", srv.id, peekN)[0]; got != fmt.Sprint(peekN) {
				t.Fatalf("peeked %s bytes, want %d", got, peekN)
			}
			cs := waitFor(t, o, "partial read seen", has(srv.cookie, func(c Conn) bool { return c.BytesRecv == k }))
			if s := mustConn(t, cs, srv.cookie); s.Unread != n-k {
				t.Errorf("after reading %d of %d: Unread = %d, want %d", k, n, s.Unread, n-k)
			}
		}},
		{"the other way, then the rest", func(t *testing.T, client, server *helper) {
			server.do("write %s %d", srv.id, back)
			client.do("read %s %d", cli.id, back)
			server.do("read %s %d", srv.id, n-k)
			cs := waitFor(t, o, "both directions drained", func(cs []Conn) bool {
				c, ok1 := byCookie(cs, cli.cookie)
				s, ok2 := byCookie(cs, srv.cookie)
				return ok1 && ok2 && c.Empty() && s.Empty()
			})
			c, s := mustConn(t, cs, cli.cookie), mustConn(t, cs, srv.cookie)
			if c.BytesSent != n || c.BytesRecv != back || s.BytesSent != back || s.BytesRecv != n {
				t.Errorf("counters: client sent %d recv %d, server sent %d recv %d; want %d %d %d %d",
					c.BytesSent, c.BytesRecv, s.BytesSent, s.BytesRecv, n, back, back, n)
			}
			if len(cs) != 2 {
				t.Errorf("snapshot has %d connections, want 2:\n%s", len(cs), dump(cs))
			}
		}},
	} {
		if !t.Run(stage.name, func(t *testing.T) { stage.run(t, client.forTest(t), server.forTest(t)) }) {
			return
		}
	}
}

// TestBPFClose checks that a connection closed mid-test leaves the snapshot
// and the conns map, and that the others stay.
func TestBPFClose(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, Netns: []string{r.nsA, r.nsB}})

	cli1, srv1 := connect(t, r, client, server)
	cli2, srv2 := connect(t, r, client, server)
	client.do("write %s 1000", cli1.id)
	waitFor(t, o, "four ends", func(cs []Conn) bool { return len(cs) == 4 })

	client.do("close %s", cli1.id)
	server.do("close %s", srv1.id)
	cs := waitFor(t, o, "closed connection gone", func(cs []Conn) bool {
		_, ok1 := byCookie(cs, cli1.cookie)
		_, ok2 := byCookie(cs, srv1.cookie)
		return !ok1 && !ok2
	})
	mustConn(t, cs, cli2.cookie)
	mustConn(t, cs, srv2.cookie)
	// The client end lingers in TIME_WAIT, which is not a full socket; the
	// map entries are removed when each socket reaches TCP_CLOSE.
	stored := storedCookies(t, o)
	for _, cookie := range []uint64{cli1.cookie, srv1.cookie} {
		if stored[cookie] {
			t.Errorf("conns still holds closed socket %d", cookie)
		}
	}
	for _, cookie := range []uint64{cli2.cookie, srv2.cookie} {
		if !stored[cookie] {
			t.Errorf("conns lost open socket %d", cookie)
		}
	}
}

// TestBPFOutsideCgroup checks that sockets of processes outside the job
// cgroup, in the same namespaces, are not reported.
func TestBPFOutsideCgroup(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	otherC := startHelper(t, r.nsA, "")
	otherS := startHelper(t, r.nsB, "")
	o := openBPF(t, Config{Cgroup: r.cgroup, Netns: []string{r.nsA, r.nsB}})

	cli, srv := connect(t, r, client, server)
	ocli, osrv := connect(t, r, otherC, otherS)
	otherC.do("write %s 1000", ocli.id)
	client.do("write %s 1000", cli.id)
	cs := waitFor(t, o, "job connection", has(srv.cookie, func(c Conn) bool { return c.Unread == 1000 }))
	mustConn(t, cs, cli.cookie)
	for _, cookie := range []uint64{ocli.cookie, osrv.cookie} {
		if c, ok := byCookie(cs, cookie); ok {
			t.Errorf("socket outside the job cgroup reported: %+v", c)
		}
	}
	if len(cs) != 2 {
		t.Errorf("snapshot has %d connections, want 2:\n%s", len(cs), dump(cs))
	}
	stored := storedCookies(t, o)
	for _, cookie := range []uint64{ocli.cookie, osrv.cookie} {
		if stored[cookie] {
			t.Errorf("conns holds socket %d from outside the job", cookie)
		}
	}
}

// TestBPFEstablishedBeforeAttach checks that connections the job opened
// before the observer existed are found by their cgroup, report their whole
// history (the counters come from tcp_sock), one of them adopted after its
// FINs, and are forgotten when closed; on a kernel without adoption, that
// they are not seen.
func TestBPFEstablishedBeforeAttach(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	cli, srv := connect(t, r, client, server)
	client.do("write %s 700", cli.id)
	server.do("read %s 200", srv.id)
	server.do("write %s 50", srv.id)
	// A second one half closed: the client's FIN sent, the server's FIN
	// not, the server holding the client's FIN unread.
	cli2, srv2 := connect(t, r, client, server)
	client.do("write %s 300", cli2.id)
	client.do("shutw %s", cli2.id)
	server.do("read %s 100", srv2.id)

	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	if !o.Features().Adoption {
		// The kernel's mode (Features.Weaker): what was established
		// before the attach is not seen, what is established after is.
		cli3, _ := connect(t, r, client, server)
		cs := waitFor(t, o, "a connection made after the attach", has(cli3.cookie, func(Conn) bool { return true }))
		for _, cookie := range []uint64{cli.cookie, srv.cookie, cli2.cookie, srv2.cookie} {
			if _, ok := byCookie(cs, cookie); ok {
				t.Errorf("without adoption, a connection from before the attach is seen:\n%s", dump(cs))
			}
		}
		return
	}
	// Each stage starts where the one before left the connections: after a
	// failed one, the rest would only report its consequences.
	for _, stage := range []struct {
		name string
		run  func(t *testing.T, client, server *helper)
	}{
		{"found with their history", func(t *testing.T, client, server *helper) {
			cs := waitFor(t, o, "old connections", func(cs []Conn) bool {
				c, ok1 := byCookie(cs, cli.cookie)
				s, ok2 := byCookie(cs, srv2.cookie)
				return ok1 && ok2 && c.Unread == 50 && s.State == StateCloseWait
			})
			for _, x := range []struct {
				name       string
				cookie     uint64
				sent, recv uint64
				state      TCPState
			}{
				{"client", cli.cookie, 700, 0, StateEstablished},
				{"server", srv.cookie, 50, 200, StateEstablished},
				{"half-closed client", cli2.cookie, 300, 0, StateFinWait2},
				{"half-closed server", srv2.cookie, 0, 100, StateCloseWait},
			} {
				c := mustConn(t, cs, x.cookie)
				if !c.Counted || c.BytesSent != x.sent || c.BytesRecv != x.recv || c.State != x.state || !c.Established.IsZero() {
					t.Errorf("%s from before attach: Counted %v, sent %d, recv %d, %v, Established %v; want true, %d, %d, %v, zero",
						x.name, c.Counted, c.BytesSent, c.BytesRecv, c.State, c.Established, x.sent, x.recv, x.state)
				}
			}
			if c := mustConn(t, cs, srv2.cookie); c.Unread != 201 {
				t.Errorf("half-closed server: Unread %d, want 201 (200 bytes and the FIN)", c.Unread)
			}
		}},
		{"adopted, half-closed one after its FINs", func(t *testing.T, client, server *helper) {
			client.do("write %s 1234", cli.id)
			server.do("read %s 1734", srv.id)
			client.do("read %s 50", cli.id)
			server.do("read %s 200", srv2.id)
			server.do("eof %s", srv2.id)
			cs := waitFor(t, o, "adopted and drained", has(srv.cookie, func(c Conn) bool { return c.Empty() && c.BytesRecv == 1934 }))
			if c := mustConn(t, cs, cli.cookie); c.BytesSent != 1934 || c.BytesRecv != 50 {
				t.Errorf("adopted client: sent %d, recv %d; want 1934, 50", c.BytesSent, c.BytesRecv)
			}
			if c := mustConn(t, cs, srv2.cookie); c.BytesRecv != 300 || c.Unread != 0 {
				t.Errorf("half-closed server after reading to the end: recv %d, Unread %d; want 300, 0", c.BytesRecv, c.Unread)
			}
		}},
		{"forgotten when closed", func(t *testing.T, client, server *helper) {
			for _, x := range []struct {
				h  *helper
				id string
			}{{client, cli.id}, {server, srv.id}, {client, cli2.id}, {server, srv2.id}} {
				x.h.do("close %s", x.id)
			}
			waitFor(t, o, "closed", func(cs []Conn) bool { return len(cs) == 0 })
			if stored := storedCookies(t, o); len(stored) != 0 {
				t.Errorf("conns still holds %v after close", stored)
			}
		}},
	} {
		if !t.Run(stage.name, func(t *testing.T) { stage.run(t, client.forTest(t), server.forTest(t)) }) {
			return
		}
	}
}

// TestBPFExactCounts checks the byte counters against what the application
// did, where a count derived from tcp_sock is easiest to get wrong: bytes
// written but not acknowledged, a partial read and a peek, our FIN queued,
// then acknowledged, the peer's FIN unread, then read, and a socket closed
// with its FIN unacknowledged.
// It runs on each kernel mode: without the state tracepoint, sockops notes
// the FINs.
func TestBPFExactCounts(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, k := range kernelModes {
		t.Run(k.name, func(t *testing.T) {
			if !withRefused(t, k.refused) {
				return
			}
			testBPFExactCounts(t)
		})
	}
}

func testBPFExactCounts(t *testing.T) {
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	cli, srv := connect(t, r, client, server)

	snapshot := func(t *testing.T) []Conn {
		t.Helper()
		cs, err := o.Snapshot(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return cs
	}
	check := func(t *testing.T, what string, cs []Conn, end tcpConn, sent, recv uint64) Conn {
		t.Helper()
		c := mustConn(t, cs, end.cookie)
		if c.BytesSent != sent || c.BytesRecv != recv {
			t.Errorf("%s (%v, send-q %d, unread %d): sent %d, recv %d; want %d, %d",
				what, c.State, c.SendQueue, c.Unread, c.BytesSent, c.BytesRecv, sent, recv)
		}
		return c
	}
	const n, k, peekN, back = 3000, 1000, 500, 700
	// Each stage starts where the one before left the connection: after a
	// failed one, the rest would only report its consequences.
	for _, stage := range []struct {
		name string
		run  func(t *testing.T, client, server *helper)
	}{
		// The SYNs are not the application's bytes (bytes_acked counts the
		// client's).
		{"idle", func(t *testing.T, client, server *helper) {
			cs := waitFor(t, o, "both ends", func(cs []Conn) bool { return len(cs) == 2 })
			check(t, "idle client", cs, cli, 0, 0)
			check(t, "idle server", cs, srv, 0, 0)
		}},
		// The server's side of the link is down.
		{"written, not acknowledged", func(t *testing.T, client, server *helper) {
			ip(t, "-n", r.nsB, "link", "set", "eth0", "down")
			client.do("write %s %d", cli.id, n)
			if c := check(t, "client, nothing acknowledged", snapshot(t), cli, n, 0); c.SendQueue != n {
				t.Fatalf("client send-q %d, want %d: the bytes were acknowledged already", c.SendQueue, n)
			}
			ip(t, "-n", r.nsB, "link", "set", "eth0", "up")
			cs := waitFor(t, o, "acknowledged", has(cli.cookie, func(c Conn) bool { return c.SendQueue == 0 }))
			check(t, "client, all acknowledged", cs, cli, n, 0)
		}},
		// The peek counts nothing.
		{"read in part, then peeked", func(t *testing.T, client, server *helper) {
			server.do("read %s %d", srv.id, k)
			server.do("peek %s %d", srv.id, peekN)
			if s := check(t, "server after a partial read and a peek", snapshot(t), srv, 0, k); s.Unread != n-k {
				t.Errorf("server Unread %d, want %d", s.Unread, n-k)
			}
		}},
		// The client's FIN is not a byte it sent, queued or acknowledged;
		// nor is it one the server read, unread or read.
		{"shutdown(SHUT_WR)", func(t *testing.T, client, server *helper) {
			client.do("shutw %s", cli.id)
			check(t, "client right after shutdown", snapshot(t), cli, n, 0)
			cs := waitFor(t, o, "FIN acknowledged", func(cs []Conn) bool {
				c, ok1 := byCookie(cs, cli.cookie)
				s, ok2 := byCookie(cs, srv.cookie)
				return ok1 && ok2 && c.State == StateFinWait2 && s.State == StateCloseWait
			})
			check(t, "client in FIN_WAIT2", cs, cli, n, 0)
			check(t, "server in CLOSE_WAIT, FIN unread", cs, srv, 0, k)
			server.do("read %s %d", srv.id, n-k)
			check(t, "server, all read but the FIN", snapshot(t), srv, 0, n)
			server.do("eof %s", srv.id)
			if s := check(t, "server after reading the end of stream", snapshot(t), srv, 0, n); s.Unread != 0 {
				t.Errorf("server Unread %d after the end of stream, want 0", s.Unread)
			}
		}},
		{"the other way, to a half-closed client", func(t *testing.T, client, server *helper) {
			server.do("write %s %d", srv.id, back)
			client.do("read %s %d", cli.id, back)
			cs := waitFor(t, o, "reply acknowledged", has(srv.cookie, func(c Conn) bool { return c.SendQueue == 0 }))
			check(t, "client after the reply", cs, cli, n, back)
			check(t, "server after the reply", cs, srv, back, n)
		}},
		// The client's side of the link is down: the server's socket waits
		// in LAST_ACK, orphaned, its FIN unacknowledged.
		{"close() with the FIN unacknowledged", func(t *testing.T, client, server *helper) {
			ip(t, "-n", r.nsA, "link", "set", "eth0", "down")
			server.do("close %s", srv.id)
			cs := waitFor(t, o, "LAST_ACK", has(srv.cookie, func(c Conn) bool { return c.State == StateLastAck }))
			check(t, "server in LAST_ACK", cs, srv, back, n)
			check(t, "client, peer's FIN not arrived", cs, cli, n, back)
			ip(t, "-n", r.nsA, "link", "set", "eth0", "up")
			cs = waitFor(t, o, "client has the FIN", func(cs []Conn) bool {
				_, ok := byCookie(cs, cli.cookie)
				return !ok // TIME_WAIT: not a full socket any more
			})
			if _, ok := byCookie(cs, srv.cookie); ok {
				check(t, "server, last ACK on its way", cs, srv, back, n)
			}
		}},
	} {
		if !t.Run(stage.name, func(t *testing.T) { stage.run(t, client.forTest(t), server.forTest(t)) }) {
			return
		}
	}
}

// TestBPFCountersMonotonic takes snapshots while 256 MiB stream from client
// to server. A count summed from bytes_acked and snd_una read without the
// socket lock goes back and forth by an ACK's worth when an ACK lands
// between the two loads (bytes_received and rcv_nxt likewise): with the
// plain sums this failed within a second in each of three runs, by up to
// 450 KB; fill_record must not let that through.
func TestBPFCountersMonotonic(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	cli, srv := connect(t, r, client, server)

	const n = 256 << 20
	errs := make(chan error, 2)
	go func() { errs <- client.try("write %s %d", cli.id, n) }()
	go func() { errs <- server.try("read %s %d", srv.id, n) }()
	var last [2]uint64 // client sent, server read
	done, snaps := 0, 0
	for done < 2 {
		select {
		case err := <-errs:
			if err != nil {
				t.Fatal(err)
			}
			done++
			continue
		default:
		}
		cs, err := o.Snapshot(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		snaps++
		c, ok1 := byCookie(cs, cli.cookie)
		s, ok2 := byCookie(cs, srv.cookie)
		if !ok1 || !ok2 {
			t.Fatalf("connection missing:\n%s", dump(cs))
		}
		if c.BytesSent < last[0] || s.BytesRecv < last[1] {
			t.Fatalf("snapshot %d: counters went backwards: client sent %d after %d, server read %d after %d",
				snaps, c.BytesSent, last[0], s.BytesRecv, last[1])
		}
		if c.BytesSent > n || s.BytesRecv > n || c.BytesRecv != 0 || s.BytesSent != 0 {
			t.Fatalf("snapshot %d: client sent %d recv %d, server sent %d recv %d; more than was written (%d)",
				snaps, c.BytesSent, c.BytesRecv, s.BytesSent, s.BytesRecv, n)
		}
		last = [2]uint64{c.BytesSent, s.BytesRecv}
	}
	cs := waitFor(t, o, "drained", has(cli.cookie, func(c Conn) bool { return c.SendQueue == 0 }))
	if c, s := mustConn(t, cs, cli.cookie), mustConn(t, cs, srv.cookie); c.BytesSent != n || s.BytesRecv != n {
		t.Errorf("after %d snapshots: client sent %d, server read %d; want %d", snaps, c.BytesSent, s.BytesRecv, n)
	}
	o.mu.Lock()
	walks, lists := o.walks, o.connIter == nil && o.list != nil
	o.mu.Unlock()
	t.Logf("%d snapshots during the transfer, %d of them walks (a listed read can stand for them: %v)", snaps, walks, lists)
}

// TestBPFRetransmits cuts the link under a connection with data in flight
// and waits for the kernel's retransmissions to be counted.
func TestBPFRetransmits(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	cli, _ := connect(t, r, client, server)

	ip(t, "-n", r.nsB, "link", "set", "eth0", "down")
	client.do("write %s 1000", cli.id)
	waitFor(t, o, "a retransmission", has(cli.cookie, func(c Conn) bool { return c.Retransmits > 0 && c.SendQueue == 1000 }))
	ip(t, "-n", r.nsB, "link", "set", "eth0", "up")
	waitFor(t, o, "acknowledged after the link came back", has(cli.cookie, func(c Conn) bool { return c.SendQueue == 0 }))
}

// TestBPFIPv6 checks the IPv6 path with a loopback connection.
func TestBPFIPv6(t *testing.T) {
	testutil.RequirePrivileged(t)
	r := newRig(t)
	h := startHelper(t, r.nsA, r.cgroup)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	addr := h.do("listen [::1]:0")[0]
	cli := h.conn("dial %s", addr)
	srv := h.conn("accept")
	h.do("write %s 321", cli.id)
	cs := waitFor(t, o, "v6 data", has(srv.cookie, func(c Conn) bool { return c.Unread == 321 }))
	c := mustConn(t, cs, cli.cookie)
	if c.Local.String() != cli.local || c.Remote.String() != cli.remote || c.BytesSent != 321 {
		t.Errorf("got %s->%s sent %d; want %s->%s sent 321", c.Local, c.Remote, c.BytesSent, cli.local, cli.remote)
	}
}

// mountBPFFS mounts a private bpffs for the test.
func mountBPFFS(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		tb.Fatalf("mount bpffs: %v", err)
	}
	tb.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// sockopsAttached counts the sockops programs attached to the cgroup dir.
func sockopsAttached(tb testing.TB, dir string) int {
	tb.Helper()
	f, err := os.Open(dir)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: ebpf.AttachCGroupSockOps})
	if err != nil {
		tb.Fatalf("query sockops on %s: %v", dir, err)
	}
	return len(res.Programs)
}

// TestBPFPinReuse checks that pinned state outlives the observer, keeps
// registering connections while no observer runs, is found by the next Open, and that
// Detach removes it.
func TestBPFPinReuse(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	bpffs := mountBPFFS(t)
	cfg := Config{Cgroup: r.cgroup, FollowJob: true, Pin: true, BPFFS: bpffs}

	pinDir := filepath.Join(bpffs, "mpipause", fmt.Sprint(r.cgroupID))
	var cli, srv, cli2 tcpConn
	var o2 *BPFObserver
	defer func() {
		if o2 != nil {
			o2.Close()
		}
	}()
	// Each stage starts from the state the one before left: after a failed
	// one, the rest would only report its consequences.
	for _, stage := range []struct {
		name string
		run  func(t *testing.T, client, server *helper)
	}{
		{"Close leaves it pinned and attached", func(t *testing.T, client, server *helper) {
			o1, err := OpenBPF(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			if o1.Reused() {
				t.Fatal("first Open reused state")
			}
			cli, srv = connect(t, r, client, server)
			client.do("write %s 1000", cli.id)
			waitFor(t, o1, "counted", has(cli.cookie, func(c Conn) bool { return c.BytesSent == 1000 }))
			if err := o1.Close(); err != nil {
				t.Fatal(err)
			}
			ents, err := os.ReadDir(pinDir)
			if want := pinCount(o1, 1); err != nil || len(ents) != want {
				t.Fatalf("after Close, %s holds %d pins (%v), want %d", pinDir, len(ents), err, want)
			}
			if n := sockopsAttached(t, r.cgroup); n != 1 {
				t.Fatalf("after Close of a pinned observer, %d sockops programs attached, want 1", n)
			}
		}},
		// While no observer runs: more bytes, and a new connection.
		{"the next Open finds what happened meanwhile", func(t *testing.T, client, server *helper) {
			client.do("write %s 500", cli.id)
			cli2, _ = connect(t, r, client, server)
			server.do("read %s 1500", srv.id)

			var err error
			if o2, err = OpenBPF(context.Background(), cfg); err != nil {
				t.Fatal(err)
			}
			if !o2.Reused() {
				t.Error("second Open did not reuse the pinned state")
			}
			cs := waitFor(t, o2, "drained", has(srv.cookie, func(c Conn) bool { return c.Empty() }))
			if c := mustConn(t, cs, cli.cookie); c.BytesSent != 1500 {
				t.Errorf("client BytesSent = %d after reuse, want 1500 (counted across the restart)", c.BytesSent)
			}
			if c := mustConn(t, cs, srv.cookie); c.BytesRecv != 1500 {
				t.Errorf("server BytesRecv = %d after reuse, want 1500", c.BytesRecv)
			}
			if c := mustConn(t, cs, cli2.cookie); !c.Counted || c.Established.IsZero() {
				t.Errorf("connection made between the two opens: Counted %v, Established %v; want registered by sockops", c.Counted, c.Established)
			}
		}},
		{"Detach removes it", func(t *testing.T, client, server *helper) {
			if err := o2.Detach(); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(pinDir); !os.IsNotExist(err) {
				t.Errorf("after Detach, %s: %v; want it gone", pinDir, err)
			}
			if _, err := os.Stat(filepath.Join(bpffs, "mpipause")); !os.IsNotExist(err) {
				t.Errorf("after Detach, %s/mpipause: %v; want it gone", bpffs, err)
			}
			if n := sockopsAttached(t, r.cgroup); n != 0 {
				t.Errorf("after Detach, %d sockops programs attached, want 0", n)
			}
			if _, err := o2.Snapshot(context.Background()); err != ErrClosed {
				t.Errorf("Snapshot after Detach: %v, want ErrClosed", err)
			}
		}},
	} {
		if !t.Run(stage.name, func(t *testing.T) { stage.run(t, client.forTest(t), server.forTest(t)) }) {
			return
		}
	}
}

// TestBPFUnpin checks the package-level Unpin on state left by a closed
// observer, and that an unpinned observer leaves nothing attached.
func TestBPFUnpin(t *testing.T) {
	testutil.RequirePrivileged(t)
	t.Run("Unpin after Close with Pin", func(t *testing.T) {
		cg := testutil.NewCgroup(t)
		bpffs := mountBPFFS(t)
		cfg := Config{Cgroup: cg, Pin: true, BPFFS: bpffs}
		o := openBPF(t, cfg)
		o.Close()
		if n := sockopsAttached(t, cg); n != 1 {
			t.Fatalf("%d sockops attached after Close with Pin, want 1", n)
		}
		if err := Unpin(cfg); err != nil {
			t.Fatal(err)
		}
		if n := sockopsAttached(t, cg); n != 0 {
			t.Errorf("%d sockops attached after Unpin, want 0", n)
		}
		if _, err := os.Stat(filepath.Join(bpffs, "mpipause")); !os.IsNotExist(err) {
			t.Errorf("after Unpin, %s/mpipause: %v; want it gone", bpffs, err)
		}
		if err := Unpin(cfg); err != nil {
			t.Errorf("second Unpin: %v, want nil", err)
		}
	})
	t.Run("Close without Pin", func(t *testing.T) {
		cg := testutil.NewCgroup(t)
		o := openBPF(t, Config{Cgroup: cg, BPFFS: mountBPFFS(t)})
		if n := sockopsAttached(t, cg); n != 1 {
			t.Fatalf("%d sockops attached, want 1", n)
		}
		o.Close()
		if n := sockopsAttached(t, cg); n != 0 {
			t.Errorf("%d sockops attached after Close without Pin, want 0", n)
		}
	})
}

// TestBPFPinStale checks what mpid does with state pinned by another build
// (a job that ran across an upgrade): Open refuses it with ErrStalePin, and
// Unpin then Open starts afresh, adopting the open connection with its
// whole history.
func TestBPFPinStale(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	bpffs := mountBPFFS(t)
	cfg := Config{Cgroup: r.cgroup, FollowJob: true, Pin: true, BPFFS: bpffs}
	o1 := openBPF(t, cfg)
	cli, _ := connect(t, r, client, server)
	client.do("write %s 1000", cli.id)
	waitFor(t, o1, "counted", has(cli.cookie, func(c Conn) bool { return c.BytesSent == 1000 }))
	o1.Close()
	// Another build's records map: a different value size.
	path := filepath.Join(o1.PinDir(), pinRecords)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	old, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	if err := old.Pin(path); err != nil {
		t.Fatal(err)
	}

	if o, err := OpenBPF(context.Background(), cfg); !errors.Is(err, ErrStalePin) {
		if o != nil {
			o.Close()
		}
		t.Fatalf("Open over another build's pins: %v, want ErrStalePin", err)
	}
	if err := Unpin(cfg); err != nil {
		t.Fatal(err)
	}
	o2 := openBPF(t, cfg)
	if o2.Reused() {
		t.Error("state from another build was reused")
	}
	client.do("write %s 500", cli.id)
	if !o2.Features().Adoption {
		notAdopted(t, r, client, server, o2, cli.cookie)
		return
	}
	waitFor(t, o2, "1500 bytes counted", has(cli.cookie, func(c Conn) bool { return c.BytesSent == 1500 }))
}

// notAdopted checks what a kernel without adoption does with a connection
// made before the programs watching it were attached: the programs do not
// see it (Open's observer finds it through sock_diag: Complemented), and
// one made after is counted.
func notAdopted(t *testing.T, r *rig, client, server *helper, o *BPFObserver, old uint64) {
	t.Helper()
	fresh, _ := connect(t, r, client, server)
	client.do("write %s 10", fresh.id)
	cs := waitFor(t, o, "a connection made after the attach, counted", has(fresh.cookie, func(c Conn) bool { return c.BytesSent == 10 }))
	if _, ok := byCookie(cs, old); ok {
		t.Errorf("without adoption, the connection from before the attach is seen:\n%s", dump(cs))
	}
}

// TestBPFPinPartial checks recovery from a pin directory left half made (a
// crash between two pins): missing links are made anew over the pinned
// maps; a missing map starts the whole set afresh, which adopts the
// connection again, its history included.
func TestBPFPinPartial(t *testing.T) {
	testutil.RequirePrivileged(t)
	tests := []struct {
		name     string
		remove   string
		wantSent uint64
	}{
		{name: "link missing", remove: pinState, wantSent: 1500},
		{name: "map missing", remove: pinRecords, wantSent: 1500},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, client, server := newPair(t)
			bpffs := mountBPFFS(t)
			cfg := Config{Cgroup: r.cgroup, FollowJob: true, Pin: true, BPFFS: bpffs}
			o1, err := OpenBPF(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			cli, _ := connect(t, r, client, server)
			client.do("write %s 1000", cli.id)
			waitFor(t, o1, "counted", has(cli.cookie, func(c Conn) bool { return c.BytesSent == 1000 }))
			o1.Close()
			remove := tt.remove
			if remove == pinState && !o1.Features().State {
				remove = pinConnIter // this kernel has no state program: another link
			}
			if err := os.Remove(filepath.Join(o1.PinDir(), remove)); err != nil {
				t.Fatal(err)
			}

			o2 := openBPF(t, cfg)
			if o2.Reused() {
				t.Error("a partial set was reused as it was")
			}
			if ents, _ := os.ReadDir(o2.PinDir()); len(ents) != pinCount(o2, 1) {
				t.Errorf("%d pins after recovery, want %d (the cgroup's sockops link included)", len(ents), pinCount(o2, 1))
			}
			if n := sockopsAttached(t, r.cgroup); n != 1 {
				t.Errorf("%d sockops programs attached, want 1", n)
			}
			client.do("write %s 500", cli.id)
			if remove == pinRecords && !o2.Features().Adoption {
				notAdopted(t, r, client, server, o2, cli.cookie) // a set afresh
				return
			}
			waitFor(t, o2, fmt.Sprintf("%d bytes counted", tt.wantSent), has(cli.cookie, func(c Conn) bool { return c.BytesSent == tt.wantSent }))
		})
	}
}

// TestBPFScanTCP: where the kernel refuses the iterator over the conns map
// (refused here, so that every kernel runs it), Snapshot reads the job's
// connections with iter/tcp passes and counts the same bytes.
func TestBPFScanTCP(t *testing.T) {
	testutil.RequirePrivileged(t)
	if !withRefused(t, []string{ProgConnIter, ProgConnIterSkc}) {
		return
	}
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	if !o.ScansTCP() {
		t.Fatal("ScansTCP() = false with the map iterator refused")
	}
	cli, srv := connect(t, r, client, server)
	// A first pass before the bytes: every later Snapshot must read the
	// counters anew, not only the pass that adopted the namespace.
	waitFor(t, o, "both ends seen", has(cli.cookie, func(Conn) bool { return true }))
	const n = 50000
	client.do("write %s %d", cli.id, n)
	cs := waitFor(t, o, "all bytes delivered and acknowledged", func(cs []Conn) bool {
		c, ok1 := byCookie(cs, cli.cookie)
		s, ok2 := byCookie(cs, srv.cookie)
		return ok1 && ok2 && c.SendQueue == 0 && s.Unread == n
	})
	c, s := mustConn(t, cs, cli.cookie), mustConn(t, cs, srv.cookie)
	if c.BytesSent != n || s.BytesRecv != 0 || s.Netns != r.nsB || c.Netns != r.nsA || !c.Counted {
		t.Errorf("client sent %d (counted %v, %s), server recv %d (%s); want %d sent in %s, 0 read yet in %s:\n%s",
			c.BytesSent, c.Counted, c.Netns, s.BytesRecv, s.Netns, n, r.nsA, r.nsB, dump(cs))
	}
	if len(cs) != 2 {
		t.Errorf("%d connections, want the job's 2:\n%s", len(cs), dump(cs))
	}
}

// TestPacingSnapshot: a drain check's Snapshot (Pacing) reuses a recent
// walk of the job's cgroups for its namespaces only where conniter reads
// every namespace's records, so that a connection in a namespace the walk
// missed makes it walk again; with iter/tcp passes alone (conniter refused,
// by the kernel or the test) every Snapshot walks. Each mode this kernel
// can run is tested.
func TestPacingSnapshot(t *testing.T) {
	testutil.RequirePrivileged(t)
	t.Run("iter-tcp-passes", func(t *testing.T) {
		if !withRefused(t, []string{ProgConnIter, ProgConnIterSkc}) {
			return
		}
		testPacing(t, false)
	})
	t.Run("kernel-as-is", func(t *testing.T) {
		f, err := Probe()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("conniter on this kernel: %q", f.ConnIter)
		testPacing(t, f.ConnIter != "")
	})
}

func testPacing(t *testing.T, reuses bool) {
	r := newRig(t)
	client := startHelper(t, r.nsA, r.cgroup)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	if (o.connIter != nil) != reuses {
		t.Fatalf("conniter loaded: %v, want %v", o.connIter != nil, reuses)
	}
	pace := Pacing(context.Background())
	snap := func(ctx context.Context) []Conn {
		t.Helper()
		cs, err := o.Snapshot(ctx)
		if err != nil {
			t.Fatalf("Snapshot: %v", err)
		}
		return cs
	}
	walks := func() int { return o.ns.walks }

	snap(context.Background())
	w := walks()
	snap(pace)
	if reuses && walks() != w {
		t.Errorf("a Pacing Snapshot right after a walk walked again")
	}
	if !reuses && walks() != w+1 {
		t.Errorf("a Pacing Snapshot without conniter reused a walk")
	}

	// The server starts in nsB, where no process of the job was at the
	// last walk, and the connection is made there.
	server := startHelper(t, r.nsB, r.cgroup)
	cli, srv := connect(t, r, client, server)
	w = walks()
	cs := snap(pace)
	s, ok := byCookie(cs, srv.cookie)
	if !ok {
		t.Fatalf("a Pacing Snapshot left out the connection in a namespace its reused walk did not list:\n%s", dump(cs))
	}
	if s.Netns != r.nsB {
		t.Errorf("its server end's namespace %q, want %q", s.Netns, r.nsB)
	}
	mustConn(t, cs, cli.cookie)
	if walks() != w+1 {
		t.Errorf("walks: %d after the unknown namespace, want %d", walks(), w+1)
	}
	if !reuses {
		return
	}

	w = walks()
	snap(pace)
	if walks() != w {
		t.Errorf("a Pacing Snapshot walked with every connection's namespace listed")
	}
	snap(context.Background())
	if walks() != w+1 {
		t.Errorf("a Snapshot without Pacing did not walk")
	}

	o.ns.lastAt = o.ns.lastAt.Add(-PacingReuse)
	w = walks()
	snap(pace)
	if walks() != w+1 {
		t.Errorf("a Pacing Snapshot reused a walk PacingReuse old")
	}

	other := testutil.NewCgroup(t)
	if err := o.Watch(other); err != nil {
		t.Fatal(err)
	}
	w = walks()
	snap(pace)
	if walks() != w+1 {
		t.Errorf("a Pacing Snapshot reused a walk made before a Watch")
	}
}

// TestRecheck: where each Snapshot walks the hash tables (conniter
// refused, by the kernel or the test), Recheck reads the connections a
// Snapshot listed again by exact lookups, in each of their namespaces:
// state, queues and byte counts as a Snapshot then reads them (bytes
// written since counted by both alike), the sequence numbers left out; a
// connection closed since comes back out of ESTABLISHED and uncounted,
// one made since not at all. Where conniter loads, Recheck declines
// (ErrNoRecheck).
func TestRecheck(t *testing.T) {
	testutil.RequirePrivileged(t)
	t.Run("iter-tcp-passes", func(t *testing.T) {
		if !withRefused(t, []string{ProgConnIter, ProgConnIterSkc}) {
			return
		}
		testRecheck(t, true)
	})
	t.Run("kernel-as-is", func(t *testing.T) {
		f, err := Probe()
		if err != nil {
			t.Fatal(err)
		}
		testRecheck(t, f.ConnIter == "")
	})
}

func testRecheck(t *testing.T, rechecks bool) {
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	cli, srv := connect(t, r, client, server)
	const n = 30000
	client.do("write %s %d", cli.id, n)
	cs := waitFor(t, o, "the bytes delivered and acknowledged", func(cs []Conn) bool {
		c, ok1 := byCookie(cs, cli.cookie)
		s, ok2 := byCookie(cs, srv.cookie)
		return ok1 && ok2 && c.SendQueue == 0 && s.Unread == n
	})
	got, err := o.Recheck(context.Background(), cs)
	if !rechecks {
		if !errors.Is(err, ErrNoRecheck) {
			t.Fatalf("Recheck with conniter loaded: %v, want ErrNoRecheck", err)
		}
		return
	}
	if err != nil {
		t.Fatalf("Recheck: %v", err)
	}
	if len(got) != len(cs) {
		t.Fatalf("Recheck returned %d connections for %d:\n%s", len(got), len(cs), dump(got))
	}
	same := func(got, cs []Conn) {
		t.Helper()
		for _, g := range got {
			c := mustConn(t, cs, g.Cookie)
			// Both ends were registered by sockops: their counts are
			// exact in both reads, where nothing is queued to send.
			counted := c.State == StateEstablished && c.SendQueue == 0
			if g.Cookie != c.Cookie || g.Local != c.Local || g.Remote != c.Remote || g.Netns != c.Netns || g.State != c.State ||
				g.SendQueue != c.SendQueue || g.Unread != c.Unread || g.Counted != counted || counted && !c.Counted ||
				counted && g.BytesSent != c.BytesSent || g.BytesRecv != 0 || g.Retransmits != 0 ||
				g.Active != c.Active || g.WriteSeq != 0 {
				t.Errorf("rechecked %+v\nsnapshot  %+v", g, c)
			}
		}
	}
	same(got, cs)
	if s := mustConn(t, got, srv.cookie); s.Netns != r.nsB || s.Unread != n {
		t.Errorf("the server end in %q with %d unread, want %q and %d", s.Netns, s.Unread, r.nsB, n)
	}
	if c, s := mustConn(t, cs, cli.cookie), mustConn(t, cs, srv.cookie); !c.Active || s.Active {
		t.Errorf("the client Active %v, the server %v: want true, false", c.Active, s.Active)
	}
	// Bytes written since, their first transmit refused (the sender's
	// link down): while queued the recheck cannot count them, once
	// acknowledged it counts them as the next walk does, once, where
	// tcp_info's bytes_sent has them twice (TestTakenAheadOfWalk).
	const m = 12345
	ip(t, "-n", r.nsA, "link", "set", "eth0", "down")
	client.do("write %s %d", cli.id, m)
	queued := waitFor(t, o, "the second write queued", has(cli.cookie, func(c Conn) bool { return c.SendQueue == m }))
	if got, err = o.Recheck(context.Background(), cs); err != nil {
		t.Fatalf("Recheck: %v", err)
	}
	same(got, queued)
	ip(t, "-n", r.nsA, "link", "set", "eth0", "up")
	cs2 := waitFor(t, o, "the second write delivered and acknowledged", func(cs []Conn) bool {
		c, ok1 := byCookie(cs, cli.cookie)
		s, ok2 := byCookie(cs, srv.cookie)
		return ok1 && ok2 && c.SendQueue == 0 && s.Unread == n+m
	})
	// From the recheck that could not count: it counts again.
	if got, err = o.Recheck(context.Background(), got); err != nil {
		t.Fatalf("Recheck: %v", err)
	}
	same(got, cs2)
	if c, c0 := mustConn(t, got, cli.cookie), mustConn(t, cs, cli.cookie); c.BytesSent != c0.BytesSent+m {
		t.Errorf("rechecked after %d more bytes: %d sent, %d before", m, c.BytesSent, c0.BytesSent)
	}
	// Closed since, and made since.
	cli2, _ := connect(t, r, client, server)
	client.do("close %s", cli.id)
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err = o.Recheck(context.Background(), cs)
		if err != nil {
			t.Fatalf("Recheck: %v", err)
		}
		if c := mustConn(t, got, cli.cookie); c.State != StateEstablished {
			if c.Counted {
				t.Errorf("the closed client rechecked counted: %+v", c)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the closed client still ESTABLISHED after 10 s:\n%s", dump(got))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if _, ok := byCookie(got, cli2.cookie); ok {
		t.Errorf("Recheck listed a connection made after the Snapshot it rechecked")
	}
	// Where the walk costs less than the lookups would, it declines.
	o.mu.Lock()
	o.walkCost = time.Nanosecond
	o.mu.Unlock()
	if _, err := o.Recheck(context.Background(), cs); !errors.Is(err, ErrNoRecheck) {
		t.Errorf("Recheck with a walk cheaper than its lookups: %v, want ErrNoRecheck", err)
	}
}
