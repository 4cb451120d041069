package ranks

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"math"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/mpipause/mpipause/internal/jobid"
	"golang.org/x/sys/unix"
)

// makePage builds a state page as the shim does, with fds entries; fd 3 is
// gated and holds 77 bytes from byte 1234 of its stream, fd 5 was short.
func makePage(t *testing.T, fds int, seal bool, mutate func([]byte)) []byte {
	return makePageVersion(t, fds, pageVersion, seal, mutate)
}

// makePageVersion is makePage in a layout of the given version: 1 has no
// "held from".
func makePageVersion(t *testing.T, fds int, version uint32, seal bool, mutate func([]byte)) []byte {
	t.Helper()
	fd, err := unix.MemfdCreate("test-page", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	header := pageHeader2
	if version == 1 {
		header = pageHeader
	}
	held := (header + 2*fds + 7) &^ 7
	size := held + 8*fds
	if version != 1 {
		size += 8 * fds
	}
	b := make([]byte, size)
	copy(b, pageMagic)
	le := binary.LittleEndian
	le.PutUint32(b[8:], version)
	le.PutUint32(b[12:], uint32(fds))
	le.PutUint64(b[16:], uint64(size))
	le.PutUint64(b[24:], uint64(held))
	b[header+5] = 1     // fd 5 short
	b[header+fds+3] = 1 // fd 3 gated
	le.PutUint64(b[held+8*3:], 77)
	if version != 1 {
		from := held + 8*fds
		le.PutUint64(b[40:], uint64(from))
		le.PutUint64(b[from+8*3:], 1234)
	}
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
	if hs, ok := r.Holding(); !ok || len(hs) != 1 || hs[0] != (Held{Fd: 3, Held: 77, From: 1234}) {
		t.Errorf("Holding() = %+v, %v; want [{3 77 1234}], true", hs, ok)
	}
	p.close()
	if s := r.Sockets(); s != nil {
		t.Errorf("Sockets() after close = %+v", s)
	}
	if hs, ok := r.Holding(); ok || hs != nil {
		t.Errorf("Holding() after close = %+v, %v; want nothing, false", hs, ok)
	}
	if _, ok := (&Rank{}).Holding(); ok {
		t.Error("Holding of a rank without a page says it knows")
	}

	for name, oob := range map[string][]byte{
		"unsealed":      makePage(t, 64, false, nil),
		"bad magic":     makePage(t, 64, true, func(b []byte) { b[0] = 'X' }),
		"bad version":   makePage(t, 64, true, func(b []byte) { b[8] = 9 }),
		"too many fds":  makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint32(b[12:], 1<<20) }),
		"size mismatch": makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint64(b[16:], 1) }),
		"held offset":   makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint64(b[24:], 1<<40) }),
		"from offset":   makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint64(b[40:], 1<<40) }),
		"from overlaps": makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint64(b[40:], binary.LittleEndian.Uint64(b[24:])) }),
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

