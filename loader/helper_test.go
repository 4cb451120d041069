package loader

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
)

// helperEnv selects the helper mode of the test binary: a small process
// that opens, writes, reads and closes TCP connections on command, so that
// its sockets are created inside a test's cgroup and network namespace.
const helperEnv = "MPIPAUSE_LOADER_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helperMain(os.Stdin, os.Stdout))
	}
	os.Exit(m.Run())
}

// helperMain serves one command per input line and answers each with one
// line: "ok [values...]" or "err message". It exits on EOF.
//
//	listen ADDR        -> ok LISTENADDR
//	dial ADDR          -> ok ID COOKIE LOCAL REMOTE
//	accept             -> ok ID COOKIE LOCAL REMOTE
//	write ID N         -> ok            (N bytes, all of them)
//	read ID N          -> ok            (exactly N bytes)
//	peek ID N          -> ok GOT        (recv MSG_PEEK|MSG_WAITALL)
//	shutw ID           -> ok            (shutdown SHUT_WR: our FIN)
//	eof ID             -> ok            (a read that returns end of stream)
//	close ID           -> ok
//	mass ADDR N        -> ok TOTAL      (N more loopback connections to itself;
//	                                     TOTAL sockets of all mass calls held)
//	churn ADDR N       -> ok NS         (N loopback connections to itself, each
//	                                     connected, accepted and closed; NS their time)
func helperMain(in io.Reader, out io.Writer) int {
	var (
		ln    net.Listener
		conns = map[int]*net.TCPConn{}
		keep  []net.Conn
		next  = 1
	)
	add := func(c net.Conn) string {
		tc := c.(*net.TCPConn)
		id := next
		next++
		conns[id] = tc
		return fmt.Sprintf("%d %d %s %s", id, cookieOf(tc), c.LocalAddr(), c.RemoteAddr())
	}
	get := func(f []string) (*net.TCPConn, int, error) {
		if len(f) < 2 {
			return nil, 0, errors.New("missing id")
		}
		id, _ := strconv.Atoi(f[1])
		c, ok := conns[id]
		if !ok {
			return nil, 0, fmt.Errorf("no connection %d", id)
		}
		n := 0
		if len(f) > 2 {
			n, _ = strconv.Atoi(f[2])
		}
		return c, n, nil
	}
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		reply, err := "", error(nil)
		switch f[0] {
		case "listen":
			ln, err = net.Listen("tcp", f[1])
			if err == nil {
				reply = ln.Addr().String()
			}
		case "accept":
			var c net.Conn
			if c, err = ln.Accept(); err == nil {
				reply = add(c)
			}
		case "dial":
			var c net.Conn
			if c, err = net.Dial("tcp", f[1]); err == nil {
				reply = add(c)
			}
		case "write":
			var c *net.TCPConn
			var n int
			if c, n, err = get(f); err == nil {
				_, err = c.Write(make([]byte, n))
			}
		case "read":
			var c *net.TCPConn
			var n int
			if c, n, err = get(f); err == nil {
				_, err = io.ReadFull(c, make([]byte, n))
			}
		case "peek":
			var c *net.TCPConn
			var n, got int
			if c, n, err = get(f); err == nil {
				got, err = peek(c, n)
				reply = strconv.Itoa(got)
			}
		case "shutw":
			var c *net.TCPConn
			if c, _, err = get(f); err == nil {
				err = c.CloseWrite()
			}
		case "eof":
			var c *net.TCPConn
			if c, _, err = get(f); err == nil {
				var m int
				if m, err = c.Read(make([]byte, 1)); err == io.EOF {
					err = nil
				} else if err == nil {
					err = fmt.Errorf("read %d bytes, want end of stream", m)
				}
			}
		case "close":
			var c *net.TCPConn
			if c, _, err = get(f); err == nil {
				err = c.Close()
				id, _ := strconv.Atoi(f[1])
				delete(conns, id)
			}
		case "mass":
			n, _ := strconv.Atoi(f[2])
			var more []net.Conn
			more, err = mass(f[1], n, len(keep))
			keep = append(keep, more...)
			reply = strconv.Itoa(len(keep))
		case "churn":
			n, _ := strconv.Atoi(f[2])
			var d time.Duration
			d, err = churn(f[1], n)
			reply = strconv.FormatInt(d.Nanoseconds(), 10)
		default:
			err = fmt.Errorf("unknown command %q", f[0])
		}
		if err != nil {
			fmt.Fprintf(out, "err %v\n", err)
		} else {
			fmt.Fprintf(out, "ok %s\n", reply)
		}
	}
	return 0
}

func cookieOf(c *net.TCPConn) uint64 {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	var cookie uint64
	rc.Control(func(fd uintptr) {
		cookie, _ = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_COOKIE)
	})
	return cookie
}

// peek waits until n bytes can be peeked and returns how many were.
func peek(c *net.TCPConn, n int) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	buf := make([]byte, n)
	var got int
	var rerr error
	err = rc.Read(func(fd uintptr) bool {
		got, _, rerr = unix.Recvfrom(int(fd), buf, unix.MSG_PEEK|unix.MSG_DONTWAIT)
		if errors.Is(rerr, unix.EAGAIN) || (rerr == nil && got < n) {
			return false // wait for more
		}
		return true
	})
	if err != nil {
		return got, err
	}
	return got, rerr
}

// churn connects to a listener of its own, accepts and closes both ends, n
// times, and returns the time it took.
func churn(addr string, n int) (time.Duration, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	t0 := time.Now()
	for range n {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			return 0, err
		}
		a, err := ln.Accept()
		if err != nil {
			c.Close()
			return 0, err
		}
		a.Close()
		c.Close()
	}
	return time.Since(t0), nil
}

