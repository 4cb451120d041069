package node

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
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

// descriptors maps the TCP connections (local→remote) of pids to every
// descriptor of theirs that names the connection's socket, by the socket
// inodes in /proc/PID/fd and the netns's /proc/PID/net/tcp{,6}. Reading
// the latter walks the kernel's whole TCP hash table (20-30 ms on the
// rig): for reports that list connections and the rare check that saw
// bytes pass a closed gate, never for every round.
func descriptors(pids []int) map[[2]netip.AddrPort][]descriptor {
	byInode := map[uint64][]descriptor{}
	var anyPid int
	for _, pid := range pids {
		dir := fmt.Sprintf("/proc/%d/fd", pid)
		fds, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		anyPid = pid
		for _, f := range fds {
			fd, err := strconv.Atoi(f.Name())
			if err != nil {
				continue
			}
			l, err := os.Readlink(filepath.Join(dir, f.Name()))
			if err != nil {
				continue
			}
			if s, ok := strings.CutPrefix(l, "socket:["); ok {
				if ino, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64); err == nil {
					byInode[ino] = append(byInode[ino], descriptor{pid, fd})
				}
			}
		}
	}
	out := map[[2]netip.AddrPort][]descriptor{}
	if anyPid == 0 {
		return out
	}
	for _, f := range []string{"tcp", "tcp6"} {
		file, err := os.Open(fmt.Sprintf("/proc/%d/net/%s", anyPid, f))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(file)
		sc.Scan() // header
		for sc.Scan() {
			fl := strings.Fields(sc.Text())
			if len(fl) < 10 {
				continue
			}
			ino, err := strconv.ParseUint(fl[9], 10, 64)
			if err != nil {
				continue
			}
			ds, ok := byInode[ino]
			if !ok {
				continue
			}
			l, err1 := parseProcAddr(fl[1])
			r, err2 := parseProcAddr(fl[2])
			if err1 == nil && err2 == nil {
				out[[2]netip.AddrPort{l, r}] = ds
			}
		}
		file.Close()
	}
	return out
}

// parseProcAddr parses /proc/net/tcp's "ADDR:PORT": the address as 32-bit
// words in host (little-endian) order, the port big-endian hex.
func parseProcAddr(s string) (netip.AddrPort, error) {
	a, p, ok := strings.Cut(s, ":")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("no port in %q", s)
	}
	raw, err := hex.DecodeString(a)
	if err != nil || (len(raw) != 4 && len(raw) != 16) {
		return netip.AddrPort{}, fmt.Errorf("address %q", a)
	}
	for i := 0; i < len(raw); i += 4 {
		raw[i], raw[i+1], raw[i+2], raw[i+3] = raw[i+3], raw[i+2], raw[i+1], raw[i]
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("port %q", p)
	}
	addr, _ := netip.AddrFromSlice(raw)
	return netip.AddrPortFrom(addr.Unmap(), uint16(port)), nil
}
