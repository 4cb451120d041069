package sockdiag

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
)

// ownCgroupID is the cgroup v2 id of this process's cgroup.
func ownCgroupID(tb testing.TB) uint64 {
	tb.Helper()
	dir, err := cgroupv2.Of(os.Getpid())
	if errors.Is(err, cgroupv2.ErrNotMounted) {
		tb.Skipf("cgroup v2: %v", err)
	}
	if err != nil {
		tb.Fatal(err)
	}
	id, err := cgroupv2.ID(dir)
	if err != nil {
		tb.Fatal(err)
	}
	return id
}

// addrPort is a's address and port as the kernel reports an AF_INET or
// AF_INET6 socket's (net keeps IPv4 addresses in 16 bytes).
func addrPort(a net.Addr) netip.AddrPort {
	ap := a.(*net.TCPAddr).AddrPort()
	if ap.Addr().Is4In6() {
		ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	return ap
}

// sockIdentity reads a connection's cookie and inode from its fd.
func sockIdentity(tb testing.TB, c net.Conn) (cookie uint64, inode uint64) {
	tb.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		tb.Fatal(err)
	}
	var serr error
	err = rc.Control(func(fd uintptr) {
		cookie, serr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_COOKIE)
		if serr != nil {
			return
		}
		var st unix.Stat_t
		serr = unix.Fstat(int(fd), &st)
		inode = st.Ino
	})
	if err = errors.Join(err, serr); err != nil {
		tb.Fatal(err)
	}
	return cookie, inode
}

// diagPair makes a listener and one connection to it in ns.
func diagPair(tb testing.TB, ns *testutil.Netns, network, addr string) (ln net.Listener, client, server net.Conn) {
	tb.Helper()
	if err := ns.Do(func() error {
		var err error
		if ln, err = net.Listen(network, addr); err != nil {
			return err
		}
		client, err = net.Dial(network, ln.Addr().String())
		return err
	}); err != nil {
		tb.Fatal(err)
	}
	server, err := ln.Accept()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ln.Close(); client.Close(); server.Close() })
	return ln, client, server
}

