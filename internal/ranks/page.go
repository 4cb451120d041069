package ranks

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The state page a shim shares with mpid (libmpi-shim/gateword.c, struct
// mpp_page in shim.h): a header, then per fd a "last call short" byte, a
// "gated" byte, at heldOffset a uint64 of bytes held and, from version 2,
// at fromOffset a uint64 "held from" (Holding). mpid reads it without
// asking the rank anything. A version 1 page (a shim older than this mpid,
// one that restarted under a running job) says no "held from".
const (
	pageMagic   = "MPPSTATE"
	pageVersion = 2
	pageHeader  = 40 // magic 8, version 4, fds 4, size 8, held_offset 8, gate 4, flushing 4; from_offset 8 from version 2
	pageHeader2 = 48
	// pageFlushing is the header's count of the shim's flushes sending
	// held bytes now: senders the per-fd flags do not show.
	pageFlushing = 36
)

// Socket is one socket's entry in a rank's state page.
type Socket struct {
	FD    int    `json:"fd"`
	Short bool   `json:"short"` // its last send call was short: mid-message
	Gated bool   `json:"gated"` // at a call boundary under the closed gate
	Held  uint64 `json:"held"`  // bytes held in the shim
}

type statePage struct {
	mu         sync.RWMutex // Sockets reads under RLock; close unmaps under Lock
	mem        []byte       // nil once closed
	fds        int
	arrays     int // where the per-fd flags start: the header's length
	heldOffset int
	fromOffset int // 0: the page says no "held from"
	// gate is the shim's gate word's page (union mpp_gate_page), mapped
	// read-write: mpid closes and reopens the gate by writing the word.
	// nil if the shim shared none.
	gate []byte
	gen  atomic.Uint32 // of mpid's last close
}

// The gate word (shim.h): state in the low 2 bits, the generation of the
// close above them; open is 0.
const (
	gateOpen     = 0
	gateClosed   = 1
	gateFlushing = 2
	gatePageSize = 4096
	genMask      = 0x1fffffff
)

func gateWord(state, gen uint32) int32 { return int32((gen&genMask)<<2 | state) }

// receivePage takes the fds a shim attached to its HELLO: the state page,
// a sealed memfd of the right size (so the rank cannot shrink it under
// mpid's reads) mapped read-only, and optionally the gate page, sealed the
// same way, mapped read-write. No fd attached: nil, nil.
func receivePage(oob []byte) (*statePage, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil || len(msgs) != 1 {
		return nil, fmt.Errorf("control message: %v", err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	for _, fd := range fds {
		defer unix.Close(fd)
	}
	if err != nil || len(fds) < 1 || len(fds) > 2 {
		return nil, fmt.Errorf("want one or two fds: %d, %v", len(fds), err)
	}
	mem, err := mapSealed(fds[0], pageHeader, 64<<20, unix.PROT_READ)
	if err != nil {
		return nil, fmt.Errorf("state page: %w", err)
	}
	p, err := checkPage(mem)
	if err != nil {
		unix.Munmap(mem)
		return nil, err
	}
	if len(fds) == 2 {
		gate, err := mapSealed(fds[1], gatePageSize, gatePageSize, unix.PROT_READ|unix.PROT_WRITE)
		if err != nil {
			unix.Munmap(mem)
			return nil, fmt.Errorf("gate page: %w", err)
		}
		p.gate = gate
	}
	return p, nil
}

// checkPage checks a state page's header against the page's real size:
// every array it describes must lie inside mem, whatever the rank wrote.
func checkPage(mem []byte) (*statePage, error) {
	if len(mem) < pageHeader {
		return nil, errors.New("bad header: page too small")
	}
	le := binary.LittleEndian
	size := le.Uint64(mem[16:])
	fds := uint64(le.Uint32(mem[12:]))
	held := le.Uint64(mem[24:])
	version := le.Uint32(mem[8:])
	header := uint64(pageHeader)
	if version == pageVersion {
		header = pageHeader2
	}
	// In uint64, and each bound before it is used in the next, so that no
	// header can overflow the arithmetic into a small number.
	if string(mem[:8]) != pageMagic || (version != 1 && version != pageVersion) || size != uint64(len(mem)) ||
		uint64(len(mem)) < header || held%8 != 0 || held > size || header+2*fds > held || 8*fds > size-held {
		return nil, errors.New("bad header")
	}
	p := &statePage{mem: mem, fds: int(fds), arrays: int(header), heldOffset: int(held)}
	if version == pageVersion {
		from := le.Uint64(mem[40:])
		if from%8 != 0 || from > size || from < held+8*fds || 8*fds > size-from {
			return nil, errors.New("bad header")
		}
		p.fromOffset = int(from)
	}
	return p, nil
}

// mapSealed maps a memfd sealed against resizing whose size is within
// [lo, hi].
func mapSealed(fd, lo, hi int, prot int) ([]byte, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_GROW) != unix.F_SEAL_SHRINK|unix.F_SEAL_GROW {
		return nil, errors.New("not a memfd sealed against resizing")
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Size < int64(lo) || st.Size > int64(hi) {
		return nil, fmt.Errorf("size %d", st.Size)
	}
	return unix.Mmap(fd, 0, int(st.Size), prot, unix.MAP_SHARED)
}

func (p *statePage) close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mem != nil {
		unix.Munmap(p.mem)
		p.mem = nil
	}
	if p.gate != nil {
		unix.Munmap(p.gate)
		p.gate = nil
	}
}

// word is the gate word, or nil. Called under p.mu.
func (p *statePage) word() *int32 {
	if p == nil || p.gate == nil {
		return nil
	}
	return (*int32)(unsafe.Pointer(&p.gate[0]))
}

// withWord runs fn on the rank's gate word under the page's read lock (a
// close of the page waits for it); false if the shim shared no gate page.
func (r *Rank) withWord(fn func(w *int32)) bool {
	p := r.page
	if p == nil {
		return false
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	w := p.word()
	if w == nil {
		return false
	}
	fn(w)
	return true
}

// withPage runs fn on the rank's state page under its read lock (a close of
// the page waits for it); false if the rank shared no page or is gone.
func (r *Rank) withPage(fn func(p *statePage)) bool {
	p := r.page
	if p == nil {
		return false
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.mem == nil {
		return false
	}
	fn(p)
	return true
}

// CloseGate closes the rank's send gate, by its gate word when the shim
// shared a gate page (closeWord: it wakes nobody, and a frozen or busy
// control thread does not delay it), else by asking its shim (Close).
func (r *Rank) CloseGate(ctx context.Context) error {
	if r.closeWord() {
		return nil
	}
	_, err := r.Close(ctx)
	return err
}

// ReopenGate lets the rank's sends through again, held bytes first: by its
// gate word and a REOPEN nobody waits for when the shim shared a gate page
// (reopenWord), else by asking its shim and waiting for its answer
// (Reopen).
func (r *Rank) ReopenGate(ctx context.Context) error {
	if ok, err := r.reopenWord(); ok || err != nil {
		return err
	}
	return r.Reopen(ctx)
}

// HasGatePage reports whether the rank's shim shared its gate page, so
// that CloseGate and ReopenGate write its gate word.
func (r *Rank) HasGatePage() bool { return r.withWord(func(*int32) {}) }

// closeWord closes the rank's gate, in a new generation, by writing its
// gate word, and reports whether it could: false when the shim shared no
// gate page. Unlike Close it wakes nobody: a rank's send calls see the
// word at their next call.
func (r *Rank) closeWord() bool {
	return r.withWord(func(w *int32) {
		// mpid counts the generations: the word forgets its own once open,
		// and a late "REOPEN <gen>" must never match a later close.
		atomic.StoreInt32(w, gateWord(gateClosed, r.page.gen.Add(1)))
	})
}

// reopenWord lets the rank's sends through again by writing its gate word
// (closed to flushing, same generation), then asks its shim to flush what it
// held ("REOPEN <gen>") without waiting for the answer: a send to a socket
// with held bytes queues behind them until the flush, so order holds, and
// a rank whose control thread is slow to be scheduled runs meanwhile. The
// flush's outcome comes as an event. False when the shim shared no gate
// page.
func (r *Rank) reopenWord() (bool, error) {
	var gen uint32
	open := false
	if !r.withWord(func(w *int32) {
		old := atomic.LoadInt32(w)
		if old == gateOpen {
			open = true // nothing held: opening an open gate does nothing
			return
		}
		gen = uint32(old) >> 2
		if old&3 == gateClosed {
			// Only from this very word: the shim may have moved it
			// meanwhile (a REOPEN of its own, or an OPEN after losing mpid).
			atomic.CompareAndSwapInt32(w, old, gateWord(gateFlushing, gen))
		}
	}) {
		return false, nil
	}
	if open {
		return true, nil
	}
	return true, r.notify(fmt.Sprintf("REOPEN %d", gen), nil)
}

// StartDrain asks the rank's shim, whose gate is closed, to move what
// arrives on the sockets named by cookies into its own memory until the
// gate reopens, so that the kernel's queues empty whether or not the rank
// reads: a rank computing for seconds, or blocked outside MPI, would
// otherwise hold the pause. cookies are the job's own connections on the
// node (the caller's choice, from the kernel); the shim drains only those of
// them that are its sockets, never another socket of the process. Nobody
// waits for the answer ("DRAINING ...", or an error line from a shim that
// does not know DRAIN): the next request collects it. answered, if not
// nil, runs once the answer has come (the shim has drained and
// acknowledged what waited), the rank has gone, or the DRAIN could not be
// sent; it must not block. At most MaxDrainSet cookies go.
func (r *Rank) StartDrain(cookies []uint64, answered func()) error {
	return r.notify(DrainRequest(cookies), answered)
}

// MaxDrainSet is the most cookies one DRAIN names (MPP_DRAIN_MAX in
// libmpi-shim/req.h), and drainPerLine how many go on a line
// (MPP_COOKIES_LINE): the shim reads lines of at most 255 bytes.
const (
	MaxDrainSet  = 65536
	drainPerLine = 12
)

// DrainRequest is the DRAIN request for cookies, without its last newline:
// "DRAIN <n>" and then n cookies in hex, drainPerLine to a "C" line. The
// first MaxDrainSet cookies only.
func DrainRequest(cookies []uint64) string {
	if len(cookies) > MaxDrainSet {
		cookies = cookies[:MaxDrainSet]
	}
	var b strings.Builder
	fmt.Fprintf(&b, "DRAIN %d", len(cookies))
	for i, c := range cookies {
		if i%drainPerLine == 0 {
			b.WriteString("\nC")
		}
		b.WriteString(" " + strconv.FormatUint(c, 16))
	}
	return b.String()
}

// StashFull is the shim's "EVENT stash full bytes=<n> max=<m>": its stashes
// hold the cap (MPIPAUSE_STASH_MAX_MB), so its drain stopped taking and the
// rest stays in the kernel.
type StashFull struct {
	Bytes, Max uint64
}

// ParseStashFull parses the event "stash full bytes=<n> max=<m>".
func ParseStashFull(ev string) (StashFull, error) {
	rest, ok := strings.CutPrefix(ev, "stash full ")
	if !ok {
		return StashFull{}, fmt.Errorf("not a stash report: %q", ev)
	}
	kv, err := fields("FULL "+rest, "FULL")
	if err != nil {
		return StashFull{}, err
	}
	var f StashFull
	var e1, e2 error
	f.Bytes, e1 = strconv.ParseUint(kv["bytes"], 10, 64)
	f.Max, e2 = strconv.ParseUint(kv["max"], 10, 64)
	if e1 != nil || e2 != nil {
		return StashFull{}, fmt.Errorf("malformed stash report %q", ev)
	}
	return f, nil
}

// Unheld is the shim's "EVENT unheld call=<call> fd=<n> cookie=<hex>": a
// call that cannot be held without changing its meaning (sendmsg with
// ancillary data, MSG_ZEROCOPY, MSG_FASTOPEN, pwritev2 with flags) went to the kernel under the
// closed gate, on the TCP socket with that cookie. The shim reports the
// first few of each closing (on any of its TCP sockets: mpid tells the
// job's connections from the program's own).
type Unheld struct {
	Call   string
	Fd     int
	Cookie uint64
}

// unheldCalls are the calls a shim names, and what they are called here.
var unheldCalls = map[string]string{
	"sendmsg-ancillary": "sendmsg with ancillary data",
	"msg-zerocopy":      "a send with MSG_ZEROCOPY",
	"msg-fastopen":      "a send with MSG_FASTOPEN",
	"pwritev2-flags":    "pwritev2 with flags",
}

// ParseUnheld parses the event "unheld call=<call> fd=<n> cookie=<hex>".
func ParseUnheld(ev string) (Unheld, error) {
	rest, ok := strings.CutPrefix(ev, "unheld ")
	if !ok {
		return Unheld{}, fmt.Errorf("not an unheld report: %q", ev)
	}
	kv, err := fields("UNHELD "+rest, "UNHELD")
	if err != nil {
		return Unheld{}, err
	}
	call, ok := unheldCalls[kv["call"]]
	fd, e1 := strconv.Atoi(kv["fd"])
	ck, e2 := strconv.ParseUint(kv["cookie"], 16, 64)
	if !ok || e1 != nil || e2 != nil || fd < 0 {
		return Unheld{}, fmt.Errorf("malformed unheld report %q", ev)
	}
	return Unheld{Call: call, Fd: fd, Cookie: ck}, nil
}

// MaxUnheld is how many reports of unheld calls a rank keeps a pause: the
// shim sends no more than that a closing.
const MaxUnheld = 8

// UnheldSince is the shim's reports of unheld calls since ClearStashFull,
// the first MaxUnheld.
func (r *Rank) UnheldSince() []Unheld {
	r.unheldMu.Lock()
	defer r.unheldMu.Unlock()
	return slices.Clone(r.unheld)
}

func (r *Rank) noteUnheld(u Unheld) {
	r.unheldMu.Lock()
	if len(r.unheld) < MaxUnheld {
		r.unheld = append(r.unheld, u)
	}
	r.unheldMu.Unlock()
}

// StashFullSince is the shim's last report of a full stash since
// ClearStashFull (nil: none).
func (r *Rank) StashFullSince() *StashFull { return r.full.Load() }

// ClearStashFull forgets the last reports of a full stash and of an
// unheld call: a new pause begins.
func (r *Rank) ClearStashFull() {
	r.full.Store(nil)
	r.unheldMu.Lock()
	r.unheld = nil
	r.unheldMu.Unlock()
}

// flags are the page's per-fd "last call short" and "gated" bytes. Called
// under p.mu with p.mem mapped.
func (p *statePage) flags() (short, gated []byte) {
	return p.mem[p.arrays : p.arrays+p.fds], p.mem[p.arrays+p.fds : p.arrays+2*p.fds]
}

// Sockets returns the sockets the rank's state page shows as mid-message,
// gated or holding bytes, read from the page, not asked of the rank; nil if
// the rank shared no page or is gone.
func (r *Rank) Sockets() []Socket {
	var out []Socket
	r.withPage(func(p *statePage) {
		short, gated := p.flags()
		for fd := 0; fd < p.fds; fd++ {
			held := atomic.LoadUint64((*uint64)(unsafe.Pointer(&p.mem[p.heldOffset+8*fd])))
			if short[fd] != 0 || gated[fd] != 0 || held != 0 {
				out = append(out, Socket{FD: fd, Short: short[fd] != 0, Gated: gated[fd] != 0, Held: held})
			}
		}
	})
	return out
}

// FromUnknown is Holding's From where the page cannot say where in the
// stream the held bytes go.
const FromUnknown = ^uint64(0)

// Held is one descriptor at which a rank's state page shows bytes held
// (the page keeps a socket's count at one of its descriptors, zero at the
// others), and where they go in the socket's stream: From is tcp_info's
// count of the bytes the socket took before them
// (libmpi-shim/tcpsent.c), or FromUnknown.
type Held struct {
	Fd         int
	Held, From uint64
}

// Holding returns every descriptor at which the rank's state page shows
// bytes held, in descriptor order; ok is false if the rank shared no page
// or is gone. The page covers every descriptor the shim can hold bytes
// for (one beyond its tables is never gated), so a socket that is at none
// of them has nothing held by this rank when the page was read. The shim
// writes From before Held, and Held is read first.
func (r *Rank) Holding() (out []Held, ok bool) {
	ok = r.withPage(func(p *statePage) {
		for fd := 0; fd < p.fds; fd++ {
			held := atomic.LoadUint64((*uint64)(unsafe.Pointer(&p.mem[p.heldOffset+8*fd])))
			if held == 0 {
				continue
			}
			from := FromUnknown
			if p.fromOffset != 0 {
				from = atomic.LoadUint64((*uint64)(unsafe.Pointer(&p.mem[p.fromOffset+8*fd])))
			}
			out = append(out, Held{Fd: fd, Held: held, From: from})
		}
	})
	return out, ok
}

// Quiet reports, from the state page alone, that the rank's gate is closed,
// no socket is mid-message and no flush of held bytes is running (a
// resume's flush overtaken by this close sends until its thread sees the
// word: its answer to STATE comes after it stopped): what a STATE request
// would say, without waking the rank's control thread (which, among
// busy-polling ranks, can take milliseconds to be scheduled). It says false whenever the page cannot
// vouch for that, including a short last send on some fd: the page does not
// know whether that fd is a TCP socket (the shim does), so the caller asks
// the rank.
func (r *Rank) Quiet() bool {
	quiet := false
	r.withPage(func(p *statePage) {
		if p.gateState() != gateClosed ||
			atomic.LoadUint32((*uint32)(unsafe.Pointer(&p.mem[pageFlushing]))) != 0 {
			return
		}
		short, gated := p.flags()
		for fd := 0; fd < p.fds; fd++ {
			if short[fd] != 0 && gated[fd] == 0 {
				return
			}
		}
		quiet = true
	})
	return quiet
}

// GateClosed reports, from the gate word (or the state page's copy of it),
// whether the rank's gate is closed or still flushing what it held: not
// open. False when the rank shared no page or is gone. Read, never asked:
// a frozen rank can be looked at too (mpid's metrics).
func (r *Rank) GateClosed() bool {
	closed := false
	r.withPage(func(p *statePage) { closed = p.gateState() != gateOpen })
	return closed
}

// gateState is the gate's state (open, closed, flushing) from the gate
// page's word when there is one (mpid writes it), else from the state page's
// copy, which the shim publishes as the whole word, generation included.
// The caller holds p.mu and has checked p.mem.
func (p *statePage) gateState() uint32 {
	if w := p.word(); w != nil {
		return uint32(atomic.LoadInt32(w)) & 3
	}
	return atomic.LoadUint32((*uint32)(unsafe.Pointer(&p.mem[32]))) & 3
}

// ShimThreadName is the name the shim gives its control thread
// (MPP_RANKCH_THREAD_NAME in libmpi-shim/shim.h).
const ShimThreadName = "mpipause-ctl"

// ShimThread is the thread id of pid's shim control thread, found by its
// name among pid's threads; 0 if it has none (not a registered rank).
func ShimThread(pid int) int {
	dir := fmt.Sprintf("/proc/%d/task", pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	for _, t := range tasks {
		comm, err := os.ReadFile(filepath.Join(dir, t.Name(), "comm"))
		if err != nil || strings.TrimSpace(string(comm)) != ShimThreadName {
			continue
		}
		if tid, err := strconv.Atoi(t.Name()); err == nil {
			return tid
		}
	}
	return 0
}
