// Package mountinfo reads /proc/PID/mountinfo (proc_pid_mountinfo(5)): how
// cgroupv2 finds the cgroup v2 hierarchy, loader a bpffs to pin in, and the
// test rig what a node must mount again.
package mountinfo

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strings"
)

// Self is the calling process's mount table.
const Self = "/proc/self/mountinfo"

// Mount is one line of a mountinfo listing, its paths unescaped.
type Mount struct {
	Root      string // the directory of the filesystem mounted here: "/" unless a bind mount of a sub-tree
	Point     string
	FSType    string
	Source    string
	SuperOpts string
}

// Read parses the mountinfo listing at path (Self for this process's).
func Read(path string) ([]Mount, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	return Parse(f)
}

// Parse parses a mountinfo listing, in its order. Lines that do not have
// the format's fields are left out.
func Parse(r io.Reader) ([]Mount, error) {
	var out []Mount
	sc := bufio.NewScanner(r)
	// A line holds two paths and two option lists: past the default 64 KiB
	// only with extraordinary paths, which should not end the reading.
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		if m, ok := parseLine(sc.Text()); ok {
			out = append(out, m)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	return out, nil
}

// parseLine parses
// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS.
func parseLine(line string) (Mount, bool) {
	pre, post, ok := strings.Cut(line, " - ")
	if !ok {
		return Mount{}, false
	}
	pf, sf := strings.Fields(pre), strings.Fields(post)
	if len(pf) < 5 || len(sf) < 1 {
		return Mount{}, false
	}
	m := Mount{Root: unescape(pf[3]), Point: unescape(pf[4]), FSType: sf[0]}
	if len(sf) >= 2 {
		m.Source = unescape(sf[1])
	}
	if len(sf) >= 3 {
		m.SuperOpts = sf[2]
	}
	return m, true
}

// unescape undoes the kernel's \NNN octal escapes of space, tab, newline
// and backslash; anything else is kept as written.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && s[i+1] <= '3' && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }
