package peercred

import (
	"net"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestOf: both ends of a socket pair made here are this process.
func TestOf(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		f := os.NewFile(uintptr(fd), "pair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		cred, err := Of(c.(*net.UnixConn))
		if err != nil {
			t.Fatal(err)
		}
		if int(cred.Pid) != os.Getpid() || int(cred.Uid) != os.Geteuid() || int(cred.Gid) != os.Getegid() {
			t.Errorf("peer %+v, want pid %d uid %d gid %d", *cred, os.Getpid(), os.Geteuid(), os.Getegid())
		}
	}
}
