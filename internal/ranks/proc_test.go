package ranks

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// connectEnv makes the test binary a process that connects the unix socket
// it got as fd 3 to the address in the variable, and exits: the child of
// the pid-reuse attack (docs/security.md, H1).
const connectEnv = "MPIPAUSE_RANKS_TEST_CONNECT"

func TestMain(m *testing.M) {
	if addr := os.Getenv(connectEnv); addr != "" {
		sa := &unix.SockaddrUnix{Name: addr}
		if addr[0] == '@' {
			sa.Name = "\x00" + addr[1:]
		}
		if err := unix.Connect(3, sa); err != nil {
			fmt.Fprintln(os.Stderr, "connect:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// deadPeer is a connection to addr that a child process made and then
// exited (reaped): the connection's SO_PEERCRED still names the child's
// pid, which is returned.
func deadPeer(t *testing.T, addr string) (*os.File, int) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "rank-socket")
	t.Cleanup(func() { f.Close() })
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), connectEnv+"="+addr)
	cmd.ExtraFiles = []*os.File{f}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("child: %v: %s", err, out)
	}
	return f, cmd.Process.Pid
}

// TestJoinOfExitedPeer is H1: a child connects and exits, and the parent
// sends a JOIN naming the child's pid on that connection. The line's pid
// is SO_PEERCRED's, but the process is gone (its number may be a victim's
// by now): the JOIN is refused and Join never called.
func TestJoinOfExitedPeer(t *testing.T) {
	called := make(chan int, 1)
	_, addr, refused := joinServer(t, func(r JoinRequest) error { called <- r.Proc.Pid; return nil })
	f, pid := deadPeer(t, addr)
	f.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(f, "JOIN 2 job=j pid=%d key=k\n", pid)
	reply := make([]byte, 256)
	n, _ := f.Read(reply)
	if strings.HasPrefix(string(reply[:n]), "OK") {
		t.Errorf("a JOIN of exited pid %d was answered %q", pid, reply[:n])
	}
	wantRefusal(t, refused, "exited")
	if len(called) != 0 {
		t.Errorf("Join called for pid %d, which had exited", <-called)
	}
}

// TestHelloOfExitedPeer: the same for a HELLO: an exited process is not
// registered.
func TestHelloOfExitedPeer(t *testing.T) {
	s, addr, ctx := serving(t)
	refused := make(chan error, 1)
	hooksOf(s).changed = func(r *Rank, gone bool, err error) {
		if r == nil {
			refused <- err
		}
	}
	f, pid := deadPeer(t, addr)
	fmt.Fprintf(f, "HELLO 2 job=j rank=0 size=1 pid=%d host=h key=k\n", pid)
	select {
	case err := <-refused:
		if !errors.Is(err, ErrExited) {
			t.Errorf("refused with %v, want %v", err, ErrExited)
		}
	case <-ctx.Done():
		t.Fatal("the HELLO of an exited process was not refused")
	}
	if rs := s.Ranks(""); len(rs) != 0 {
		t.Errorf("an exited process registered: %+v", rs)
	}
}

// TestOpenProc is the path of kernels without SO_PEERPIDFD: pidfd_open of
// the credentials' pid, refused for a process of another uid (a cross-user
// pid reuse) and for one that has exited.
func TestOpenProc(t *testing.T) {
	p, err := openProc(os.Getpid(), uint32(os.Geteuid()))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Alive(); err != nil {
		t.Errorf("Alive of this process: %v", err)
	}
	p.Close()
	if err := p.Alive(); !errors.Is(err, ErrExited) {
		t.Errorf("Alive after Close: %v, want %v", err, ErrExited)
	}
	if _, err := openProc(os.Getpid(), uint32(os.Geteuid())+1); !errors.Is(err, ErrExited) || !strings.Contains(err.Error(), "not as the uid") {
		t.Errorf("a pid of another uid: %v, want a refusal", err)
	}
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	if _, err := openProc(cmd.Process.Pid, uint32(os.Geteuid())); !errors.Is(err, ErrExited) {
		t.Errorf("an exited pid: %v, want %v", err, ErrExited)
	}
}

