package node

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"golang.org/x/sys/unix"
)

func TestStatusDying(t *testing.T) {
	for _, tc := range []struct {
		name, status string
		want         bool
	}{
		{"running", "Name:\txchg\nState:\tR (running)\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n", false},
		{"frozen, other signal pending", "State:\tS (sleeping)\nSigPnd:\t0000000000004000\nShdPnd:\t0000000000000002\n", false},
		{"SIGKILL pending on the thread", "State:\tS (sleeping)\nSigPnd:\t0000000000000100\nShdPnd:\t0000000000000000\n", true},
		{"SIGKILL pending, shared", "State:\tD (disk sleep)\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000104\n", true},
		{"zombie", "State:\tZ (zombie)\n", true},
		{"dead", "State:\tX (dead)\n", true},
		{"unparsable mask is no evidence", "State:\tS (sleeping)\nSigPnd:\tzz\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := statusDying(tc.status); got != tc.want {
				t.Errorf("statusDying(%q) = %v, want %v", tc.status, got, tc.want)
			}
		})
	}
}

func TestDying(t *testing.T) {
	if dying(os.Getpid()) {
		t.Error("the test process itself reads as dying")
	}
	// A child that exited and was not waited for is a zombie.
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for !dying(cmd.Process.Pid) {
		if time.Now().After(deadline) {
			t.Fatalf("exited child %d never read as dying", cmd.Process.Pid)
		}
		time.Sleep(time.Millisecond)
	}
	cmd.Wait()
	if !dying(cmd.Process.Pid) {
		t.Errorf("reaped child %d does not read as dying", cmd.Process.Pid)
	}
}

func TestViolations(t *testing.T) {
	c := func(cookie uint64, seq uint32) loader.Conn { return loader.Conn{Cookie: cookie, WriteSeq: seq} }
	// First gated report: values recorded, nothing counted.
	sent, v := violations(nil, []loader.Conn{c(1, 100), c(2, 0xfffffff0)}, time.Time{})
	if len(v) != 0 || sent[1] != 100 || sent[2] != 0xfffffff0 {
		t.Fatalf("first report: violations %v, recorded %v; want none, {1:100 2:0xfffffff0}", v, sent)
	}
	// Connection 1 unchanged, 2 sent 0x20 bytes across the wrap, 3 is new.
	sent, v = violations(sent, []loader.Conn{c(1, 100), c(2, 0x10), c(3, 5)}, time.Time{})
	if len(v) != 1 || v[0].c.Cookie != 2 || v[0].bytes != 0x20 {
		t.Fatalf("second report: violations %+v; want connection 2, 32 bytes", v)
	}
	if sent[3] != 5 || len(sent) != 3 {
		t.Fatalf("second report recorded %v; want the three connections", sent)
	}
	// The count is per report: nothing more sent, nothing counted; a
	// connection gone is forgotten.
	sent, v = violations(sent, []loader.Conn{c(2, 0x10)}, time.Time{})
	if len(v) != 0 || len(sent) != 1 {
		t.Fatalf("third report: violations %v, recorded %v; want none, one connection", v, sent)
	}
	// Where the observer counts what was sent, that is the count: a FIN
	// (a close under the closed gate, or a rank's death) moves write_seq
	// and sends no byte.
	counted := func(seq uint32, sent uint64) loader.Conn {
		return loader.Conn{Cookie: 4, WriteSeq: seq, Counted: true, BytesSent: sent}
	}
	sent, _ = violations(nil, []loader.Conn{counted(0xffffffff, 1<<33)}, time.Time{})
	if sent, v = violations(sent, []loader.Conn{counted(0, 1<<33)}, time.Time{}); len(v) != 0 {
		t.Fatalf("a FIN: violations %+v; want none", v)
	}
	if _, v = violations(sent, []loader.Conn{counted(10, 1<<33+10)}, time.Time{}); len(v) != 1 || v[0].bytes != 10 {
		t.Fatalf("10 bytes sent: violations %+v; want 10 bytes", v)
	}
	// A connection first listed after the count began: established
	// since, every byte it took went through closed gates; established
	// before (made during a walk, or adopted: no time), only recorded.
	from := time.Now()
	made := func(cookie, sent uint64, at time.Time) loader.Conn {
		return loader.Conn{Cookie: cookie, Counted: true, BytesSent: sent, Established: at}
	}
	sent, v = violations(map[uint64]uint64{}, []loader.Conn{
		made(5, 700, from.Add(time.Millisecond)), made(6, 800, from.Add(-time.Millisecond)), made(7, 900, time.Time{}),
		made(8, 0, from.Add(time.Millisecond)),
	}, from)
	if len(v) != 1 || v[0].c.Cookie != 5 || v[0].bytes != 700 || sent[5] != 700 || sent[6] != 800 || sent[7] != 900 {
		t.Fatalf("connections new to the count: violations %+v, recorded %v; want connection 5's 700 bytes", v, sent)
	}
	if _, v = violations(map[uint64]uint64{}, []loader.Conn{made(5, 700, from.Add(time.Millisecond))}, time.Time{}); len(v) != 0 {
		t.Fatalf("no count begun: violations %+v; want none", v)
	}
}