// mass makes n loopback connections to a listener of its own and returns
// both ends, open: 2n sockets, beside the held ones already open.
func mass(addr string, n, held int) ([]net.Conn, error) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return nil, err
	}
	if need := uint64(held + 2*n + 64); lim.Max < need {
		lim.Max = need // root may raise the hard limit
	}
	lim.Cur = lim.Max
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return nil, fmt.Errorf("raise RLIMIT_NOFILE to %d: %w", lim.Cur, err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	defer ln.Close()
	var (
		mu       sync.Mutex
		accepted []net.Conn
		aerr     error
		wg       sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range n {
			c, err := ln.Accept()
			if err != nil {
				aerr = err
				return
			}
			mu.Lock()
			accepted = append(accepted, c)
			mu.Unlock()
		}
	}()
	var out []net.Conn
	for range n {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			ln.Close()
			wg.Wait()
			return nil, err
		}
		out = append(out, c)
	}
	wg.Wait()
	if aerr != nil {
		return nil, aerr
	}
	return append(out, accepted...), nil
}

// rig is one test's fresh world: a cgroup for the job and two network
// namespaces joined by a veth pair, a (192.0.2.1) and b (192.0.2.2).
type rig struct {
	cgroup   string // absolute cgroup directory
	cgroupID uint64
	nsA, nsB string // names in /run/netns
}

const (
	addrA = "192.0.2.1"
	addrB = "192.0.2.2"
)

func randomID(tb testing.TB) string {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		tb.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func newRig(tb testing.TB) *rig {
	tb.Helper()
	id := randomID(tb)
	r := &rig{cgroup: testutil.NewCgroup(tb), nsA: "mpt-" + id + "-a", nsB: "mpt-" + id + "-b"}
	var err error
	if r.cgroupID, err = cgroupv2.ID(r.cgroup); err != nil {
		tb.Fatal(err)
	}
	testutil.NewNamedNetns(tb, r.nsA)
	testutil.NewNamedNetns(tb, r.nsB)
	ip(tb, "link", "add", "eth0", "netns", r.nsA, "type", "veth", "peer", "name", "eth0", "netns", r.nsB)
	for _, x := range []struct{ ns, addr string }{{r.nsA, addrA}, {r.nsB, addrB}} {
		ip(tb, "-n", x.ns, "addr", "add", x.addr+"/24", "dev", "eth0")
		ip(tb, "-n", x.ns, "link", "set", "eth0", "up")
	}
	return r
}

func ip(tb testing.TB, args ...string) {
	tb.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		tb.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// helper is a running helper process.
type helper struct {
	tb  testing.TB
	pid int
	in  io.WriteCloser
	out *bufio.Scanner
}

// newPair is the usual start of a test: a rig, and a client and a server
// helper in its two namespaces, both in the job's cgroup.
func newPair(tb testing.TB) (r *rig, client, server *helper) {
	tb.Helper()
	r = newRig(tb)
	return r, startHelper(tb, r.nsA, r.cgroup), startHelper(tb, r.nsB, r.cgroup)
}

// startHelper runs a helper in network namespace ns, born in cgroup dir
// (clone3 CLONE_INTO_CGROUP) unless dir is "", so that every socket it
// creates carries that cgroup.
func startHelper(tb testing.TB, ns, dir string) *helper {
	tb.Helper()
	exe, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", ns, exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	cmd.Stderr = os.Stderr
	if dir != "" {
		f, err := os.Open(dir)
		if err != nil {
			tb.Fatal(err)
		}
		defer f.Close()
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd())}
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		in.Close() // the helper exits on EOF
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	return &helper{tb: tb, pid: cmd.Process.Pid, in: in, out: sc}
}

// forTest is h for the subtest t: the failures of its commands are t's (a
// subtest may not end its parent).
func (h *helper) forTest(t testing.TB) *helper {
	c := *h
	c.tb = t
	return &c
}

// do sends one command and returns the fields of the "ok" reply.
func (h *helper) do(format string, args ...any) []string {
	h.tb.Helper()
	cmd := fmt.Sprintf(format, args...)
	if _, err := fmt.Fprintln(h.in, cmd); err != nil {
		h.tb.Fatalf("helper %q: %v", cmd, err)
	}
	if !h.out.Scan() {
		h.tb.Fatalf("helper %q: no reply (%v)", cmd, h.out.Err())
	}
	f := strings.Fields(h.out.Text())
	if len(f) == 0 || f[0] != "ok" {
		h.tb.Fatalf("helper %q: %s", cmd, h.out.Text())
	}
	return f[1:]
}

// try is do for another goroutine than the test's: it returns the error
// instead of failing the test.
func (h *helper) try(format string, args ...any) error {
	cmd := fmt.Sprintf(format, args...)
	if _, err := fmt.Fprintln(h.in, cmd); err != nil {
		return fmt.Errorf("helper %q: %v", cmd, err)
	}
	if !h.out.Scan() {
		return fmt.Errorf("helper %q: no reply (%v)", cmd, h.out.Err())
	}
	if f := strings.Fields(h.out.Text()); len(f) == 0 || f[0] != "ok" {
		return fmt.Errorf("helper %q: %s", cmd, h.out.Text())
	}
	return nil
}

// tcpConn is one end of a connection a helper made.
type tcpConn struct {
	id            string
	cookie        uint64
	local, remote string
}

func (h *helper) conn(format string, args ...any) tcpConn {
	h.tb.Helper()
	f := h.do(format, args...)
	if len(f) != 4 {
		h.tb.Fatalf("helper %q: reply %q", fmt.Sprintf(format, args...), f)
	}
	cookie, _ := strconv.ParseUint(f[1], 10, 64)
	return tcpConn{id: f[0], cookie: cookie, local: f[2], remote: f[3]}
}