// pollDump dumps until ok accepts the result or 10 s pass: the kernel's
// answer is what the test waits for, never a fixed sleep.
func pollDump(t *testing.T, ns *testutil.Netns, f Filter, ok func([]TCPSocket) error) []TCPSocket {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := DialDiag(ns.FD())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for {
		got, err := d.DumpTCP(ctx, f)
		if err != nil {
			t.Fatalf("DumpTCP: %v", err)
		}
		cerr := ok(got)
		if cerr == nil {
			return got
		}
		select {
		case <-ctx.Done():
			t.Fatalf("kernel never showed it: %v; last dump: %+v", cerr, got)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func byCookie(s []TCPSocket, cookie uint64) (TCPSocket, bool) {
	for _, x := range s {
		if x.Cookie == cookie {
			return x, true
		}
	}
	return TCPSocket{}, false
}

func TestDumpTCPQueues(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, tt := range []struct {
		name, network, addr string
		family              uint8
	}{
		{"ipv4", "tcp4", "127.0.0.1:0", unix.AF_INET},
		{"ipv6", "tcp6", "[::1]:0", unix.AF_INET6},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ns := testutil.NewNetns(t)
			ln, client, server := diagPair(t, ns, tt.network, tt.addr)
			const n, k = 20000, 7000 // well inside loopback's buffers: no blocking
			if _, err := client.Write(bytes.Repeat([]byte{'x'}, n)); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(server, make([]byte, k)); err != nil {
				t.Fatal(err)
			}
			cCookie, cInode := sockIdentity(t, client)
			sCookie, sInode := sockIdentity(t, server)
			own := ownCgroupID(t)

			got := pollDump(t, ns, Filter{}, func(s []TCPSocket) error {
				c, okc := byCookie(s, cCookie)
				sv, oks := byCookie(s, sCookie)
				switch {
				case !okc || !oks:
					return fmt.Errorf("client found %v, server found %v", okc, oks)
				case c.WQueue != 0:
					return fmt.Errorf("client wqueue %d, waiting for the ack", c.WQueue)
				case sv.RQueue != n-k:
					return fmt.Errorf("server rqueue %d, want %d", sv.RQueue, n-k)
				}
				return nil
			})
			c, _ := byCookie(got, cCookie)
			sv, _ := byCookie(got, sCookie)

			lp, sp := addrPort(client.LocalAddr()), addrPort(server.LocalAddr())
			for _, x := range []struct {
				name          string
				got           TCPSocket
				local, remote netip.AddrPort
				inode         uint64
			}{
				{"client", c, lp, sp, cInode},
				{"server", sv, sp, lp, sInode},
			} {
				g := x.got
				if g.Family != tt.family || g.State != tcpEstablished || g.Local != x.local || g.Remote != x.remote {
					t.Errorf("%s: family %d state %d %v -> %v, want %d %d %v -> %v",
						x.name, g.Family, g.State, g.Local, g.Remote, tt.family, tcpEstablished, x.local, x.remote)
				}
				if uint64(g.Inode) != x.inode || g.UID != 0 || g.Cgroup != own {
					t.Errorf("%s: inode %d uid %d cgroup %d, want %d 0 %d", x.name, g.Inode, g.UID, g.Cgroup, x.inode, own)
				}
				if g.Info == nil || g.Info.State != tcpEstablished || g.Info.RTT == 0 {
					t.Errorf("%s: tcp_info %+v, want one in ESTABLISHED with an RTT", x.name, g.Info)
				}
			}
			if c.Info != nil && (c.Info.BytesAcked < n || c.Info.BytesSent != n || c.Info.NotsentBytes != 0) {
				t.Errorf("client tcp_info: bytes_acked %d bytes_sent %d notsent %d, want >= %d, %d, 0",
					c.Info.BytesAcked, c.Info.BytesSent, c.Info.NotsentBytes, n, n)
			}
			if sv.Info != nil && sv.Info.BytesReceived != n {
				t.Errorf("server bytes_received %d, want %d", sv.Info.BytesReceived, n)
			}
			if sv.WQueue != 0 || c.RQueue != 0 {
				t.Errorf("server wqueue %d, client rqueue %d: want 0, 0", sv.WQueue, c.RQueue)
			}

			// The listener is there, with its backlog as the queues;
			// StatesConnected leaves it out.
			lnCookie := func(s []TCPSocket) (TCPSocket, bool) {
				for _, x := range s {
					if x.State == tcpListen && x.Local == addrPort(ln.Addr()) {
						return x, true
					}
				}
				return TCPSocket{}, false
			}
			if _, ok := lnCookie(got); !ok {
				t.Errorf("listener %v not in the dump", ln.Addr())
			}
			conn, err := DumpTCP(context.Background(), ns.FD(), Filter{States: StatesConnected})
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := lnCookie(conn); ok || len(conn) != 2 {
				t.Errorf("StatesConnected: %d sockets (listener in: %v), want the 2 ends", len(conn), ok)
			}
			other, err := DumpTCP(context.Background(), ns.FD(), Filter{Family: tt.family ^ (unix.AF_INET ^ unix.AF_INET6)})
			if err != nil {
				t.Fatal(err)
			}
			if len(other) != 0 {
				t.Errorf("dump of the other family: %+v, want none", other)
			}

			// Our own namespace does not see the fresh one's sockets.
			mine, err := DumpTCP(context.Background(), -1, Filter{})
			if err != nil {
				t.Fatal(err)
			}
			for _, cookie := range []uint64{cCookie, sCookie} {
				if _, ok := byCookie(mine, cookie); ok {
					t.Errorf("socket %d of the test namespace shows in the caller's", cookie)
				}
			}
		})
	}
}

func TestDumpTCPClosed(t *testing.T) {
	testutil.RequirePrivileged(t)
	ns := testutil.NewNetns(t)
	_, client, server := diagPair(t, ns, "tcp4", "127.0.0.1:0")
	cCookie, _ := sockIdentity(t, client)
	sCookie, _ := sockIdentity(t, server)
	pollDump(t, ns, Filter{States: StatesConnected}, func(s []TCPSocket) error {
		if _, ok := byCookie(s, cCookie); !ok {
			return errors.New("client not there yet")
		}
		return nil
	})

	client.Close() // active close: the client's end goes to TIME_WAIT
	server.Close()
	pollDump(t, ns, Filter{States: StatesConnected}, func(s []TCPSocket) error {
		for _, c := range []uint64{cCookie, sCookie} {
			if x, ok := byCookie(s, c); ok {
				return fmt.Errorf("socket %d still there in state %d", c, x.State)
			}
		}
		return nil
	})
	// All that may stay is the client's TIME_WAIT, which keeps the cookie
	// but has no owner, inode, cgroup or tcp_info.
	all, err := DumpTCP(context.Background(), ns.FD(), Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if x, ok := byCookie(all, sCookie); ok {
		t.Errorf("server end still there: %+v", x)
	}
	if x, ok := byCookie(all, cCookie); ok && (x.State != tcpTimeWait || x.Info != nil || x.Cgroup != 0 || x.Inode != 0) {
		t.Errorf("client end after close: %+v, want a bare TIME_WAIT", x)
	}
}

// diagHelperEnv makes the test binary, run again by startDiagHelper, a
// client: TestDiagHelperProcess connects to the address in it.
const diagHelperEnv = "MPIPAUSE_NL_DIAG_HELPER"

// TestDiagHelperProcess is not a test: it is the client process of
// TestDumpTCPCgroup. It waits for a line on stdin (the parent has moved it
// into the cgroup by then), enters the network namespace on fd 3, connects,
// sends "hello", prints its local address and holds the connection until
// stdin closes.
func TestDiagHelperProcess(t *testing.T) {
	addr := os.Getenv(diagHelperEnv)
	if addr == "" {
		return
	}
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		fail(err)
	}
	runtime.LockOSThread()
	if err := unix.Setns(3, unix.CLONE_NEWNET); err != nil {
		fail(err)
	}
	c, err := net.Dial("tcp", addr)
	if err != nil {
		fail(err)
	}
	if _, err := c.Write([]byte("hello")); err != nil {
		fail(err)
	}
	fmt.Println(c.LocalAddr())
	_, _ = io.Copy(io.Discard, in)
	os.Exit(0)
}

// startDiagHelper runs a client process in cgroup dir and network namespace
// ns that connects to addr; it returns the client's local address once
// the connection is up, and ends the process at cleanup.
func startDiagHelper(t *testing.T, ns *testutil.Netns, dir string, addr net.Addr) netip.AddrPort {
	t.Helper()
	nsFD, err := unix.FcntlInt(uintptr(ns.FD()), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nsFile := os.NewFile(uintptr(nsFD), "netns")
	defer nsFile.Close()

	cmd := exec.Command(os.Args[0], "-test.run=^TestDiagHelperProcess$")
	cmd.Env = append(os.Environ(), diagHelperEnv+"="+addr.String())
	cmd.ExtraFiles = []*os.File{nsFile}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("helper: %v: %s", err, stderr.Bytes())
		}
	})
	// Into the cgroup before it makes its socket: a socket's cgroup is
	// its creator's at socket() time.
	if err := cgroupv2.AddProc(dir, cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("helper: %v: %s", err, stderr.Bytes())
	}
	ap, err := netip.ParseAddrPort(strings.TrimSpace(line))
	if err != nil {
		t.Fatal(err)
	}
	return ap
}

