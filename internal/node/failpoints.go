//go:build failpoints

package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// failpointHold bounds a hold whose file nobody removes.
const failpointHold = time.Minute

// failpoints is the hook of FailpointsEnv, in test builds only. mpid runs
// as root and the directory comes from its environment: every file is
// opened relative to a directory mpid's own user owns and nobody else may
// write, and never through a symbolic link, and the one file it writes is
// created new (never an existing one overwritten), so the hook cannot be
// turned into a write anywhere else.
type failpoints struct {
	dir string
	log *slog.Logger
}

// hookFor is node's hook: <FailpointsEnv>/<node>, if the variable is set.
func hookFor(node string, log *slog.Logger) failpoints {
	root := os.Getenv(FailpointsEnv)
	if root == "" {
		return failpoints{}
	}
	return failpoints{dir: filepath.Join(root, node), log: log}
}

// openFailpointDir opens dir (and, first, its parent: the directory the
// environment names) refusing a symbolic link, a directory that mpid's
// user does not own, or one that others may write.
func openFailpointDir(dir string) (int, error) {
	fd := unix.AT_FDCWD
	for i, p := range []string{filepath.Dir(dir), filepath.Base(dir)} {
		nfd, err := unix.Openat(fd, p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if i > 0 {
			unix.Close(fd)
		}
		if err != nil {
			return -1, err
		}
		fd = nfd
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return -1, err
		}
		if int(st.Uid) != os.Geteuid() || st.Mode&0o002 != 0 {
			unix.Close(fd)
			return -1, fmt.Errorf("failpoint directory %s: owned by uid %d, mode %o: want owned by uid %d and not writable by others",
				p, st.Uid, st.Mode&0o7777, os.Geteuid())
		}
	}
	return fd, nil
}

func (f failpoints) hold(ctx context.Context, step, where, job string) {
	if f.dir == "" {
		return
	}
	dfd, err := openFailpointDir(f.dir)
	if err != nil {
		if !errors.Is(err, unix.ENOENT) {
			f.log.Error("failpoint", "error", err)
		}
		return
	}
	defer unix.Close(dfd)
	if !f.armed(dfd, step, where) {
		return
	}
	fd, err := unix.Openat(dfd, step+".reached", unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err == nil {
		_, err = unix.Write(fd, []byte(job))
		unix.Close(fd)
	}
	if err != nil {
		f.log.Error("failpoint", "step", step, "error", err)
		return
	}
	f.log.Warn("failpoint reached; holding", "step", step, "where", where, "job", job)
	end := time.Now().Add(failpointHold)
	for time.Now().Before(end) && ctx.Err() == nil {
		var st unix.Stat_t
		if err := unix.Fstatat(dfd, step, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// armed reports whether the regular file step in dfd says where.
func (f failpoints) armed(dfd int, step, where string) bool {
	fd, err := unix.Openat(dfd, step, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return false
	}
	b := make([]byte, 16)
	n, err := unix.Read(fd, b)
	return err == nil && string(bytes.TrimSpace(b[:max(n, 0)])) == where
}
