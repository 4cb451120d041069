package ranks

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// makePage builds a state page as the shim does, with fds entries; fd 3 is
// gated and holds 77 bytes, fd 5 was short.
func makePage(t *testing.T, fds int, seal bool, mutate func([]byte)) []byte {
	t.Helper()
	fd, err := unix.MemfdCreate("test-page", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	held := (pageHeader + 2*fds + 7) &^ 7
	size := held + 8*fds
	b := make([]byte, size)
	copy(b, pageMagic)
	le := binary.LittleEndian
	le.PutUint32(b[8:], pageVersion)
	le.PutUint32(b[12:], uint32(fds))
	le.PutUint64(b[16:], uint64(size))
	le.PutUint64(b[24:], uint64(held))
	b[pageHeader+5] = 1     // fd 5 short
	b[pageHeader+fds+3] = 1 // fd 3 gated
	le.PutUint64(b[held+8*3:], 77)
	if mutate != nil {
		mutate(b)
	}
	if _, err := unix.Pwrite(fd, b, 0); err != nil {
		t.Fatal(err)
	}
	if seal {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
			t.Fatal(err)
		}
	}
	return unix.UnixRights(fd)
}

func TestReceivePage(t *testing.T) {
	p, err := receivePage(makePage(t, 64, true, nil))
	if err != nil {
		t.Fatal(err)
	}
	r := &Rank{page: p}
	got := r.Sockets()
	if len(got) != 2 || got[0] != (Socket{FD: 3, Gated: true, Held: 77}) || got[1] != (Socket{FD: 5, Short: true}) {
		t.Errorf("Sockets() = %+v", got)
	}
	p.close()
	if s := r.Sockets(); s != nil {
		t.Errorf("Sockets() after close = %+v", s)
	}

	for name, oob := range map[string][]byte{
		"unsealed":      makePage(t, 64, false, nil),
		"bad magic":     makePage(t, 64, true, func(b []byte) { b[0] = 'X' }),
		"bad version":   makePage(t, 64, true, func(b []byte) { b[8] = 9 }),
		"too many fds":  makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint32(b[12:], 1<<20) }),
		"size mismatch": makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint64(b[16:], 1) }),
		"held offset":   makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint64(b[24:], 1<<40) }),
	} {
		if p, err := receivePage(oob); err == nil {
			p.close()
			t.Errorf("%s: accepted", name)
		}
	}
	if p, err := receivePage(nil); p != nil || err != nil {
		t.Errorf("no fd: %v, %v; want nil, nil", p, err)
	}
}

// makeGatePage builds a gate page as the shim does and returns its fd and
// the test's own mapping of it (the shim's view of the word).
func makeGatePage(t *testing.T, size int, seal bool) (int, *int32) {
	t.Helper()
	fd, err := unix.MemfdCreate("test-gate", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		t.Fatal(err)
	}
	if seal {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
			t.Fatal(err)
		}
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return fd, (*int32)(unsafe.Pointer(&mem[0]))
}

// pageFds is the SCM_RIGHTS message of a state page and a gate page.
func pageFds(t *testing.T, state []byte, gate int) []byte {
	t.Helper()
	msgs, err := unix.ParseSocketControlMessage(state)
	if err != nil {
		t.Fatal(err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil {
		t.Fatal(err)
	}
	return unix.UnixRights(fds[0], gate)
}

// TestGatePage: mpid closes and reopens a rank's gate by writing the word
// of the page the shim shares, each close in a new generation, asks the
// shim to flush that generation without waiting for its answer, and reads
// the gate from the word; a gate page that could change size is refused.
func TestGatePage(t *testing.T) {
	s, addr, ctx := serving(t)
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: addr, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	gfd, word := makeGatePage(t, gatePageSize, true)
	quiet := func(b []byte) { b[pageHeader+5] = 0 } // no socket mid-message
	hello := fmt.Sprintf("HELLO 2 job=gp rank=0 size=1 pid=%d host=h key=k\n", os.Getpid())
	if _, _, err := c.WriteMsgUnix([]byte(hello), pageFds(t, makePage(t, 64, true, quiet), gfd), nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	r := s.Ranks(JobKey(uint32(os.Getuid()), "gp"))[0]
	if r.Quiet() {
		t.Error("Quiet with the gate open")
	}
	if !r.CloseGate() || atomic.LoadInt32(word) != gateWord(gateClosed, 1) || !r.Quiet() {
		t.Fatalf("after CloseGate: word %#x, quiet %v", atomic.LoadInt32(word), r.Quiet())
	}
	br := bufio.NewReader(c)
	for gen := uint32(1); gen <= 3; gen++ {
		if gen > 1 {
			r.CloseGate()
		}
		if got := atomic.LoadInt32(word); got != gateWord(gateClosed, gen) {
			t.Fatalf("close %d: word %#x", gen, got)
		}
		if ok, err := r.ReopenGate(); !ok || err != nil {
			t.Fatalf("ReopenGate: %v %v", ok, err)
		}
		if got := atomic.LoadInt32(word); got != gateWord(gateFlushing, gen) || r.Quiet() {
			t.Fatalf("reopen %d: word %#x, quiet %v", gen, got, r.Quiet())
		}
		if l, err := br.ReadString('\n'); err != nil || l != fmt.Sprintf("REOPEN %d\n", gen) {
			t.Fatalf("shim asked %q, %v", l, err)
		}
		// The shim's flush done: it opens the word itself (CAS), answers
		// late, and the next request is not confused by that answer.
		atomic.StoreInt32(word, gateOpen)
		fmt.Fprint(c, "REOPENED\nEVENT flushed bytes=1 errors=0 errno=0\n")
	}
	// DRAIN goes out without waiting; its answer, from a shim that drains
	// or from one that does not know DRAIN, is not taken for the next.
	for _, answer := range []string{"DRAINING sockets=2 stashed=4096\n", "ERROR unknown request\n"} {
		if err := r.StartDrain(); err != nil {
			t.Fatalf("StartDrain: %v", err)
		}
		if l, err := br.ReadString('\n'); err != nil || l != "DRAIN\n" {
			t.Fatalf("shim asked %q, %v; want DRAIN", l, err)
		}
		fmt.Fprint(c, answer)
	}
	go func() {
		if l, err := br.ReadString('\n'); err == nil && l == "STATE\n" {
			fmt.Fprint(c, "STATE gate=open gated=0 closing=0 held=0\n")
		}
	}()
	if g, err := r.State(ctx); err != nil || g.State != "open" {
		t.Errorf("State after unanswered reopens and drains: %+v %v", g, err)
	}
	if ok, err := r.ReopenGate(); !ok || err != nil || atomic.LoadInt32(word) != gateOpen {
		t.Errorf("ReopenGate of an open gate: %v %v, word %#x", ok, err, atomic.LoadInt32(word))
	}

	for name, gate := range map[string]func() int{
		"unsealed gate page":  func() int { fd, _ := makeGatePage(t, gatePageSize, false); return fd },
		"gate page too big":   func() int { fd, _ := makeGatePage(t, 2*gatePageSize, true); return fd },
		"gate page too small": func() int { fd, _ := makeGatePage(t, 64, true); return fd },
	} {
		if p, err := receivePage(pageFds(t, makePage(t, 64, true, nil), gate())); err == nil {
			p.close()
			t.Errorf("%s: accepted", name)
		}
	}
	// A state page alone is still a shim's (no gate page: mpid asks).
	p, err := receivePage(makePage(t, 64, true, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	if (&Rank{page: p}).CloseGate() {
		t.Error("CloseGate without a gate page")
	}
}

// TestStatePageGate: without a gate page, Quiet and GateClosed read the
// state page's copy of the gate word, which the shim publishes whole, its
// generation included (libmpi-shim/gate.c publish_gate).
func TestStatePageGate(t *testing.T) {
	for _, tc := range []struct {
		name          string
		word          int32
		quiet, closed bool
	}{
		{"open, generation 0", gateWord(gateOpen, 0), false, false},
		{"closed, generation 0", gateWord(gateClosed, 0), true, true},
		{"closed, generation 3", gateWord(gateClosed, 3), true, true},
		{"flushing, generation 3", gateWord(gateFlushing, 3), false, true},
		{"open, generation 3", gateWord(gateOpen, 3), false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := receivePage(makePage(t, 64, true, func(b []byte) {
				b[pageHeader+5] = 0 // no socket mid-message
				binary.LittleEndian.PutUint32(b[32:], uint32(tc.word))
			}))
			if err != nil {
				t.Fatal(err)
			}
			defer p.close()
			r := &Rank{page: p}
			if got := r.Quiet(); got != tc.quiet {
				t.Errorf("Quiet() = %v, want %v", got, tc.quiet)
			}
			if got := r.GateClosed(); got != tc.closed {
				t.Errorf("GateClosed() = %v, want %v", got, tc.closed)
			}
		})
	}
}
