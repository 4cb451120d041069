package loader

import (
	"context"
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
// any network namespace.
func storedCookies(tb testing.TB, o *BPFObserver) map[uint64]bool {
	tb.Helper()
	recs, err := o.readConnIter()
	if err != nil {
		tb.Fatal(err)
	}
	out := map[uint64]bool{}
	for _, r := range recs {
		out[r.Cookie] = true
	}
	return out
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
	r := newRig(t)
	client := startHelper(t, r.nsA, r.cgroup)
	server := startHelper(t, r.nsB, r.cgroup)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})

	start := time.Now()
	cli, srv := connect(t, r, client, server)

	const n, k, peekN, back = 100000, 30000, 20000, 5000
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

	// A partial read, then a peek: peeked bytes stay unread and uncounted.
	server.do("read %s %d", srv.id, k)
	if got := server.do("peek %s %d", srv.id, peekN)[0]; got != fmt.Sprint(peekN) {
		t.Fatalf("peeked %s bytes, want %d", got, peekN)
	}
	cs = waitFor(t, o, "partial read seen", has(srv.cookie, func(c Conn) bool { return c.BytesRecv == k }))
	if s := mustConn(t, cs, srv.cookie); s.Unread != n-k {
		t.Errorf("after reading %d of %d: Unread = %d, want %d", k, n, s.Unread, n-k)
	}

	// The other direction, then the rest.
	server.do("write %s %d", srv.id, back)
	client.do("read %s %d", cli.id, back)
	server.do("read %s %d", srv.id, n-k)
	cs = waitFor(t, o, "both directions drained", func(cs []Conn) bool {
		c, ok1 := byCookie(cs, cli.cookie)
		s, ok2 := byCookie(cs, srv.cookie)
		return ok1 && ok2 && c.Empty() && s.Empty()
	})
	c, s = mustConn(t, cs, cli.cookie), mustConn(t, cs, srv.cookie)
	if c.BytesSent != n || c.BytesRecv != back || s.BytesSent != back || s.BytesRecv != n {
		t.Errorf("counters: client sent %d recv %d, server sent %d recv %d; want %d %d %d %d",
			c.BytesSent, c.BytesRecv, s.BytesSent, s.BytesRecv, n, back, back, n)
	}
	if len(cs) != 2 {
		t.Errorf("snapshot has %d connections, want 2:\n%s", len(cs), dump(cs))
	}
}