func TestDumpTCPCgroup(t *testing.T) {
	testutil.RequirePrivileged(t)
	ns := testutil.NewNetns(t)
	job := testutil.NewCgroup(t)
	rank := filepath.Join(job, "rank0")
	if err := cgroupv2.Create(rank); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cgroupv2.Remove(rank) }) // runs before job's removal

	var ln net.Listener
	if err := ns.Do(func() (err error) {
		ln, err = net.Listen("tcp4", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	clientAddr := startDiagHelper(t, ns, rank, ln.Addr())
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })

	jobID, err := cgroupv2.ID(job)
	if err != nil {
		t.Fatal(err)
	}
	rankID, err := cgroupv2.ID(rank)
	if err != nil {
		t.Fatal(err)
	}
	tree, err := cgroupv2.TreeIDs(job)
	if err != nil {
		t.Fatal(err)
	}
	own := ownCgroupID(t)
	// More ids than one bytecode can hold: user space filters instead.
	big := []uint64{rankID}
	for i := range maxBytecodeCgroups {
		big = append(big, 1<<40+uint64(i))
	}

	all, err := DumpTCP(context.Background(), ns.FD(), Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 3 {
		t.Fatalf("unfiltered dump: %d sockets, want listener, server and client: %+v", len(all), all)
	}
	for _, s := range all {
		want := own // the listener, and the server end it accepted
		if s.Local == clientAddr {
			want = rankID
		}
		if s.Cgroup != want {
			t.Errorf("socket %v -> %v: cgroup %d, want %d", s.Local, s.Remote, s.Cgroup, want)
		}
	}

	for _, userSpace := range []bool{false, true} {
		for _, tt := range []struct {
			name string
			ids  []uint64
			want int // sockets: 1 is the client
		}{
			{"job tree", tree, 1},
			{"rank only", []uint64{rankID}, 1},
			{"job only, not its child", []uint64{jobID}, 0},
			{"empty set", []uint64{}, 0},
			{"own cgroup", []uint64{own}, 2},
			{"more ids than a bytecode holds", big, 1},
		} {
			name := fmt.Sprintf("userspace=%v/%s", userSpace, tt.name)
			t.Run(name, func(t *testing.T) {
				got, err := DumpTCP(context.Background(), ns.FD(), Filter{Cgroups: tt.ids, userSpace: userSpace})
				if err != nil {
					t.Fatal(err)
				}
				if len(got) != tt.want {
					t.Fatalf("%d sockets, want %d: %+v", len(got), tt.want, got)
				}
				if tt.want == 1 && (got[0].Local != clientAddr || got[0].Cgroup != rankID) {
					t.Fatalf("got %v in cgroup %d, want the client %v in %d", got[0].Local, got[0].Cgroup, clientAddr, rankID)
				}
			})
		}
	}
}

// TestDumpTCPCanceled cancels dumps on one DiagConn, which must answer the
// next dump in full whatever the cut one left, and refuses dumps once closed.
func TestDumpTCPCanceled(t *testing.T) {
	testutil.RequirePrivileged(t)
	ns := testutil.NewNetns(t)
	diagPair(t, ns, "tcp4", "127.0.0.1:0")
	d, err := DialDiag(ns.FD())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	t.Run("canceled before it starts", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := d.DumpTCP(ctx, Filter{}); !errors.Is(err, context.Canceled) {
			t.Fatalf("canceled dump: err = %v, want context.Canceled", err)
		}
		got, err := d.DumpTCP(context.Background(), Filter{})
		if err != nil || len(got) != 3 {
			t.Fatalf("dump after a canceled one: %d sockets, %v; want 3", len(got), err)
		}
	})

	t.Run("cut at every point of its run", func(t *testing.T) {
		for range 100 {
			diagPair(t, ns, "tcp4", "127.0.0.1:0")
		}
		const want = 3 * 101
		var cut int
		for i := range 300 {
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i*5)*time.Microsecond)
			_, err := d.DumpTCP(ctx, Filter{})
			cancel()
			if err != nil {
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("timed-out dump: err = %v, want DeadlineExceeded", err)
				}
				cut++
			}
			got, err := d.DumpTCP(context.Background(), Filter{})
			if err != nil || len(got) != want {
				t.Fatalf("dump after a timed-out one: %d sockets, %v; want %d", len(got), err, want)
			}
		}
		t.Logf("%d of 300 dumps cut by their deadline", cut)
	})

	t.Run("after Close", func(t *testing.T) {
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := d.DumpTCP(context.Background(), Filter{}); !errors.Is(err, ErrClosed) {
			t.Fatalf("dump after Close: err = %v, want ErrClosed", err)
		}
	})
}

