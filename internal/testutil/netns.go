package testutil

import (
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// NetnsDir is where `ip netns` keeps the namespaces it names (ip-netns(8)).
const NetnsDir = "/run/netns"

// Netns is a network namespace a test made or entered, held by an open fd
// until the test's cleanup.
type Netns struct {
	// Name is the namespace's name in NetnsDir, "" if it has none.
	Name string
	fd   int
}

// FD is an fd of the namespace, for setns(2) and for APIs that take one.
func (n *Netns) FD() int { return n.fd }

// NewNetns makes a network namespace with lo up, for tb alone: nothing
// names it, so it goes away after cleanup with the last socket in it.
func NewNetns(tb testing.TB) *Netns {
	tb.Helper()
	RequirePrivileged(tb)
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result)
	go func() {
		// unshare(2) moves only the calling thread. Never unlocked: the
		// thread ends with this goroutine, and its namespace with it,
		// instead of going back to the scheduler.
		runtime.LockOSThread()
		fd, err := func() (int, error) {
			if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
				return -1, fmt.Errorf("unshare network namespace: %w", err)
			}
			fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return -1, fmt.Errorf("open new network namespace: %w", err)
			}
			if err := loopbackUp(); err != nil {
				unix.Close(fd)
				return -1, err
			}
			return fd, nil
		}()
		ch <- result{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		tb.Fatal(r.err)
	}
	tb.Cleanup(func() { unix.Close(r.fd) })
	return &Netns{fd: r.fd}
}

// NewNamedNetns is NewNetns for code that takes namespaces by name (and
// `ip netns exec`): it is made by `ip netns add name` and deleted at
// cleanup.
func NewNamedNetns(tb testing.TB, name string) *Netns {
	tb.Helper()
	RequirePrivileged(tb)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		tb.Fatalf("ip netns add %s: %v: %s", name, err, strings.TrimSpace(string(out)))
	}
	tb.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	n := OpenNetns(tb, name)
	if err := n.Do(loopbackUp); err != nil {
		tb.Fatalf("netns %s: %v", name, err)
	}
	return n
}

// OpenNetns holds the existing namespace name of NetnsDir (a rig node's)
// until cleanup.
func OpenNetns(tb testing.TB, name string) *Netns {
	tb.Helper()
	RequirePrivileged(tb)
	fd, err := unix.Open(filepath.Join(NetnsDir, name), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		tb.Fatalf("network namespace %s: %v", name, err)
	}
	tb.Cleanup(func() { unix.Close(fd) })
	return &Netns{Name: name, fd: fd}
}

// Do runs fn on a locked OS thread inside the namespace and returns its
// error: the sockets fn makes live there, wherever they are used later.
// The thread goes back to its own namespace afterwards; if it cannot, it is
// never unlocked, so it ends with fn's goroutine instead of carrying the
// namespace on. fn runs on a goroutine of its own: it must return its
// failure rather than call t.Fatal.
func (n *Netns) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		back, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open own network namespace: %w", err)
			return
		}
		defer unix.Close(back)
		if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter network namespace %s: %w", n, err)
			return
		}
		ferr := fn()
		if err := unix.Setns(back, unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("back to own network namespace: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

func (n *Netns) String() string {
	if n.Name != "" {
		return n.Name
	}
	return fmt.Sprintf("fd %d", n.fd)
}

// loopbackUp sets lo up in the calling thread's network namespace.
func loopbackUp() error {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket for SIOCSIFFLAGS: %w", err)
	}
	defer unix.Close(s)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get flags of lo: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}
