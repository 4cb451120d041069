package ranks

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The state page a shim shares with mpid (libmpi-shim/gate.c, struct
// mpp_page in shim.h): a header, then per fd a "last call short" byte, a
// "gated" byte and, at heldOffset, a uint64 of bytes held. mpid reads it
// without asking the rank anything.
const (
	pageMagic   = "MPPSTATE"
	pageVersion = 1
	pageHeader  = 40 // magic 8, version 4, fds 4, size 8, held_offset 8, gate 4, pad 4
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
	heldOffset int
}

// receivePage takes the fd a shim attached to its HELLO, checks that it is
// a sealed memfd of the right size (so the rank cannot shrink it under
// mpid's reads), and maps it read-only. No fd attached: nil, nil.
func receivePage(oob []byte) (*statePage, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil || len(msgs) != 1 {
		return nil, fmt.Errorf("control message: %v", err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, fmt.Errorf("want one fd: %v", err)
	}
	fd := fds[0]
	defer unix.Close(fd)
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return nil, errors.New("not a memfd sealed against shrinking")
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Size < pageHeader || st.Size > 64<<20 {
		return nil, fmt.Errorf("size %d", st.Size)
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	p := &statePage{mem: mem}
	le := binary.LittleEndian
	size := le.Uint64(mem[16:])
	p.fds = int(le.Uint32(mem[12:]))
	p.heldOffset = int(le.Uint64(mem[24:]))
	if string(mem[:8]) != pageMagic || le.Uint32(mem[8:]) != pageVersion || size != uint64(st.Size) ||
		p.heldOffset%8 != 0 || pageHeader+2*p.fds > p.heldOffset || p.heldOffset+8*p.fds > len(mem) {
		unix.Munmap(mem)
		return nil, errors.New("bad header")
	}
	return p, nil
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
}

// Sockets returns the sockets the rank's state page shows as mid-message,
// gated or holding bytes, read from the page, not asked of the rank; nil if
// the rank shared no page or is gone.
func (r *Rank) Sockets() []Socket {
	p := r.page
	if p == nil {
		return nil
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.mem == nil {
		return nil
	}
	var out []Socket
	short, gated := p.mem[pageHeader:pageHeader+p.fds], p.mem[pageHeader+p.fds:pageHeader+2*p.fds]
	for fd := 0; fd < p.fds; fd++ {
		held := atomic.LoadUint64((*uint64)(unsafe.Pointer(&p.mem[p.heldOffset+8*fd])))
		if short[fd] != 0 || gated[fd] != 0 || held != 0 {
			out = append(out, Socket{FD: fd, Short: short[fd] != 0, Gated: gated[fd] != 0, Held: held})
		}
	}
	return out
}

// gateClosed is the shim's GATE_CLOSED (shim.h).
const gateClosed = 1

// Quiet reports, from the state page alone, that the rank's gate is closed
// and no socket is mid-message: what a STATE request would say, without
// waking the rank's control thread (which, among busy-polling ranks, can take
// milliseconds to be scheduled). It says false whenever the page cannot
// vouch for that, including a short last send on some fd: the page does not
// know whether that fd is a TCP socket (the shim does), so the caller asks
// the rank.
func (r *Rank) Quiet() bool {
	p := r.page
	if p == nil {
		return false
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.mem == nil {
		return false
	}
	if atomic.LoadUint32((*uint32)(unsafe.Pointer(&p.mem[32]))) != gateClosed {
		return false
	}
	short, gated := p.mem[pageHeader:pageHeader+p.fds], p.mem[pageHeader+p.fds:pageHeader+2*p.fds]
	for fd := 0; fd < p.fds; fd++ {
		if short[fd] != 0 && gated[fd] == 0 {
			return false
		}
	}
	return true
}

// CtlThreadName is the name the shim gives its control thread
// (MPP_CTL_THREAD_NAME in libmpi-shim/shim.h).
const CtlThreadName = "mpipause-ctl"

// Boost sets the niceness of the rank's shim control thread, found by its
// name among the rank's threads, once per rank (a thread keeps it). The
// thread sleeps but for mpid's requests; raised, a request is served as it
// comes instead of after the time slices of the rank's busy-polling threads
// (MPICH's never sleep). It reports whether the thread was found.
func (r *Rank) Boost(nice int) bool {
	if r.boosted.Load() {
		return true
	}
	dir := fmt.Sprintf("/proc/%d/task", r.Pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, t := range tasks {
		comm, err := os.ReadFile(filepath.Join(dir, t.Name(), "comm"))
		if err != nil || strings.TrimSpace(string(comm)) != CtlThreadName {
			continue
		}
		tid, err := strconv.Atoi(t.Name())
		if err == nil && unix.Setpriority(unix.PRIO_PROCESS, tid, nice) == nil {
			r.boosted.Store(true)
			return true
		}
	}
	return false
}