// TestBPFClose checks that a connection closed mid-test leaves the snapshot
// and the conns map, and that the others stay.
func TestBPFClose(t *testing.T) {
	testutil.RequirePrivileged(t)
	r := newRig(t)
	client := startHelper(t, r.nsA, r.cgroup)
	server := startHelper(t, r.nsB, r.cgroup)
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
	r := newRig(t)
	client := startHelper(t, r.nsA, r.cgroup)
	server := startHelper(t, r.nsB, r.cgroup)
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

// TestBPFEstablishedBeforeAttach checks that a connection the job opened
// before the observer existed is found by its cgroup, adopted for counting
// from then on, and forgotten when closed.
func TestBPFEstablishedBeforeAttach(t *testing.T) {
	testutil.RequirePrivileged(t)
	r := newRig(t)
	client := startHelper(t, r.nsA, r.cgroup)
	server := startHelper(t, r.nsB, r.cgroup)
	cli, srv := connect(t, r, client, server)
	client.do("write %s 700", cli.id) // before: not counted

	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	cs := waitFor(t, o, "old connection", has(srv.cookie, func(c Conn) bool { return c.Unread == 700 }))
	if c := mustConn(t, cs, cli.cookie); !c.Counted || c.BytesSent != 0 || !c.Established.IsZero() {
		t.Errorf("connection from before attach: Counted %v, BytesSent %d, Established %v; want adopted: true, 0, zero", c.Counted, c.BytesSent, c.Established)
	}

	client.do("write %s 1234", cli.id)
	server.do("read %s 1934", srv.id)
	cs = waitFor(t, o, "adopted and drained", has(srv.cookie, func(c Conn) bool { return c.Empty() && c.BytesRecv == 1934 }))
	if c := mustConn(t, cs, cli.cookie); !c.Counted || c.BytesSent != 1234 {
		t.Errorf("adopted client: Counted %v, BytesSent %d; want true, 1234", c.Counted, c.BytesSent)
	}

	client.do("close %s", cli.id)
	server.do("close %s", srv.id)
	waitFor(t, o, "closed", func(cs []Conn) bool { return len(cs) == 0 })
	if stored := storedCookies(t, o); len(stored) != 0 {
		t.Errorf("conns still holds %v after close", stored)
	}
}

// TestBPFRetransmits cuts the link under a connection with data in flight
// and waits for the kernel's retransmissions to be counted.
func TestBPFRetransmits(t *testing.T) {
	testutil.RequirePrivileged(t)
	r := newRig(t)
	client := startHelper(t, r.nsA, r.cgroup)
	server := startHelper(t, r.nsB, r.cgroup)
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
// counting while no observer runs, is found by the next Open, and that
// Detach removes it.
func TestBPFPinReuse(t *testing.T) {
	testutil.RequirePrivileged(t)
	r := newRig(t)
	bpffs := mountBPFFS(t)
	client := startHelper(t, r.nsA, r.cgroup)
	server := startHelper(t, r.nsB, r.cgroup)
	cfg := Config{Cgroup: r.cgroup, FollowJob: true, Pin: true, BPFFS: bpffs}

	o1, err := OpenBPF(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if o1.Reused() {
		t.Fatal("first Open reused state")
	}
	cli, srv := connect(t, r, client, server)
	client.do("write %s 1000", cli.id)
	waitFor(t, o1, "counted", has(cli.cookie, func(c Conn) bool { return c.BytesSent == 1000 }))
	if err := o1.Close(); err != nil {
		t.Fatal(err)
	}
	pinDir := filepath.Join(bpffs, "mpipause", fmt.Sprint(r.cgroupID))
	ents, err := os.ReadDir(pinDir)
	if want := len(mapPins) + len(linkPins); err != nil || len(ents) != want {
		t.Fatalf("after Close, %s holds %d pins (%v), want %d", pinDir, len(ents), err, want)
	}
	if n := sockopsAttached(t, r.cgroup); n != 1 {
		t.Fatalf("after Close of a pinned observer, %d sockops programs attached, want 1", n)
	}

	// While no observer runs: more bytes, and a new connection.
	client.do("write %s 500", cli.id)
	cli2, _ := connect(t, r, client, server)
	server.do("read %s 1500", srv.id)

	o2, err := OpenBPF(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Close()
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
}

// TestBPFUnpin checks the package-level Unpin on state left by a closed
// observer, and that an unpinned observer leaves nothing attached.
func TestBPFUnpin(t *testing.T) {
	testutil.RequirePrivileged(t)
	cg := newCgroup(t)
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

	cfg.Pin = false
	o = openBPF(t, cfg)
	if n := sockopsAttached(t, cg); n != 1 {
		t.Fatalf("%d sockops attached, want 1", n)
	}
	o.Close()
	if n := sockopsAttached(t, cg); n != 0 {
		t.Errorf("%d sockops attached after Close without Pin, want 0", n)
	}
}

// TestBPFPinPartial checks recovery from a pin directory left half made (a
// crash between two pins): missing links are made anew over the pinned
// maps, counters kept; a missing map starts the whole set afresh.
func TestBPFPinPartial(t *testing.T) {
	testutil.RequirePrivileged(t)
	tests := []struct {
		name     string
		remove   string
		wantSent uint64
	}{
		{name: "link missing", remove: pinSend, wantSent: 1500},
		{name: "map missing", remove: pinRecords, wantSent: 500},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRig(t)
			bpffs := mountBPFFS(t)
			client := startHelper(t, r.nsA, r.cgroup)
			server := startHelper(t, r.nsB, r.cgroup)
			cfg := Config{Cgroup: r.cgroup, FollowJob: true, Pin: true, BPFFS: bpffs}
			o1, err := OpenBPF(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			cli, _ := connect(t, r, client, server)
			client.do("write %s 1000", cli.id)
			waitFor(t, o1, "counted", has(cli.cookie, func(c Conn) bool { return c.BytesSent == 1000 }))
			o1.Close()
			if err := os.Remove(filepath.Join(o1.PinDir(), tt.remove)); err != nil {
				t.Fatal(err)
			}

			o2 := openBPF(t, cfg)
			if o2.Reused() {
				t.Error("a partial set was reused as it was")
			}
			if ents, _ := os.ReadDir(o2.PinDir()); len(ents) != len(mapPins)+len(linkPins) {
				t.Errorf("%d pins after recovery, want %d", len(ents), len(mapPins)+len(linkPins))
			}
			if n := sockopsAttached(t, r.cgroup); n != 1 {
				t.Errorf("%d sockops programs attached, want 1", n)
			}
			client.do("write %s 500", cli.id)
			waitFor(t, o2, fmt.Sprintf("%d bytes counted", tt.wantSent), has(cli.cookie, func(c Conn) bool { return c.BytesSent == tt.wantSent }))
		})
	}
}
