package loader

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
)

// siblings is a job spread over cgroups as a resource manager makes them:
// three sibling cgroups a, b and c under one parent, each with a helper
// process in it. a and b live in network namespace ns, c in ns2, so that
// following the job finds ns2 only through c.
type siblings struct {
	dirs    [3]string // a, b, c
	helpers [3]*helper
	ns, ns2 string
}

func newSiblings(t *testing.T) *siblings {
	t.Helper()
	parent := testutil.NewCgroup(t)
	id := randomID(t)
	s := &siblings{ns: "mpt-" + id + "-w1", ns2: "mpt-" + id + "-w2"}
	testutil.NewNamedNetns(t, s.ns)
	testutil.NewNamedNetns(t, s.ns2)
	for i, name := range []string{"a", "b", "c"} {
		dir := filepath.Join(parent, name)
		if err := cgroupv2.Create(dir); err != nil {
			t.Fatal(err)
		}
		// Registered after NewCgroup's, so run before it: the child goes
		// first (its helper, registered later still, before it).
		t.Cleanup(func() { cgroupv2.Remove(dir) })
		s.dirs[i] = dir
		ns := s.ns
		if i == 2 {
			ns = s.ns2
		}
		s.helpers[i] = startHelper(t, ns, dir)
	}
	return s
}

// loopConn is a loopback connection of one helper with itself: both ends
// in its cgroup. The client has written n bytes and the server read them.
type loopConn struct {
	cli, srv tcpConn
	n        uint64
}

func (s *siblings) connect(t *testing.T, i int, n uint64) loopConn {
	t.Helper()
	h := s.helpers[i].forTest(t)
	addr := h.do("listen 127.0.0.1:0")[0]
	c := loopConn{cli: h.conn("dial %s", addr), srv: h.conn("accept"), n: n}
	h.do("write %s %d", c.cli.id, n)
	h.do("read %s %d", c.srv.id, n)
	return c
}

// counted reports whether both ends of c are in cs with exact counts.
func (c loopConn) counted(cs []Conn) bool {
	cli, ok1 := byCookie(cs, c.cli.cookie)
	srv, ok2 := byCookie(cs, c.srv.cookie)
	return ok1 && ok2 && cli.BytesSent == c.n && cli.BytesRecv == 0 && srv.BytesRecv == c.n && srv.BytesSent == 0 && srv.Unread == 0
}

// present reports whether both ends of c are in cs.
func (c loopConn) present(cs []Conn) bool {
	_, ok1 := byCookie(cs, c.cli.cookie)
	_, ok2 := byCookie(cs, c.srv.cookie)
	return ok1 && ok2
}

// absent reports whether neither end of c is in cs.
func (c loopConn) absent(cs []Conn) bool {
	_, ok1 := byCookie(cs, c.cli.cookie)
	_, ok2 := byCookie(cs, c.srv.cookie)
	return !ok1 && !ok2
}