// BenchmarkDumpTCP10k dumps a namespace holding 5,000 loopback connections
// (10,000 established sockets) with and without cgroup filters, in the
// kernel and in user space. sockets/op is what each dump returned.
func BenchmarkDumpTCP10k(b *testing.B) {
	testutil.RequirePrivileged(b)
	const conns = 5000
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	if lim.Max < 2*conns+200 {
		b.Skipf("RLIMIT_NOFILE hard limit %d < %d", lim.Max, 2*conns+200)
	}
	lim.Cur = lim.Max
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}

	ns := testutil.NewNetns(b)
	var ln net.Listener
	var clients []net.Conn
	accepted := make(chan net.Conn, conns)
	if err := ns.Do(func() (err error) {
		if ln, err = net.Listen("tcp4", "127.0.0.1:0"); err != nil {
			return err
		}
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					close(accepted)
					return
				}
				accepted <- c
			}
		}()
		for range conns {
			c, err := net.Dial("tcp4", ln.Addr().String())
			if err != nil {
				return err
			}
			clients = append(clients, c)
		}
		return nil
	}); err != nil {
		b.Fatal(err)
	}
	servers := make([]net.Conn, 0, conns)
	for range conns {
		servers = append(servers, <-accepted)
	}
	b.Cleanup(func() {
		ln.Close()
		for _, c := range append(clients, servers...) {
			c.Close()
		}
	})

	own := ownCgroupID(b)
	empty, err := cgroupv2.ID(testutil.NewCgroup(b))
	if err != nil {
		b.Fatal(err)
	}
	// 16 ids with the match last: a job tree of 16 cgroups, worst case for
	// the bytecode's OR chain.
	var tree16 []uint64
	for i := range 15 {
		tree16 = append(tree16, 1<<40+uint64(i))
	}
	tree16 = append(tree16, own)

	d, err := DialDiag(ns.FD())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { d.Close() })
	ctx := context.Background()
	for _, bc := range []struct {
		name string
		f    Filter
	}{
		{"none", Filter{}},
		{"user/all-match", Filter{Cgroups: []uint64{own}, userSpace: true}},
		{"kernel/all-match", Filter{Cgroups: []uint64{own}}},
		{"user/all-match-16ids", Filter{Cgroups: tree16, userSpace: true}},
		{"kernel/all-match-16ids", Filter{Cgroups: tree16}},
		{"user/none-match", Filter{Cgroups: []uint64{empty}, userSpace: true}},
		{"kernel/none-match", Filter{Cgroups: []uint64{empty}}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var n int
			for b.Loop() {
				s, err := d.DumpTCP(ctx, bc.f)
				if err != nil {
					b.Fatal(err)
				}
				n = len(s)
			}
			b.ReportMetric(float64(n), "sockets/op")
		})
	}
	b.Run("dial+none", func(b *testing.B) {
		for b.Loop() {
			if _, err := DumpTCP(ctx, ns.FD(), Filter{}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestLookupTCPAsDumped: an exact lookup of each of a namespace's
// connections reports what a dump does (state, 4-tuple, cookie, both
// queues), over generated connections: IPv4, IPv6 and v4-mapped, each
// direction written and partly read by seeded amounts; a closed socket, and
// one asked with another cookie, is not found. MPIPAUSE_DIAG_SEED replays
// one seed.
func TestLookupTCPAsDumped(t *testing.T) {
	testutil.RequirePrivileged(t)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("MPIPAUSE_DIAG_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("MPIPAUSE_DIAG_SEED=%q: %v", s, err)
		}
		seed = v
	}
	defer func() {
		if t.Failed() {
			t.Logf("rerun: MPIPAUSE_DIAG_SEED=%d go test -count=1 -run '^TestLookupTCPAsDumped$' ./internal/sockdiag/", seed)
		}
	}()
	rng := rand.New(rand.NewPCG(seed, 3))
	ns := testutil.NewNetns(t)
	kinds := []struct{ network, addr string }{{"tcp4", "127.0.0.1:0"}, {"tcp6", "[::1]:0"}, {"tcp", "[::ffff:127.0.0.1]:0"}}
	type pair struct{ client, server net.Conn }
	var pairs []pair
	var ids []ID
	want := map[uint64][2]uint32{} // cookie: rqueue, wqueue once acked
	wrote := map[uint64]uint64{}   // cookie: bytes its process wrote
	for range 4 + rng.IntN(8) {
		k := kinds[rng.IntN(len(kinds))]
		_, client, server := diagPair(t, ns, k.network, k.addr)
		pairs = append(pairs, pair{client, server})
		for _, c := range []struct{ from, to net.Conn }{{client, server}, {server, client}} {
			n := rng.IntN(60000)
			m := 0
			if n > 0 {
				m = rng.IntN(n + 1)
			}
			if _, err := c.from.Write(bytes.Repeat([]byte{'x'}, n)); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c.to, make([]byte, m)); err != nil {
				t.Fatal(err)
			}
			from, _ := sockIdentity(t, c.from)
			wrote[from] += uint64(n)
			ck, _ := sockIdentity(t, c.to)
			w := want[ck]
			w[0] = uint32(n - m)
			want[ck] = w
		}
		for _, c := range []net.Conn{client, server} {
			ck, _ := sockIdentity(t, c)
			ids = append(ids, ID{Local: addrPort(c.LocalAddr()), Remote: addrPort(c.RemoteAddr()), Cookie: ck})
		}
	}
	got := pollDump(t, ns, Filter{States: StatesConnected}, func(s []TCPSocket) error {
		for ck, w := range want {
			x, ok := byCookie(s, ck)
			if !ok || x.RQueue != w[0] || x.WQueue != 0 {
				return fmt.Errorf("cookie %d: found %v, rqueue %d wqueue %d, want %d and 0", ck, ok, x.RQueue, x.WQueue, w[0])
			}
		}
		return nil
	})
	d, err := DialDiag(ns.FD())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	look, ok, err := d.LookupTCP(ctx, ids)
	if err != nil {
		t.Fatal(err)
	}
	for i, id := range ids {
		x, _ := byCookie(got, id.Cookie)
		l := look[i]
		if !ok[i] || l.State != x.State || l.Local != x.Local || l.Remote != x.Remote || l.Cookie != x.Cookie ||
			l.RQueue != x.RQueue || l.WQueue != x.WQueue {
			t.Errorf("%v -> %v: lookup found %v %+v, the dump %+v", id.Local, id.Remote, ok[i], l, x)
		}
		// What the socket took, as a recheck counts it: the dump's count
		// and the bytes written.
		lt, lok := l.Info.Taken()
		xt, xok := x.Info.Taken()
		if !lok || !xok || lt != xt || lt != wrote[id.Cookie] {
			t.Errorf("%v -> %v: the lookup says %d bytes taken (%v), the dump %d (%v); %d were written", id.Local, id.Remote, lt, lok, xt, xok, wrote[id.Cookie])
		}
	}
	// Another cookie on a live 4-tuple, and a closed socket: not found.
	stale := ids[0]
	stale.Cookie++
	p := pairs[len(pairs)-1]
	closedID := ids[len(ids)-2] // the last pair's client
	p.client.Close()
	p.server.Close()
	pollDump(t, ns, Filter{States: StatesConnected}, func(s []TCPSocket) error {
		if _, there := byCookie(s, closedID.Cookie); there {
			return errors.New("the closed client is still connected")
		}
		return nil
	})
	look, ok, err = d.LookupTCP(ctx, []ID{stale, closedID, ids[0]})
	if err != nil {
		t.Fatal(err)
	}
	if ok[0] || ok[1] && look[1].State == tcpEstablished || !ok[2] {
		t.Errorf("found: another cookie %v, a closed socket %v (state %d), the live one %v; want false, false or not established, true",
			ok[0], ok[1], look[1].State, ok[2])
	}
	t.Logf("seed %d: %d sockets looked up as dumped", seed, len(ids))
}

// TestLookupTCPBatches: a lookup of more sockets than one batch (two
// batches and part of a third, each reply with its tcp_info) finds every
// one: a batch whose replies overflowed the netlink socket's receive
// buffer would lose some, and its lookup fail or wait.
func TestLookupTCPBatches(t *testing.T) {
	testutil.RequirePrivileged(t)
	ns := testutil.NewNetns(t)
	var ids []ID
	for len(ids) < 2*lookupBatch+10 {
		_, client, server := diagPair(t, ns, "tcp4", "127.0.0.1:0")
		for _, c := range []net.Conn{client, server} {
			ck, _ := sockIdentity(t, c)
			ids = append(ids, ID{Local: addrPort(c.LocalAddr()), Remote: addrPort(c.RemoteAddr()), Cookie: ck})
		}
	}
	d, err := DialDiag(ns.FD())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	look, ok, err := d.LookupTCP(ctx, ids)
	if err != nil {
		t.Fatalf("LookupTCP of %d sockets: %v", len(ids), err)
	}
	for i, id := range ids {
		if _, counted := look[i].Info.Taken(); !ok[i] || look[i].Cookie != id.Cookie || !counted {
			t.Fatalf("socket %d of %d (%v -> %v): found %v, cookie %d, tcp_info %v", i, len(ids), id.Local, id.Remote, ok[i], look[i].Cookie, counted)
		}
	}
}