// TestMoveTo: the pid is written only while the pidfd's process is alive;
// once it has exited nothing is written (the number may be anyone's).
func TestMoveTo(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	p, err := openProc(cmd.Process.Pid, uint32(os.Geteuid()))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// A directory standing in for a cgroup: MoveTo writes its cgroup.procs.
	dir := t.TempDir()
	procs := filepath.Join(dir, "cgroup.procs")
	if err := os.WriteFile(procs, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := p.MoveTo(dir); err != nil {
		t.Fatalf("MoveTo with the process alive: %v", err)
	}
	if b, _ := os.ReadFile(procs); string(b) != strconv.Itoa(cmd.Process.Pid) {
		t.Fatalf("cgroup.procs holds %q, want %d", b, cmd.Process.Pid)
	}
	os.WriteFile(procs, nil, 0o644)
	cmd.Process.Kill()
	cmd.Wait()
	if err := p.MoveTo(dir); !errors.Is(err, ErrExited) {
		t.Errorf("MoveTo of an exited process: %v, want %v", err, ErrExited)
	}
	if b, _ := os.ReadFile(procs); len(b) != 0 {
		t.Errorf("MoveTo of an exited process wrote %q", b)
	}
}

// TestPendingCap: a uid's connections that have not sent their first line
// hold at most MaxPendingPerUID waits; one more is closed at once and
// reported, and a connection whose line is there is read without a wait.
func TestPendingCap(t *testing.T) {
	s, addr, ctx := serving(t)
	refused := make(chan error, 4)
	hooksOf(s).changed = func(r *Rank, gone bool, err error) {
		if r == nil {
			refused <- err
		}
	}
	var silent []net.Conn
	defer func() {
		for _, c := range silent {
			c.Close()
		}
	}()
	for range MaxPendingPerUID {
		c, err := net.Dial("unix", addr)
		if err != nil {
			t.Fatal(err)
		}
		silent = append(silent, c)
	}
	uid := uint32(os.Geteuid())
	for {
		s.mu.Lock()
		n := s.pending[uid]
		s.mu.Unlock()
		if n == MaxPendingPerUID {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("%d connections waiting, want %d", n, MaxPendingPerUID)
		}
		time.Sleep(time.Millisecond) // polls a condition; nothing else to wait on
	}
	c, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Closed long before the 10 s a waiting connection gets.
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("a connection over the cap was not closed at once: %v", err)
	}
	wantRefusal(t, refused, "waiting for their first line")
}

// TestReadFirstNoWait: over the cap a line already there is read, one not
// there is not waited for; nothing after the line is consumed.
func TestReadFirstNoWait(t *testing.T) {
	a, b := unixPair(t)
	fmt.Fprint(b, "HELLO 1 x\nEVENT pause\n")
	f, err := readFirst(a, false)
	if err != nil || f.line != "HELLO 1 x" {
		t.Fatalf("readFirst: %q %v", f.line, err)
	}
	rest := make([]byte, 64)
	n, _ := a.Read(rest)
	if string(rest[:n]) != "EVENT pause\n" {
		t.Errorf("after the first line: %q, want the next line whole", rest[:n])
	}
	fmt.Fprint(b, "HELLO 1 half")
	if _, err := readFirst(a, false); !errors.Is(err, unix.EAGAIN) {
		t.Errorf("a half line without waiting: %v, want EAGAIN", err)
	}
}

// TestLongFirstLine: a first line past the bound is refused, not held.
func TestLongFirstLine(t *testing.T) {
	a, b := unixPair(t)
	go func() {
		line := make([]byte, maxFirstLine+1)
		for i := range line {
			line[i] = 'x'
		}
		b.Write(line)
	}()
	a.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := readFirst(a, true); err == nil || !strings.Contains(err.Error(), "too long") {
		t.Errorf("a first line of %d bytes: %v, want too long", maxFirstLine+1, err)
	}
}

// TestLongRankLine is H3: a registered rank that sends one endless line is
// cut off once it passes MaxRankLine, and mpid never holds the line.
func TestLongRankLine(t *testing.T) {
	s, addr, ctx := serving(t)
	cut := make(chan error, 1)
	hooksOf(s).changed = func(r *Rank, gone bool, err error) {
		if gone {
			cut <- err
		}
	}
	c, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "HELLO 2 job=long rank=0 size=1 pid=%d host=h key=k\n", os.Getpid())
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	const total = 64 << 20
	sent := make(chan int, 1)
	go func() {
		chunk := make([]byte, 64<<10)
		for i := range chunk {
			chunk[i] = 'x'
		}
		n := 0
		for n < total {
			w, err := c.Write(chunk)
			n += w
			if err != nil {
				break
			}
		}
		sent <- n
	}()
	select {
	case err := <-cut:
		if err == nil || !strings.Contains(err.Error(), "longer than") {
			t.Errorf("the rank went with %v, want it cut off for its line", err)
		}
	case <-ctx.Done():
		t.Fatal("a rank sending an endless line was not cut off")
	}
	if n := <-sent; n >= total {
		t.Errorf("mpid took all %d bytes of one line", n)
	}
	runtime.ReadMemStats(&m1)
	if grew := m1.TotalAlloc - m0.TotalAlloc; grew > 4<<20 {
		t.Errorf("reading the line allocated %d bytes", grew)
	}
}

func unixPair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var cs [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "pair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		cs[i] = c.(*net.UnixConn)
		t.Cleanup(func() { c.Close() })
	}
	return cs[0], cs[1]
}