func TestStatusStopped(t *testing.T) {
	for _, tc := range []struct {
		name, status string
		want         bool
	}{
		{"running", "Name:\txchg\nState:\tR (running)\n", false},
		{"sleeping, frozen or not", "State:\tS (sleeping)\n", false},
		{"SIGSTOP", "Name:\txchg\nState:\tT (stopped)\nTgid:\t7\n", true},
		{"a tracer's stop passes", "State:\tt (tracing stop)\n", false},
		{"no state", "Name:\txchg\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := statusStopped(tc.status); got != tc.want {
				t.Errorf("statusStopped(%q) = %v, want %v", tc.status, got, tc.want)
			}
		})
	}
}

// TestHeldByKernel: a real child stopped by SIGSTOP reads as held, and as
// not held once SIGCONT lets it go; the test process itself is not held.
func TestHeldByKernel(t *testing.T) {
	if how := heldByKernel(os.Getpid()); how != "" {
		t.Fatalf("the test process reads as held: %s", how)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	pid := cmd.Process.Pid
	waitHeld := func(want bool) string {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			how := heldByKernel(pid)
			if (how != "") == want {
				return how
			}
			if time.Now().After(deadline) {
				t.Fatalf("child %d: held %q, want held %v", pid, how, want)
			}
			time.Sleep(time.Millisecond)
		}
	}
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if how := waitHeld(true); !strings.Contains(how, "stopped by a signal") {
		t.Errorf("stopped child: %q, want it to say it is stopped by a signal", how)
	}
	if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitHeld(false)
}

// TestLate: bytes sent through a closed gate count as late (drained again)
// only where no rank's page shows bytes held for their socket, or the
// bytes held go after all the kernel has taken; anything the pages cannot
// vouch for stays a violation. A socket no rank holds bytes for is late
// whoever sent on it: a rank's forked child on a connection of its own,
// alive or exited (its bytes counted by a drain check while the job's
// ports were not known yet once failed the pause, no rank having a
// descriptor of the socket). Where bytes are held, the kernel's count is
// tcp_info's, read through the holder's descriptor, as the page's place
// is: the observer's count of the violation's connection (here far
// behind) is not what the place is compared with.
func TestLate(t *testing.T) {
	local, remote, fd := loopbackConn(t)
	pid := os.Getpid()
	// The kernel has taken 5,000 bytes of the socket, 40 of them through
	// the closed gate.
	if _, err := unix.Write(fd, make([]byte, 5000)); err != nil {
		t.Fatal(err)
	}
	rank := func(hs ...ranks.Held) []pageRank { return []pageRank{{pid, &fakeHolding{scans: [][]ranks.Held{hs}}}} }
	v := violation{c: loader.Conn{Local: local, Remote: remote, Counted: true, BytesSent: 3}, bytes: 40}
	if why := late(v, heldSockets(rank(), socketOf)); why != "" {
		t.Errorf("nothing held: not late (%s)", why)
	}
	// A late send call, then the same thread's next message held: the held
	// bytes go after byte 5,000, everything the kernel took.
	hs := heldSockets(rank(ranks.Held{Fd: fd, Held: 8, From: 5000}), socketOf)
	want := holder{pid, fd, 8, 5000, socketFacts{[2]netip.AddrPort{local, remote}, 5000, true}}
	if got := hs.by[[2]netip.AddrPort{local, remote}]; hs.cannot != "" || len(got) != 1 || got[0] != want {
		t.Fatalf("held sockets: %+v, want %s->%s held at fd %d, 5000 taken", hs, local, remote, fd)
	}
	if why := late(v, hs); why != "" {
		t.Errorf("8 bytes held from byte 5000, the kernel's count 5000: not late (%s)", why)
	}
	if why, want := late(v, heldSockets(rank(ranks.Held{Fd: fd, Held: 8, From: 4999}), socketOf)), fmt.Sprintf("pid %d holds 8 bytes for fd %d that go after byte 4999 of the stream, and the kernel has taken 5000", pid, fd); why != want {
		t.Errorf("a byte past the held bytes' place: %q, want %q (the log says it)", why, want)
	}
	cannot := fmt.Sprintf("pid %d holds 8 bytes for fd %d, and its page or the kernel cannot say where they go in the stream", pid, fd)
	if why := late(v, heldSockets(rank(ranks.Held{Fd: fd, Held: 8, From: ranks.FromUnknown}), socketOf)); why != cannot {
		t.Errorf("8 bytes held, no place: %q, want %q", why, cannot)
	}
	uncounted := func(pid, fd int) (socketFacts, error) {
		f, err := socketOf(pid, fd)
		f.counted = false
		return f, err
	}
	if why := late(v, heldSockets(rank(ranks.Held{Fd: fd, Held: 8, From: 1 << 40}), uncounted)); why != cannot {
		t.Errorf("8 bytes held on a socket whose tcp_info does not count: %q, want %q", why, cannot)
	}
	// Bytes on a socket no rank holds anything for: late, though the rank
	// holds bytes for another socket and no descriptor of this one is found
	// anywhere.
	other := violation{c: loader.Conn{Local: remote, Remote: netip.MustParseAddrPort("127.0.0.1:1"), Counted: true, BytesSent: 40}, bytes: 40}
	if why := late(other, hs); why != "" {
		t.Errorf("a connection no rank holds bytes for: not late (%s)", why)
	}
	noPage := []pageRank{{pid, &fakeHolding{noPage: true}}}
	if why := late(other, heldSockets(noPage, socketOf)); !strings.Contains(why, "no state page") {
		t.Errorf("a rank without a page: %q, want not late, no state page", why)
	}
	defer func(m int) { maxOwnerFds = m }(maxOwnerFds)
	maxOwnerFds = 1
	if why := late(other, heldSockets(rank(ranks.Held{Fd: fd, Held: 8, From: 5000}, ranks.Held{Fd: fd + 1, Held: 8, From: 0}), socketOf)); !strings.Contains(why, "more than the 1 looked at") {
		t.Errorf("bytes held at more descriptors than are looked at: %q, want not late, more than the 1 looked at", why)
	}
	maxOwnerFds = 1 << 16
	unix.Close(fd)
	if why := late(other, heldSockets(rank(ranks.Held{Fd: fd, Held: 8, From: 5000}), socketOf)); !strings.Contains(why, "cannot be named") {
		t.Errorf("bytes held at a descriptor that cannot be copied: %q, want not late, cannot be named", why)
	}
}

