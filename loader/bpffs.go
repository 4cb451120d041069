package loader

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Where bpffs is looked for and, if absent, mounted; variables for tests.
var (
	mountinfoPath = "/proc/self/mountinfo"
	defaultBPFFS  = "/sys/fs/bpf"
)

// pinRoot is the directory under a bpffs that holds mpipause's pins.
const pinRoot = "mpipause"

// findBPFFS returns a bpffs mount point to pin in: dir if given (it must be
// a bpffs), else /sys/fs/bpf if it is one, else the first bpf mount in
// mountinfo, else a bpffs it mounts at /sys/fs/bpf when mount is true.
// `ip netns exec` remounts /sys, so in a rig node /sys/fs/bpf is empty while
// another bpf mount may still be there. /sys/fs/bpf comes first because a
// rig node's mountinfo also lists the other rigs' bpffs mounts, which are
// theirs (and may be hidden under the node's own /run/mpipause).
func findBPFFS(dir string, mount bool) (string, error) {
	if dir != "" {
		if err := isBPFFS(dir); err != nil {
			return "", fmt.Errorf("%w: Config.BPFFS %s: %v; mount one with: mount -t bpf bpf %s", ErrNoBPFFS, dir, err, dir)
		}
		return dir, nil
	}
	if isBPFFS(defaultBPFFS) == nil {
		return defaultBPFFS, nil
	}
	f, err := os.Open(mountinfoPath)
	if err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	found, err := bpffsFrom(f)
	if err != nil {
		return "", err
	}
	if found != "" {
		return found, nil
	}
	if !mount {
		return "", nil
	}
	if err := unix.Mount("bpf", defaultBPFFS, "bpf", 0, "mode=0700"); err != nil {
		return "", fmt.Errorf("%w: none mounted and mount -t bpf bpf %s: %v; mount a bpffs (any path) or run without pinning", ErrNoBPFFS, defaultBPFFS, err)
	}
	return defaultBPFFS, nil
}

// bpffsFrom returns the mount point of the first bpf filesystem in a
// mountinfo(5) listing, or "" if there is none.
func bpffsFrom(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		pf, sf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(sf) < 1 || sf[0] != "bpf" {
			continue
		}
		return unescapeMount(pf[4]), nil
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	return "", nil
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isBPFFS(dir string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return err
	}
	if uint32(st.Type) != unix.BPF_FS_MAGIC {
		return errors.New("not a bpffs")
	}
	return nil
}
