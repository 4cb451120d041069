package testutil

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// netnsIno is the inode of the calling thread's network namespace.
func netnsIno() (uint64, error) {
	var st unix.Stat_t
	err := unix.Stat("/proc/thread-self/ns/net", &st)
	return st.Ino, err
}

func TestNetnsDo(t *testing.T) {
	var own uint64
	t.Run("fresh", func(t *testing.T) {
		ns := NewNetns(t)
		var err error
		if own, err = netnsIno(); err != nil {
			t.Fatal(err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(ns.FD(), &st); err != nil {
			t.Fatal(err)
		}
		var inside uint64
		var ln net.Listener
		if err := ns.Do(func() (err error) {
			if inside, err = netnsIno(); err != nil {
				return err
			}
			// lo is up: a listener there takes a connection.
			if ln, err = net.Listen("tcp4", "127.0.0.1:0"); err != nil {
				return err
			}
			c, err := net.Dial("tcp4", ln.Addr().String())
			if err == nil {
				c.Close()
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		if inside != st.Ino || inside == own {
			t.Fatalf("Do ran in namespace %d; the fresh one is %d, the test's %d", inside, st.Ino, own)
		}
	})
	t.Run("error and restore", func(t *testing.T) {
		ns := NewNetns(t)
		boom := errors.New("boom")
		for range 2 * 64 { // more calls than threads the runtime keeps idle
			var in uint64
			if err := ns.Do(func() (err error) { in, err = netnsIno(); return errors.Join(err, boom) }); !errors.Is(err, boom) {
				t.Fatalf("Do returned %v, want fn's error", err)
			}
			if in == own {
				t.Fatal("fn ran in the test's own namespace")
			}
		}
		// Threads went back to the own namespace: every goroutine of the
		// test is still in it.
		done := make(chan error, 64)
		for range 64 {
			go func() {
				in, err := netnsIno()
				if err == nil && in != own {
					err = fmt.Errorf("a goroutine runs in namespace %d, not the test's %d", in, own)
				}
				done <- err
			}()
		}
		for range 64 {
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
	})
}

func TestNamedNetns(t *testing.T) {
	name := fmt.Sprintf("mpt-kit-%d", os.Getpid())
	t.Run("made", func(t *testing.T) {
		ns := NewNamedNetns(t, name)
		if ns.Name != name {
			t.Fatalf("Name %q, want %q", ns.Name, name)
		}
		if _, err := os.Stat(filepath.Join(NetnsDir, name)); err != nil {
			t.Fatal(err)
		}
		again := OpenNetns(t, name)
		var a, b unix.Stat_t
		if err := errors.Join(unix.Fstat(ns.FD(), &a), unix.Fstat(again.FD(), &b)); err != nil {
			t.Fatal(err)
		}
		if a.Ino != b.Ino {
			t.Fatalf("OpenNetns(%s) is namespace %d, NewNamedNetns made %d", name, b.Ino, a.Ino)
		}
		if err := ns.Do(func() error {
			ln, err := net.Listen("tcp4", "127.0.0.1:0")
			if err == nil {
				ln.Close()
			}
			return err
		}); err != nil {
			t.Fatalf("lo in %s: %v", name, err)
		}
	})
	if _, err := os.Stat(filepath.Join(NetnsDir, name)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s after cleanup: %v, want it deleted", name, err)
	}
}

func TestNewCgroup(t *testing.T) {
	var dir string
	var left *exec.Cmd
	t.Run("made", func(t *testing.T) {
		dir = NewCgroup(t)
		if _, err := os.Stat(filepath.Join(dir, "cgroup.procs")); err != nil {
			t.Fatalf("%s is not a cgroup: %v", dir, err)
		}
		if filepath.Base(filepath.Dir(dir)) != CgroupParent {
			t.Fatalf("%s is not under %s", dir, CgroupParent)
		}
		// A process the test leaves in it: cleanup kills it.
		f, err := os.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		left = exec.Command("sleep", "1000")
		left.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd())}
		if err := left.Start(); err != nil {
			t.Fatal(err)
		}
	})
	if left == nil {
		return
	}
	// Killed by then, so Wait returns at once; the bound is for a failure.
	done := make(chan error, 1)
	go func() { done <- left.Wait() }()
	select {
	case err := <-done:
		if err == nil || left.ProcessState.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Errorf("process left in the cgroup: %v, want killed", err)
		}
	case <-time.After(10 * time.Second):
		left.Process.Kill()
		<-done
		t.Error("process left in the cgroup still runs after cleanup")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s after cleanup: %v, want it removed", dir, err)
	}
}
