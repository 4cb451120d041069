package loader

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/mountinfo"
)

// Where bpffs is looked for and, if absent, mounted; variables for tests.
var (
	mountinfoPath = mountinfo.Self
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

// BPFFS is the bpffs mpid would pin a job's state in, as a job's observer
// finds it, without mounting one: "" when none is mounted (the observer
// then mounts one at /sys/fs/bpf).
func BPFFS() (string, error) { return findBPFFS("", false) }

// bpffsFrom returns the mount point of the first bpf filesystem in a
// mountinfo(5) listing, or "" if there is none.
func bpffsFrom(r io.Reader) (string, error) {
	ms, err := mountinfo.Parse(r)
	if err != nil {
		return "", err
	}
	for _, m := range ms {
		if m.FSType == "bpf" {
			return m.Point, nil
		}
	}
	return "", nil
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