// A version 1 page (a shim older than mpid, under a job that outlived
// mpid's restart) still reads, and says no "held from".
func TestReceivePageVersion1(t *testing.T) {
	p, err := receivePage(makePageVersion(t, 64, 1, true, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	r := &Rank{page: p}
	if got := r.Sockets(); len(got) != 2 || got[0] != (Socket{FD: 3, Gated: true, Held: 77}) || got[1] != (Socket{FD: 5, Short: true}) {
		t.Errorf("Sockets() = %+v", got)
	}
	if hs, ok := r.Holding(); !ok || len(hs) != 1 || hs[0] != (Held{Fd: 3, Held: 77, From: FromUnknown}) {
		t.Errorf("Holding() = %+v, %v; want [{3 77 FromUnknown}], true", hs, ok)
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
	quiet := func(b []byte) { b[pageHeader2+5] = 0 } // no socket mid-message
	hello := fmt.Sprintf("HELLO 2 job=gp rank=0 size=1 pid=%d host=h key=k\n", os.Getpid())
	if _, _, err := c.WriteMsgUnix([]byte(hello), pageFds(t, makePage(t, 64, true, quiet), gfd), nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	r := s.Ranks(jobid.Key(uint32(os.Getuid()), "gp"))[0]
	if r.Quiet() {
		t.Error("Quiet with the gate open")
	}
	if !r.HasGatePage() {
		t.Fatal("no gate page")
	}
	if err := r.CloseGate(ctx); err != nil || atomic.LoadInt32(word) != gateWord(gateClosed, 1) || !r.Quiet() {
		t.Fatalf("after CloseGate: %v, word %#x, quiet %v", err, atomic.LoadInt32(word), r.Quiet())
	}
	br := bufio.NewReader(c)
	for gen := uint32(1); gen <= 3; gen++ {
		if gen > 1 {
			if err := r.CloseGate(ctx); err != nil {
				t.Fatalf("CloseGate: %v", err)
			}
		}
		if got := atomic.LoadInt32(word); got != gateWord(gateClosed, gen) {
			t.Fatalf("close %d: word %#x", gen, got)
		}
		if err := r.ReopenGate(ctx); err != nil {
			t.Fatalf("ReopenGate: %v", err)
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
	// DRAIN goes out without waiting, with its set; its answer, from a
	// shim that drains or from one that does not know DRAIN, is not taken
	// for the next. What waits for the answer runs once it is read, not
	// at the answers still owed to the reopens before it.
	for _, answer := range []string{"DRAINING sockets=2 stashed=4096\n", "ERROR unknown request\n"} {
		answered := make(chan struct{})
		if err := r.StartDrain([]uint64{0x1a, 0xffffffffffffffff}, func() { close(answered) }); err != nil {
			t.Fatalf("StartDrain: %v", err)
		}
		for _, want := range []string{"DRAIN 2\n", "C 1a ffffffffffffffff\n"} {
			if l, err := br.ReadString('\n'); err != nil || l != want {
				t.Fatalf("shim asked %q, %v; want %q", l, err, want)
			}
		}
		select {
		case <-answered:
			t.Fatalf("the DRAIN counted as answered before the shim answered it")
		default:
		}
		fmt.Fprint(c, answer)
		select {
		case <-answered:
		case <-time.After(5 * time.Second):
			t.Fatalf("the shim answered the DRAIN (%q), and 5 s later nothing that waited for it had run", answer)
		}
	}
	go func() {
		if l, err := br.ReadString('\n'); err == nil && l == "STATE\n" {
			// A full stash is reported unasked, before this answer.
			fmt.Fprint(c, "EVENT stash full bytes=1048576 max=1048576\nSTATE gate=open gated=0 closing=0 held=0\n")
		}
	}()
	if g, err := r.State(ctx); err != nil || g.State != "open" {
		t.Errorf("State after unanswered reopens and drains: %+v %v", g, err)
	}
	// Lines are read in order: the event was seen before the answer. It
	// is kept until a new pause clears it, and never taken for an answer.
	if f := r.StashFullSince(); f == nil || *f != (StashFull{Bytes: 1 << 20, Max: 1 << 20}) {
		t.Errorf("stash full: %+v", f)
	}
	r.ClearStashFull()
	if f := r.StashFullSince(); f != nil {
		t.Errorf("after ClearStashFull: %+v", f)
	}
	if err := r.ReopenGate(ctx); err != nil || atomic.LoadInt32(word) != gateOpen {
		t.Errorf("ReopenGate of an open gate: %v, word %#x", err, atomic.LoadInt32(word))
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
	if r := (&Rank{page: p}); r.HasGatePage() || r.closeWord() {
		t.Error("a gate word without a gate page")
	}
}

// TestStatePageGate: without a gate page, Quiet and GateClosed read the
// state page's copy of the gate word, which the shim publishes whole, its
// generation included (libmpi-shim/gateword.c mpp_publish_gate).
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
				b[pageHeader2+5] = 0 // no socket mid-message
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

// TestQuietWhileFlushing: a rank whose shim counts a flush in its page's
// header (libmpi-shim/gateword.c mpp_flush_begin) is not quiet, whatever
// its gate and its sockets show: the flush's thread may be inside a send
// call that hands the kernel a resume's held bytes after mpid's close.
func TestQuietWhileFlushing(t *testing.T) {
	for _, flushing := range []uint32{0, 1, 3} {
		p, err := receivePage(makePage(t, 64, true, func(b []byte) {
			b[pageHeader2+5] = 0 // no socket mid-message
			binary.LittleEndian.PutUint32(b[32:], uint32(gateWord(gateClosed, 2)))
			binary.LittleEndian.PutUint32(b[pageFlushing:], flushing)
		}))
		if err != nil {
			t.Fatal(err)
		}
		r := &Rank{page: p}
		if got, want := r.Quiet(), flushing == 0; got != want {
			t.Errorf("%d flushes counted: Quiet() = %v, want %v", flushing, got, want)
		}
		p.close()
	}
}

// TestDrainRequest: the set travels as "DRAIN <n>" and lines of at most
// 12 cookies in hex, each line short enough for the shim's 256-byte buffer
// (libmpi-shim/req.h), at most MaxDrainSet cookies.
func TestDrainRequest(t *testing.T) {
	if got := DrainRequest(nil); got != "DRAIN 0" {
		t.Errorf("empty set: %q", got)
	}
	var cs []uint64
	for i := range 13 {
		cs = append(cs, math.MaxUint64-uint64(i))
	}
	lines := strings.Split(DrainRequest(cs), "\n")
	if len(lines) != 3 || lines[0] != "DRAIN 13" || len(strings.Fields(lines[1])) != 13 || lines[2] != "C fffffffffffffff3" {
		t.Errorf("13 cookies: %q", lines)
	}
	for _, l := range lines {
		if len(l) > 254 {
			t.Errorf("line of %d bytes", len(l))
		}
	}
	big := make([]uint64, MaxDrainSet+5)
	if got := DrainRequest(big); !strings.HasPrefix(got, fmt.Sprintf("DRAIN %d\n", MaxDrainSet)) || strings.Count(got, " 0") != MaxDrainSet {
		t.Errorf("past MaxDrainSet: %.40q, %d cookies", got, strings.Count(got, " 0"))
	}
}

func TestParseUnheld(t *testing.T) {
	for ev, want := range map[string]Unheld{
		"unheld call=msg-zerocopy fd=7 cookie=1f":              {"a send with MSG_ZEROCOPY", 7, 0x1f},
		"unheld call=sendmsg-ancillary fd=0 cookie=ffffffffff": {"sendmsg with ancillary data", 0, 0xffffffffff},
		"unheld call=msg-fastopen fd=3 cookie=1":               {"a send with MSG_FASTOPEN", 3, 1},
	} {
		if u, err := ParseUnheld(ev); err != nil || u != want {
			t.Errorf("%q: %+v %v, want %+v", ev, u, err, want)
		}
	}
	for _, bad := range []string{"unheld call=write fd=7 cookie=1", "unheld call=msg-zerocopy fd=-1 cookie=1",
		"unheld call=msg-zerocopy fd=7 cookie=zz", "unheld call=msg-zerocopy fd=7", "unheld", "stash full bytes=1 max=2"} {
		if _, err := ParseUnheld(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestParseStashFull(t *testing.T) {
	if f, err := ParseStashFull("stash full bytes=5 max=7"); err != nil || f != (StashFull{5, 7}) {
		t.Errorf("%+v %v", f, err)
	}
	for _, bad := range []string{"stash full bytes=x max=7", "stash full", "flushed bytes=1 errors=0 errno=0", "stash full bytes=-1 max=2"} {
		if _, err := ParseStashFull(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// TestDrainAnsweredWhenGone: what waits for a DRAIN's answer runs when the
// rank goes without answering, and at once for a DRAIN that cannot be
// sent: a node waiting for its ranks' answers never waits on a rank that
// is gone.
func TestDrainAnsweredWhenGone(t *testing.T) {
	s, addr, ctx := serving(t)
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: addr, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	gfd, _ := makeGatePage(t, gatePageSize, true)
	hello := fmt.Sprintf("HELLO 2 job=dg rank=0 size=1 pid=%d host=h key=k\n", os.Getpid())
	if _, _, err := c.WriteMsgUnix([]byte(hello), pageFds(t, makePage(t, 64, true, nil), gfd), nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	r := s.Ranks(jobid.Key(uint32(os.Getuid()), "dg"))[0]
	answered := make(chan struct{})
	if err := r.StartDrain([]uint64{7}, func() { close(answered) }); err != nil {
		t.Fatalf("StartDrain: %v", err)
	}
	br := bufio.NewReader(c)
	for _, want := range []string{"DRAIN 1\n", "C 7\n"} {
		if l, err := br.ReadString('\n'); err != nil || l != want {
			t.Fatalf("shim asked %q, %v; want %q", l, err, want)
		}
	}
	c.Close()
	select {
	case <-answered:
	case <-time.After(5 * time.Second):
		t.Fatal("the rank hung up without answering its DRAIN, and 5 s later what waited for the answer still waited")
	}
	<-r.gone
	again := make(chan struct{})
	if err := r.StartDrain([]uint64{7}, func() { close(again) }); err == nil {
		t.Error("StartDrain to a rank that has gone: no error")
	}
	select {
	case <-again:
	default:
		t.Error("a DRAIN that could not be sent left what waits for its answer waiting")
	}
}