func snapshotOf(t *testing.T, o Observer) []Conn {
	t.Helper()
	cs, err := o.Snapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// foreignSockops attaches a sockops program of another owner to dir, as a
// resource manager attaches its own programs, and returns how to detach it.
func foreignSockops(t *testing.T, dir string) {
	t.Helper()
	spec, err := loadSockops()
	if err != nil {
		t.Fatal(err)
	}
	var so sockopsObjects
	if err := spec.LoadAndAssign(&so, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { so.Close() })
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	l, err := link.AttachRawLink(link.RawLinkOptions{Target: int(f.Fd()), Program: so.MpipauseSockops, Attach: ebpf.AttachCGroupSockOps})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

// TestBPFWatchSet: one observer, a job in two sibling cgroups and a third
// sibling that is not the job's; then the third joins (its connection made
// before is adopted), the second leaves, the observer is closed and opened
// again by the job's name, and Unpin removes everything. It runs as the
// kernel allows (conniter reading the conns map), then as where the kernel
// refuses map iterators (scanTCP: an iter/tcp pass per namespace at every
// Snapshot), unless the first run scanned already.
func TestBPFWatchSet(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, k := range kernelModes {
		t.Run(k.name, func(t *testing.T) {
			if !withRefused(t, k.refused) {
				return
			}
			testBPFWatchSet(t)
		})
	}
}

// testBPFWatchSet is TestBPFWatchSet's run on one kernel mode.
func testBPFWatchSet(t *testing.T) {
	s := newSiblings(t)
	a, b, c := s.dirs[0], s.dirs[1], s.dirs[2]
	bpffs := mountBPFFS(t)
	foreignSockops(t, b)
	// A Slurm step's id: the dot must be escaped in bpffs.
	cfg := Config{Job: "4242.0", Cgroups: []string{a, b}, FollowJob: true, Pin: true, BPFFS: bpffs}
	o := openBPF(t, cfg)
	f := o.Features()
	t.Logf("features: %s", f)
	if o.ScansTCP() != (f.ConnIter == "") {
		t.Errorf("ScansTCP() = %v with conniter %q", o.ScansTCP(), f.ConnIter)
	}
	if got, want := o.Watched(), []string{a, b}; !slices.Equal(got, want) {
		t.Fatalf("Watched() = %v, want %v", got, want)
	}
	if want := filepath.Join(bpffs, pinRoot, "job-4242%2e0"); o.PinDir() != want {
		t.Errorf("PinDir() = %s, want %s", o.PinDir(), want)
	}

	ca := s.connect(t, 0, 1000)
	cb := s.connect(t, 1, 2000)
	cc := s.connect(t, 2, 3000) // c: not watched yet

	t.Run("two watched cgroups, a third not", func(t *testing.T) {
		cs := waitFor(t, o, "a's and b's connections counted", func(cs []Conn) bool { return ca.counted(cs) && cb.counted(cs) })
		if !cc.absent(cs) || len(cs) != 4 {
			t.Errorf("want a's and b's 4 ends only:\n%s", dump(cs))
		}
		if stored := storedCookies(t, o); stored[cc.cli.cookie] || stored[cc.srv.cookie] {
			t.Errorf("conns holds c's sockets")
		}
		// systemd and Slurm attach programs of their own: ours go beside them.
		if n := sockopsAttached(t, b); n != 2 {
			t.Errorf("%d sockops programs on b, want 2 (the other owner's and ours)", n)
		}
	})
	t.Run("Watch adopts what was established before", func(t *testing.T) {
		if err := o.Watch(c); err != nil {
			t.Fatal(err)
		}
		if err := o.Watch(c); err != nil { // idempotent
			t.Fatalf("second Watch: %v", err)
		}
		if !f.Adoption {
			// The mode's documented gap: what c established before is
			// not seen, what it establishes now is.
			cc2 := s.connect(t, 2, 40)
			cs := waitFor(t, o, "c's new connection", cc2.counted)
			if !cc.absent(cs) || len(cs) != 6 {
				t.Errorf("without adoption, want a's, b's and c's new 6 ends, c's old ones not:\n%s", dump(cs))
			}
			cc = cc2
			return
		}
		cs := waitFor(t, o, "c's connection adopted", cc.counted)
		if cli := mustConn(t, cs, cc.cli.cookie); cli.Netns != s.ns2 || !cli.Established.IsZero() {
			t.Errorf("c's client: netns %q, established %v; want %q (found through c), zero (adopted)", cli.Netns, cli.Established, s.ns2)
		}
		if !ca.counted(cs) || !cb.counted(cs) || len(cs) != 6 {
			t.Errorf("want a's, b's and c's 6 ends:\n%s", dump(cs))
		}
		if got, want := o.Watched(), []string{a, b, c}; !slices.Equal(got, want) {
			t.Errorf("Watched() = %v, want %v", got, want)
		}
	})
	t.Run("Unwatch drops", func(t *testing.T) {
		if err := o.Unwatch(b); err != nil {
			t.Fatal(err)
		}
		if err := o.Unwatch(b); err != nil {
			t.Fatalf("second Unwatch: %v", err)
		}
		cs := snapshotOf(t, o)
		if !cb.absent(cs) || !ca.counted(cs) || !cc.counted(cs) || len(cs) != 4 {
			t.Errorf("after Unwatch(b), want a's and c's 4 ends:\n%s", dump(cs))
		}
		// Without iter/tcp the kernel keeps b's entries until the
		// sockets close; Snapshot leaves them out itself.
		if stored := storedCookies(t, o); f.Adoption && (stored[cb.cli.cookie] || stored[cb.srv.cookie]) {
			t.Errorf("conns still holds b's sockets")
		}
		if n := sockopsAttached(t, b); n != 1 {
			t.Errorf("%d sockops programs on b after Unwatch, want 1 (the other owner's)", n)
		}
		// A new connection in b is not the job's.
		cb2 := s.connect(t, 1, 10)
		if cs := snapshotOf(t, o); !cb2.absent(cs) {
			t.Errorf("b's new connection reported after Unwatch:\n%s", dump(cs))
		}
	})
	t.Run("reopened by the job's name", func(t *testing.T) {
		o.Close()
		h := s.helpers[0].forTest(t)
		h.do("write %s 500", ca.cli.id)
		h.do("read %s 500", ca.srv.id)
		ca.n += 500
		o2, err := OpenBPF(context.Background(), Config{Job: cfg.Job, FollowJob: true, Pin: true, BPFFS: bpffs})
		if err != nil {
			t.Fatal(err)
		}
		defer o2.Close()
		if !o2.Reused() {
			t.Error("the job's pinned state was not reused")
		}
		if o2.Features().String() != f.String() || o2.ScansTCP() != o.ScansTCP() {
			t.Errorf("after reopen: %s, ScansTCP() %v; want %s, %v as before", o2.Features(), o2.ScansTCP(), f, o.ScansTCP())
		}
		if got, want := o2.Watched(), []string{a, c}; !slices.Equal(got, want) {
			t.Errorf("Watched() after reopen = %v, want %v", got, want)
		}
		cs := waitFor(t, o2, "counts continued", func(cs []Conn) bool { return ca.counted(cs) && cc.counted(cs) })
		if !cb.absent(cs) || len(cs) != 4 {
			t.Errorf("after reopen, want a's and c's 4 ends:\n%s", dump(cs))
		}
		o2.Close()
	})
	t.Run("Unpin removes the job", func(t *testing.T) {
		if err := Unpin(Config{Job: cfg.Job, BPFFS: bpffs}); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(bpffs, pinRoot)); !os.IsNotExist(err) {
			t.Errorf("after Unpin, %s/%s: %v; want it gone", bpffs, pinRoot, err)
		}
		for _, dir := range []string{a, c} {
			if n := sockopsAttached(t, dir); n != 0 {
				t.Errorf("%d sockops programs on %s after Unpin, want 0", n, dir)
			}
		}
	})
}

// TestWatchMissing: a Watch of a directory that is not a cgroup fails with
// ErrNoCgroup, naming it, and changes nothing, in both observers.
func TestWatchMissing(t *testing.T) {
	testutil.RequirePrivileged(t)
	s := newSiblings(t)
	missing := filepath.Join(filepath.Dir(s.dirs[0]), "no-such-rank")
	for _, kind := range []string{KindBPF, KindSockDiag} {
		t.Run(kind, func(t *testing.T) {
			o, err := Open(context.Background(), Config{Cgroups: s.dirs[:2], Require: kind})
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			w := o.(Watcher)
			err = w.Watch(missing)
			if !errors.Is(err, ErrNoCgroup) || !strings.Contains(err.Error(), "no-such-rank") {
				t.Errorf("Watch(%s) = %v, want ErrNoCgroup naming it", missing, err)
			}
			if got := w.Watched(); !slices.Equal(got, s.dirs[:2]) {
				t.Errorf("Watched() after the failed Watch = %v, want %v", got, s.dirs[:2])
			}
			if kind == KindBPF {
				if ids := o.(interface{ WatchedIDs() []uint64 }).WatchedIDs(); len(ids) != 2 {
					t.Errorf("%d cgroups watched, want 2", len(ids))
				}
			}
		})
	}
}

// TestSockDiagWatchSet is TestBPFWatchSet's set for the sock_diag observer,
// which filters by the cgroup ids of every watched tree and follows the
// namespaces of every watched cgroup's processes.
func TestSockDiagWatchSet(t *testing.T) {
	testutil.RequirePrivileged(t)
	s := newSiblings(t)
	a, b, c := s.dirs[0], s.dirs[1], s.dirs[2]
	o, err := OpenSockDiag(context.Background(), Config{Cgroups: []string{a, b}, FollowJob: true})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	ca := s.connect(t, 0, 1000)
	cb := s.connect(t, 1, 2000)
	cc := s.connect(t, 2, 3000)

	cs := snapshotOf(t, o)
	if !ca.present(cs) || !cb.present(cs) || !cc.absent(cs) || len(cs) != 4 {
		t.Errorf("want a's and b's 4 ends:\n%s", dump(cs))
	}
	if err := o.Watch(c); err != nil {
		t.Fatal(err)
	}
	cs = snapshotOf(t, o)
	if !cc.present(cs) || len(cs) != 6 {
		t.Errorf("after Watch(c), want 6 ends:\n%s", dump(cs))
	}
	if cli, ok := byCookie(cs, cc.cli.cookie); ok && cli.Netns != s.ns2 {
		t.Errorf("c's client in netns %q, want %q (found through c)", cli.Netns, s.ns2)
	}
	if err := o.Unwatch(b); err != nil {
		t.Fatal(err)
	}
	cs = snapshotOf(t, o)
	if !cb.absent(cs) || !ca.present(cs) || !cc.present(cs) || len(cs) != 4 {
		t.Errorf("after Unwatch(b), want a's and c's 4 ends:\n%s", dump(cs))
	}
	if got, want := o.Watched(), []string{a, c}; !slices.Equal(got, want) {
		t.Errorf("Watched() = %v, want %v", got, want)
	}
}

// TestJobNetnsAcrossThreaded: a threaded cgroup in a followed tree (libvirt
// puts each VM's emulator and vCPU threads in ones) refuses cgroup.procs;
// following the tree goes past it and still finds its domain's processes'
// namespaces, as it once did not with a VM on the node.
func TestJobNetnsAcrossThreaded(t *testing.T) {
	dom, _ := testutil.NewThreadedCgroup(t)
	ns, _, err := jobNetns([]string{dom}, Config{}.limits())
	if err != nil {
		t.Fatalf("follow a tree with a threaded cgroup: %v", err)
	}
	if len(ns) != 1 {
		t.Errorf("namespaces found: %v, want the sleeper's one", ns)
	}
}
