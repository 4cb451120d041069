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

// owners maps the connections (local→remote) of pids to the pid's rank, by
// the socket inodes in /proc/PID/fd and the netns's /proc/PID/net/tcp{,6}.
// It only runs for a report that lists connections, so a failed pause can
// say whose they are; a process that is gone is skipped.
func owners(ranks map[int]int) map[[2]netip.AddrPort]int {
	inodeRank := map[uint64]int{}
	var anyPid int
	for pid, rank := range ranks {
		fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		if err != nil {
			continue
		}
		anyPid = pid
		for _, fd := range fds {
			l, err := os.Readlink(filepath.Join(fmt.Sprintf("/proc/%d/fd", pid), fd.Name()))
			if err != nil {
				continue
			}
			if s, ok := strings.CutPrefix(l, "socket:["); ok {
				if ino, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64); err == nil {
					inodeRank[ino] = rank
				}
			}
		}
	}
	out := map[[2]netip.AddrPort]int{}
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
			rank, ok := inodeRank[ino]
			if !ok {
				continue
			}
			l, err1 := parseProcAddr(fl[1])
			r, err2 := parseProcAddr(fl[2])
			if err1 == nil && err2 == nil {
				out[[2]netip.AddrPort{l, r}] = rank
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
