package mpid

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/accept"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/quiesce"
	"golang.org/x/sys/unix"
)

// exhaust leaves this process (mpid's too, in these tests) without a free
// file descriptor and connects sockets made beforehand to addr: mpid's
// accepts of them fail with EMFILE, as they did when a user flooded a real
// mpid. release frees the descriptors and restores the limit (cleanup does
// too); the connections, queued, are mpid's to accept then.
func exhaust(t *testing.T, addr string) (release func()) {
	t.Helper()
	var socks []int
	for range 3 {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		socks = append(socks, fd)
	}
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	// A low limit, so that filling it takes a few dups, not thousands.
	low := old
	low.Cur = uint64(len(fds) + 16)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	var fill []int
	released := false
	release = func() {
		if released {
			return
		}
		released = true
		for _, fd := range fill {
			unix.Close(fd)
		}
		unix.Setrlimit(unix.RLIMIT_NOFILE, &old)
	}
	t.Cleanup(release)
	t.Cleanup(func() {
		for _, fd := range socks {
			unix.Close(fd)
		}
	})
	for {
		fd, err := unix.Dup(0)
		if err != nil {
			if !errors.Is(err, unix.EMFILE) {
				t.Fatalf("dup: %v", err)
			}
			break
		}
		fill = append(fill, fd)
	}
	sa := &unix.SockaddrUnix{Name: addr}
	if strings.HasPrefix(addr, "@") {
		sa.Name = "\x00" + addr[1:]
	}
	for _, fd := range socks {
		if err := unix.Connect(fd, sa); err != nil {
			t.Fatalf("connect %s: %v", addr, err)
		}
	}
	return release
}

// TestSocketsSurviveExhaustion: while mpid is out of file descriptors, its
// control and rank sockets wait and serve again once descriptors are
// free; mpid logs the exhaustion once per socket, not once per accept.
func TestSocketsSurviveExhaustion(t *testing.T) {
	for _, sock := range []string{"control socket", "rank socket"} {
		t.Run(strings.Fields(sock)[0], func(t *testing.T) {
			mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
			t.Cleanup(mem.Close)
			n := startNode(t, "node0", mem, testKeys(t))
			addr := n.ctlAddr
			if sock == "rank socket" {
				addr = n.rankAddr
			}
			release := exhaust(t, addr)
			line := sock + ": accept: too many open files"
			waitLog(t, n, line)
			release()
			r, err := ctl.Do(t.Context(), n.ctlAddr, ctl.Request{Op: ctl.OpList}, nil)
			if err != nil || r == nil || r.Err != nil {
				t.Fatalf("list after the flood: %v %v; mpid's log:\n%s", r, err, n.log.String())
			}
			if sock == "rank socket" {
				n.rank(t, "after-flood", n.ask(t, ctl.OpCreate, "after-flood").Token, 0, 1)
			}
			if got := strings.Count(n.log.String(), line); got != 1 {
				t.Errorf("%d lines %q, want 1:\n%s", got, line, n.log.String())
			}
		})
	}
}

// waitLog waits for line in n's log.
func waitLog(t *testing.T, n *testNode, line string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(n.log.String(), line) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q in mpid's log:\n%s", line, n.log.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestMetricsSurviveExhaustion: accept errors the HTTP server would end
// at (ENOBUFS, ENOMEM) or log each time (EMFILE) are waited out, and
// scrapes go on.
func TestMetricsSurviveExhaustion(t *testing.T) {
	logs := &testutil.Buffer{}
	d, err := New(Config{Node: "node0", ClusterKey: testKeys(t), StateDir: t.TempDir(), Cgroups: newMemCgroups(), Observers: memObservers{},
		MetricsListen: "127.0.0.1:9717", Log: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fl := testutil.NewFlakyListener(ln, syscall.ENOBUFS, syscall.ENOMEM, syscall.EMFILE, syscall.EMFILE, syscall.EMFILE)
	ctx, cancel := context.WithCancel(t.Context())
	served := make(chan error, 1)
	go func() { served <- d.serveMetrics(ctx, fl) }()
	defer func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("metrics: %v", err)
		}
	}()
	resp, err := http.Get("http://" + ln.Addr().String() + metrics.Path)
	if err != nil {
		t.Fatalf("scrape after %d accept errors: %v; mpid's log:\n%s", fl.Failed(), err, logs.String())
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("scrape: %s", resp.Status)
	}
	if got := strings.Count(logs.String(), "accept: too many open files"); got != 1 {
		t.Errorf("%d lines for 3 EMFILEs, want 1:\n%s", got, logs.String())
	}
}

// TestControlPerUID: a user's connections to the control socket past
// ctlPerUID are closed at once, logged once; the user's requests are
// served again once one of its connections is gone.
func TestControlPerUID(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	t.Cleanup(mem.Close)
	n := startNode(t, "node0", mem, testKeys(t))
	var held []net.Conn
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
	})
	for range ctlPerUID {
		c, err := net.Dial("unix", n.ctlAddr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	for range 3 {
		c, err := net.Dial("unix", n.ctlAddr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(4 * time.Second)) // under the 5 s mpid gives a request
		_, err = c.Read(make([]byte, 1))
		c.Close()
		if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("connection %d of one uid: %v, want it closed at once", ctlPerUID+1, err)
		}
	}
	line := "control socket: " + accept.CausePerKey
	if got := strings.Count(n.log.String(), line); got != 1 {
		t.Errorf("%d lines %q for 3 refusals, want 1:\n%s", got, line, n.log.String())
	}
	held[0].Close()
	held = held[1:]
	// The slot is free once mpid has seen the close: its reader's EOF.
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err := ctl.Do(t.Context(), n.ctlAddr, ctl.Request{Op: ctl.OpList}, nil)
		if err == nil && r != nil && r.Err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("list with a slot free: %v %v", r, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