// TestHeldSocketsMoving: held bytes that move from one descriptor of their
// socket to another while the page is scanned are found at one of them:
// the scan that read the new place before the move and the old after it
// is followed by one that reads the new. Bytes that keep moving at every
// scan leave the holdings unknown.
func TestHeldSocketsMoving(t *testing.T) {
	local, remote, fd := loopbackConn(t)
	moved, err := unix.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(moved)
	pid := os.Getpid()
	k := [2]netip.AddrPort{local, remote}
	f := &fakeHolding{scans: [][]ranks.Held{nil, {{Fd: moved, Held: 8, From: 100}}}}
	hs := heldSockets([]pageRank{{pid, f}}, socketOf)
	if got := hs.by[k]; hs.cannot != "" || len(got) != 1 || got[0].fd != moved {
		t.Fatalf("bytes that moved to fd %d during the first scan: %+v, want them found there", moved, hs)
	}
	if f.n != 3 {
		t.Errorf("%d scans, want 3 (the one that missed, the one that found, one that found nothing new)", f.n)
	}
	restless := &fakeHolding{scans: [][]ranks.Held{{{Fd: fd, Held: 8, From: 100}}, {{Fd: moved, Held: 8, From: 100}}, {{Fd: fd + 1000, Held: 8, From: 100}}, {{Fd: fd + 1001, Held: 8, From: 100}}}}
	if hs := heldSockets([]pageRank{{pid, restless}}, func(int, int) (socketFacts, error) { return socketFacts{ends: k}, nil }); !strings.Contains(hs.cannot, "kept moving") {
		t.Errorf("bytes at a new descriptor every scan: %+v, want the holdings unknown", hs)
	}
}

// fakeHolding is a rank's page that shows scans[i] at its i-th scan (the
// last one after that).
type fakeHolding struct {
	scans  [][]ranks.Held
	noPage bool
	n      int
}

func (f *fakeHolding) Holding() ([]ranks.Held, bool) {
	if f.noPage {
		return nil, false
	}
	s := f.scans[min(f.n, len(f.scans)-1)]
	f.n++
	return s, true
}

// TestDescriptorsBounded: the owner lookup looks at no descriptor number
// past maxOwnerFds in a process, however large its table (a rank may open
// a million): a connection on a low number is found, the same socket
// moved past the bound is not.
func TestDescriptorsBounded(t *testing.T) {
	local, remote, fd := loopbackConn(t)
	key := [2]netip.AddrPort{local, remote}
	defer func(m int) { maxOwnerFds = m }(maxOwnerFds)
	maxOwnerFds = fd + 100
	high := fd + 200
	if err := unix.Dup2(fd, high); err != nil {
		t.Fatalf("dup2 to %d: %v", high, err)
	}
	defer unix.Close(high)
	ds := descriptors([]int{os.Getpid()})[key]
	if len(ds) != 1 || ds[0].fd != fd {
		t.Fatalf("descriptors of %v with the bound at %d: %v, want only fd %d (not %d, past the bound)", key, maxOwnerFds, ds, fd, high)
	}
	maxOwnerFds = high + 1
	if ds := descriptors([]int{os.Getpid()})[key]; len(ds) != 2 {
		t.Fatalf("descriptors of %v with the bound at %d: %v, want fds %d and %d", key, maxOwnerFds, ds, fd, high)
	}
}

// loopbackConn connects a TCP pair on loopback, closed when the test ends,
// and returns its client's ends and descriptor.
func loopbackConn(t *testing.T) (local, remote netip.AddrPort, fd int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	raw, err := client.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	raw.Control(func(f uintptr) { fd = int(f) })
	return netip.MustParseAddrPort(client.LocalAddr().String()), netip.MustParseAddrPort(client.RemoteAddr().String()), fd
}
