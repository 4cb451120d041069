package rig

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// One user at a time. Two processes on one rig break each other without a
// word: the second's `up` restarts mpids under the first's jobs, and its
// `down` removes the nodes they run in. So a process that uses a rig for
// a while (a test binary) holds it (Hold) and the rig commands of anyone
// else (up, down) fail at once with one line naming the holder. The lock
// is a flock on StateRoot/NAME.user held by an open file, which the kernel
// drops however the holder ends: nothing is left to clear after a kill.

// HolderEnv tells the processes a rig's holder starts (its own `rig up`
// and `rig down`) the pid they act for.
const HolderEnv = "MPIPAUSE_RIG_HOLDER"

var (
	heldMu sync.Mutex
	// held keeps each held rig's file open (and out of the garbage
	// collector's finalizer, which would close it) for the process's life.
	held = map[string]*os.File{}
)

func (r *Rig) userFile() string { return filepath.Join(r.cfg.StateRoot, r.cfg.Name+".user") }

// ErrInUse says another process holds the rig.
var ErrInUse = errors.New("in use")

// Hold makes this process the rig's one user until it exits; a process
// that acts for the holder (HolderEnv) needs no hold of its own. Another
// holder makes it fail with ErrInUse, naming that process.
func (r *Rig) Hold() error {
	heldMu.Lock()
	defer heldMu.Unlock()
	if held[r.userFile()] != nil {
		return nil
	}
	if err := os.MkdirAll(r.cfg.StateRoot, 0o755); err != nil {
		return fmt.Errorf("hold rig %s: %w", r.cfg.Name, err)
	}
	f, err := os.OpenFile(r.userFile(), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("hold rig %s: %w", r.cfg.Name, err)
	}
	// A rig command's look (CheckUser) holds the lock shared for a moment:
	// a few tries tell it from a holder.
	for try := 0; ; try++ {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil || !errors.Is(err, unix.EWOULDBLOCK) || try == 20 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			if pid, _ := holder(f); pid == os.Getenv(HolderEnv) && pid != "" {
				return nil
			}
			return r.inUse(f)
		}
		return fmt.Errorf("hold rig %s: %w", r.cfg.Name, err)
	}
	cmdline, _ := os.ReadFile("/proc/self/cmdline")
	what := strings.TrimSpace(strings.ReplaceAll(string(cmdline), "\x00", " "))
	if err := f.Truncate(0); err == nil {
		_, err = f.WriteAt([]byte(fmt.Sprintf("%d %s\n", os.Getpid(), what)), 0)
	}
	if err != nil {
		f.Close()
		return fmt.Errorf("hold rig %s: %w", r.cfg.Name, err)
	}
	held[r.userFile()] = f
	os.Setenv(HolderEnv, strconv.Itoa(os.Getpid()))
	return nil
}

// CheckUser fails with ErrInUse when a process other than the one this
// process acts for (HolderEnv) holds the rig.
func (r *Rig) CheckUser() error {
	heldMu.Lock()
	mine := held[r.userFile()] != nil
	heldMu.Unlock()
	if mine {
		return nil
	}
	f, err := os.Open(r.userFile())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("rig %s: %w", r.cfg.Name, err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err == nil {
		return nil // nobody holds it; closing the file lets go
	} else if !errors.Is(err, unix.EWOULDBLOCK) {
		return fmt.Errorf("rig %s: %w", r.cfg.Name, err)
	}
	if pid, _ := holder(f); pid != "" && pid == os.Getenv(HolderEnv) {
		return nil
	}
	return r.inUse(f)
}

// holder reads the holder's pid and command line from the rig's user file.
func holder(f *os.File) (pid, what string) {
	b := make([]byte, 512)
	n, _ := f.ReadAt(b, 0)
	line, _, _ := strings.Cut(string(b[:n]), "\n")
	pid, what, _ = strings.Cut(line, " ")
	return pid, what
}

func (r *Rig) inUse(f *os.File) error {
	pid, what := holder(f)
	if pid == "" {
		pid = "?"
	}
	if len(what) > 120 {
		what = what[:117] + "..."
	}
	return fmt.Errorf("rig %s is %w by pid %s (%s): two processes on one rig restart and remove each other's mpids and nodes; wait for it to end, or use another rig (--name, $%s; the tests' $MPIPAUSE_TEST_RIG)",
		r.cfg.Name, ErrInUse, pid, what, NameEnv)
}
