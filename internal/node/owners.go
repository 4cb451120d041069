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
