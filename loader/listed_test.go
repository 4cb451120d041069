package loader

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
)

// TestListedRead: where map iterators are refused, a Snapshot after the
// walk that adopted every namespace reads the job's connections from
// connlist, each looked up by sock_diag, without a walk, and reads what a
// walk reads: every field the node uses, of every connection, one made
// since the walk included, and bytes whose first transmit the device
// refused counted once (tcp_info's bytes_sent has them twice). It walks
// instead where the list cannot stand for a walk: a connection past
// ESTABLISHED (the walk counts its FIN apart), an entry whose socket is
// not there (taken off the list, so that the next read lists), lookups
// that would cost more than the last walk, entries the list could not take, a connection established before the observer
// attached (adopted: its count's base is the walk's own). Each case fails where a listed read stands for a walk it must not
// (the walks counter would not move) or misses what a walk sees.
func TestListedRead(t *testing.T) {
	testutil.RequirePrivileged(t)
	if !withRefused(t, []string{ProgConnIter, ProgConnIterSkc}) {
		return
	}
	ctx := context.Background()
	r, client, server := newPair(t)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	cli, srv := connect(t, r, client, server)
	const n = 30000
	client.do("write %s %d", cli.id, n)
	waitFor(t, o, "the bytes delivered and acknowledged", func(cs []Conn) bool {
		c, ok1 := byCookie(cs, cli.cookie)
		s, ok2 := byCookie(cs, srv.cookie)
		return ok1 && ok2 && c.SendQueue == 0 && s.Unread == n
	})
	snap := func(what string, walk bool) []Conn {
		t.Helper()
		before := o.walks
		cs, err := o.Snapshot(ctx)
		if err != nil {
			t.Fatalf("%s: Snapshot: %v", what, err)
		}
		if walked := o.walks > before; walked != walk {
			t.Fatalf("%s: the Snapshot walked %v, want %v:\n%s", what, walked, walk, dump(cs))
		}
		return cs
	}
	walkNow := func(what string) []Conn {
		t.Helper()
		o.listFrom.ok = false
		return snap(what, true)
	}
	same := func(what string, listed, walked []Conn) {
		t.Helper()
		if len(listed) != len(walked) {
			t.Fatalf("%s: listed %d connections, the walk %d:\nlisted\n%swalked\n%s", what, len(listed), len(walked), dump(listed), dump(walked))
		}
		for _, l := range listed {
			w := mustConn(t, walked, l.Cookie)
			d := l.Established.Sub(w.Established)
			if l.Local != w.Local || l.Remote != w.Remote || l.State != w.State || l.Netns != w.Netns || l.Cgroup != w.Cgroup ||
				l.WriteSeq != w.WriteSeq || l.SndUna != w.SndUna || l.SndNxt != w.SndNxt ||
				l.SendQueue != w.SendQueue || l.Unread != w.Unread || l.Counted != w.Counted ||
				l.BytesSent != w.BytesSent || l.BytesRecv != w.BytesRecv || l.Retransmits != w.Retransmits || l.Active != w.Active ||
				w.Established.IsZero() || d < -time.Millisecond || d > time.Millisecond {
				t.Errorf("%s:\nlisted %+v\nwalked %+v", what, l, w)
			}
		}
	}
	listed := snap("after the walk", false)
	same("bytes delivered", listed, walkNow("bytes delivered"))

	// Bytes in flight both ways, and a connection made since the last
	// walk: the list has it.
	cli2, srv2 := connect(t, r, client, server)
	server.do("write %s %d", srv2.id, 7777)
	client.do("write %s %d", cli.id, 4321)
	listed = snap("a connection made since the walk", false)
	if _, ok := byCookie(listed, cli2.cookie); !ok {
		t.Fatalf("the connection made since the walk is not listed:\n%s", dump(listed))
	}
	if _, ok := byCookie(listed, srv2.cookie); !ok {
		t.Fatalf("the accepted end made since the walk is not listed:\n%s", dump(listed))
	}
	walked := walkNow("a connection made since the walk")
	// The bytes may have moved between the two reads: compare once they
	// have settled.
	client.do("read %s %d", cli2.id, 7777)
	server.do("read %s %d", srv.id, n+4321)
	for range 100 {
		listed = snap("settled", false)
		walked = walkNow("settled")
		if settled(listed) && settled(walked) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	same("two connections, every byte read", listed, walked)

	// A connection past ESTABLISHED: the walk reads where its FIN is.
	client.do("close %s", cli2.id)
	snap("a connection closing", true)
	server.do("eof %s", srv2.id)
	server.do("close %s", srv2.id)
	waitFor(t, o, "the closed connection gone", func(cs []Conn) bool {
		_, ok1 := byCookie(cs, cli2.cookie)
		_, ok2 := byCookie(cs, srv2.cookie)
		return !ok1 && !ok2 && len(cs) == 2
	})
	listed = snap("after the close", false)
	same("after the close", listed, walkNow("after the close"))

	// Bytes whose first transmit the device refused (the sender's link
	// down): tcp_info's bytes_sent has them twice, the listed read once,
	// queued and once acknowledged (TestTakenAheadOfWalk).
	const m = 12345
	ip(t, "-n", r.nsA, "link", "set", "eth0", "down")
	client.do("write %s %d", cli.id, m)
	listed = snap("bytes queued after a refused transmit", false)
	if c := mustConn(t, listed, cli.cookie); c.SendQueue != m {
		t.Fatalf("the refused bytes not queued: %+v", c)
	}
	same("bytes queued after a refused transmit", listed, walkNow("bytes queued after a refused transmit"))
	ip(t, "-n", r.nsA, "link", "set", "eth0", "up")
	server.do("read %s %d", srv.id, m)
	for range 500 {
		if listed = snap("the refused bytes acknowledged", false); settled(listed) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	same("the refused bytes acknowledged", listed, walkNow("the refused bytes acknowledged"))

	// An entry whose socket is not there (freed while the programs were
	// not attached): the Snapshot walks and takes it off the list, and
	// the next lists again.
	st, err := os.Stat(filepath.Join("/run/netns", r.nsA))
	if err != nil {
		t.Fatal(err)
	}
	stale := listEntry{Netns: uint32(st.Sys().(*syscall.Stat_t).Ino), Flags: connFSockops}
	if err := o.list.Put(uint64(1<<62), stale); err != nil {
		t.Fatal(err)
	}
	snap("a stale entry", true)
	snap("after the walk that took the stale entry off", false)

	// Where the lookups would cost more than a walk, it walks (and the
	// walk's cost is measured again).
	o.walkCost = time.Nanosecond
	snap("lookups dearer than the last walk", true)
	snap("after that walk", false)

	// An entry the list could not take: the next Snapshot walks, and
	// the one after lists again.
	lost, err := o.lostCount()
	if err != nil {
		t.Fatal(err)
	}
	if err := o.lost.Put(uint32(0), lost+1); err != nil {
		t.Fatal(err)
	}
	snap("an entry lost", true)
	snap("after the walk that followed the loss", false)

	// A connection established before the observer attached: adopted,
	// never listed from a read of the list.
	r2, client2, server2 := newPair(t)
	connect(t, r2, client2, server2)
	o2 := openBPF(t, Config{Cgroup: r2.cgroup, FollowJob: true})
	for i := range 2 {
		before := o2.walks
		if cs, err := o2.Snapshot(ctx); err != nil || len(cs) != 2 || o2.walks != before+1 {
			t.Fatalf("Snapshot %d of a job whose connection was adopted: %d connections (%v), walks %d -> %d; want 2, a walk each", i+1, len(cs), err, before, o2.walks)
		}
	}
}

// settled says that nothing is in flight on cs.
func settled(cs []Conn) bool {
	for _, c := range cs {
		if !c.Empty() {
			return false
		}
	}
	return true
}
