package node

import (
	"bufio"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/internal/sockdiag"
)

// owners maps the connections (local→remote) of pids to the pid's rank.
// It only runs for a report that lists connections, so a failed pause can
// say whose they are; a process that is gone is skipped.
func owners(ranks map[int]int) map[[2]netip.AddrPort]int {
	pids := make([]int, 0, len(ranks))
	for pid := range ranks {
		pids = append(pids, pid)
	}
	out := map[[2]netip.AddrPort]int{}
	for k, ds := range descriptors(pids) {
		out[k] = ranks[ds[0].pid]
	}
	return out
}

// descriptor is one file descriptor of a process.
type descriptor struct{ pid, fd int }

// maxOwnerFds bounds the descriptor numbers looked at in one process: a
// rank can open as many as its limit allows (a million), and each number
// costs mpid a system call. A variable for its test.
var maxOwnerFds = 1 << 16

// descriptors maps the TCP connections (local→remote) of pids to every
// descriptor of theirs that names the connection's socket. Each of a
// process's descriptor numbers (below its table's size, FDSize in
// /proc/PID/status) is copied into mpid with pidfd_getfd(2) and its ends
// read from the copy, which is closed at once. Not /proc/PID/fd: that
// directory is its owner's, mode 0500, and mpid's unit has no
// CAP_DAC_READ_SEARCH, so another user's rank's descriptors would not be
// seen at all; pidfd_getfd asks only for CAP_SYS_PTRACE, which the unit
// has (docs/mpid.md). For reports that list connections and the rare
// check that saw bytes pass a closed gate, never for every round.
func descriptors(pids []int) map[[2]netip.AddrPort][]descriptor {
	out := map[[2]netip.AddrPort][]descriptor{}
	for _, pid := range pids {
		n := min(fdTableSize(pid), maxOwnerFds)
		if n == 0 {
			continue
		}
		pidfd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			continue // gone
		}
		for fd := 0; fd < n; fd++ {
			cp, err := unix.PidfdGetfd(pidfd, fd, 0)
			if errors.Is(err, unix.EBADF) {
				continue // no descriptor of that number
			}
			if err != nil {
				break // not ours to see (ptrace rules, a filter), gone, or mpid out of descriptors
			}
			k, ok := tcpEnds(cp)
			unix.Close(cp)
			if ok {
				out[k] = append(out[k], descriptor{pid, fd})
			}
		}
		unix.Close(pidfd)
	}
	return out
}

// fdTableSize is the size of process pid's descriptor table (FDSize in
// /proc/PID/status, which any user may read), 0 if it cannot be read.
func fdTableSize(pid int) int {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "FDSize:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil || n < 0 {
				return 0
			}
			return n
		}
	}
	return 0
}

// tcpEnds is the local and remote address of fd if it is a connected TCP
// socket, IPv4-mapped addresses unmapped as the observer gives them.
func tcpEnds(fd int) ([2]netip.AddrPort, bool) {
	if p, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL); err != nil || p != unix.IPPROTO_TCP {
		return [2]netip.AddrPort{}, false
	}
	l, err := unix.Getsockname(fd)
	if err != nil {
		return [2]netip.AddrPort{}, false
	}
	r, err := unix.Getpeername(fd)
	if err != nil {
		return [2]netip.AddrPort{}, false // listening, or not connected yet
	}
	la, ok1 := addrPort(l)
	ra, ok2 := addrPort(r)
	return [2]netip.AddrPort{la, ra}, ok1 && ok2
}

func addrPort(sa unix.Sockaddr) (netip.AddrPort, bool) {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)), true
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), uint16(a.Port)), true
	}
	return netip.AddrPort{}, false
}

// holder is a descriptor of a rank's at which its state page shows bytes
// held, and where they go in the stream (ranks.Held), with the
// kernel's count of the bytes its socket had taken when mpid looked.
type holder struct {
	pid, fd    int
	held, from uint64
	sock       socketFacts
}

// socketFacts is what mpid reads of a socket through a copy of its
// descriptor: its ends, and tcp_info's count of the bytes it has taken
// (sockdiag.TCPInfo.Taken; counted false where the kernel's tcp_info has
// none), the count the shim's "held from" is (libmpi-shim/tcpsent.c).
type socketFacts struct {
	ends    [2]netip.AddrPort
	taken   uint64
	counted bool
}

// holdings are the sockets a node's ranks hold bytes for (heldSockets).
type holdings struct {
	by map[[2]netip.AddrPort][]holder
	// cannot says why the ranks' holdings are not all known; "" if they
	// are.
	cannot string
}

// pageRank is what heldSockets needs of a rank: *ranks.Rank's page, and
// its pid.
type pageRank struct {
	pid int
	r   interface {
		Holding() ([]ranks.Held, bool)
	}
}

// maxHeldLooks bounds the scans of the ranks' pages heldSockets makes
// while held bytes move between a socket's descriptors under it.
const maxHeldLooks = 3

// heldSockets names the socket of every descriptor at which a rank's page
// shows bytes held, by copying the descriptor (ends: socketEnds). Only a
// rank holds bytes: mpid closes no other gate, a forked child of a rank
// gets an open gate of its own and none of its parent's held bytes
// (libmpi-shim/gateword.c, mpp_gate_child), and a program without the shim
// holds nothing. So a socket that no rank's page shows held, whoever else
// has a descriptor of it and whether anyone still has one, has nothing
// held for it.
//
// A page is read one descriptor after another while the rank runs, and
// the shim moves a socket's held bytes to another of its descriptors when
// the one they were at is closed: a scan that read the new place before
// the move and the old after it would miss the socket. So the pages are
// scanned again after the copies, even after a scan that found nothing,
// and every descriptor that shows held bytes and was not named is named,
// until a scan after the first finds none new: a move that overlapped one
// scan shows in the next. A holding that begins after
// the first scan goes after everything the kernel had taken by then, so
// naming it too changes nothing. A rank without a page, a descriptor that
// cannot be copied (gone, not mpid's to see) or is not a connected TCP
// socket, more descriptors than maxOwnerFds, or scans that keep finding
// new ones: the holdings are not all known, and cannot says why.
func heldSockets(rs []pageRank, socket func(pid, fd int) (socketFacts, error)) holdings {
	hs := holdings{by: map[[2]netip.AddrPort][]holder{}}
	named := map[descriptor]bool{}
	for look := 0; ; look++ {
		found := false
		for _, pr := range rs {
			held, ok := pr.r.Holding()
			if !ok {
				return holdings{cannot: fmt.Sprintf("pid %d shares no state page to say what it holds", pr.pid)}
			}
			if len(held) > maxOwnerFds {
				return holdings{cannot: fmt.Sprintf("pid %d holds bytes for %d descriptors, more than the %d looked at", pr.pid, len(held), maxOwnerFds)}
			}
			for _, h := range held {
				if named[descriptor{pr.pid, h.Fd}] {
					continue
				}
				if look == maxHeldLooks {
					return holdings{cannot: fmt.Sprintf("the held bytes of pid %d kept moving between descriptors while %d scans of its page named them", pr.pid, maxHeldLooks)}
				}
				found = true
				named[descriptor{pr.pid, h.Fd}] = true
				f, err := socket(pr.pid, h.Fd)
				if err != nil {
					return holdings{cannot: fmt.Sprintf("pid %d holds %d bytes for fd %d, whose socket cannot be named: %v", pr.pid, h.Held, h.Fd, err)}
				}
				hs.by[f.ends] = append(hs.by[f.ends], holder{pr.pid, h.Fd, h.Held, h.From, f})
			}
		}
		if !found && look > 0 {
			return hs
		}
	}
}

// socketOf reads process pid's descriptor fd through a copy made with
// pidfd_getfd and closed at once: the ends of its connection, and its
// tcp_info's count of the bytes it took.
func socketOf(pid, fd int) (socketFacts, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return socketFacts{}, fmt.Errorf("pidfd_open: %w", err)
	}
	defer unix.Close(pidfd)
	cp, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return socketFacts{}, fmt.Errorf("pidfd_getfd: %w", err)
	}
	defer unix.Close(cp)
	k, ok := tcpEnds(cp)
	if !ok {
		return socketFacts{}, errors.New("not a connected TCP socket")
	}
	f := socketFacts{ends: k}
	if info, err := sockdiag.InfoOf(cp); err == nil {
		f.taken, f.counted = info.Taken()
	}
	return f, nil
}
