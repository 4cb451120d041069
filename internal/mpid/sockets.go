package mpid

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// listenSocket opens mpid's unix socket at addr: "@name" is an abstract
// socket, which any local user may bind first (for tests only); any other
// address is a path whose directory (made 0755 if missing) must be root's
// and writable by no one else, so that no user can put a socket of their
// own there while mpid is down. A socket file left by a dead mpid is
// replaced; one a live process still serves is not. The socket is 0666:
// anyone may ask, mpid decides per request from the peer's SO_PEERCRED.
func listenSocket(addr string) (*net.UnixListener, error) {
	if strings.HasPrefix(addr, "@") {
		return net.ListenUnix("unix", &net.UnixAddr{Name: addr, Net: "unix"})
	}
	if !filepath.IsAbs(addr) {
		return nil, fmt.Errorf("%s is neither an absolute path nor @name (abstract)", addr)
	}
	dir := filepath.Dir(addr)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	if err := checkSocketDir(dir, &st); err != nil {
		return nil, err
	}
	if err := removeStale(addr); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: addr, Net: "unix"})
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(addr, 0o666); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// CheckSocketDir says whether listenSocket would accept dir as the
// directory of a socket: nil if it would (an absent one it makes), else
// what is wrong and what to do. It changes nothing (mpid check).
func CheckSocketDir(dir string) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); errors.Is(err, unix.ENOENT) {
		return nil
	} else if err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	return checkSocketDir(dir, &st)
}

// checkSocketDir refuses a socket directory (st, from lstat) that someone
// other than root could use to plant a socket in mpid's place: a symbolic
// link, a directory another user owns, or one group or others may write.
func checkSocketDir(dir string, st *unix.Stat_t) error {
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		return fmt.Errorf("%s is a symbolic link: make it a directory owned by root, mode 0755 (or remove it and let mpid make it)", dir)
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%s is not a directory: remove it and let mpid make it", dir)
	case st.Uid != 0:
		return fmt.Errorf("%s is owned by uid %d, not root, who could put a socket of their own there: chown root %s (or remove it and let mpid make it)", dir, st.Uid, dir)
	case st.Mode&0o022 != 0:
		return fmt.Errorf("%s is writable by group or others (mode %04o), who could put a socket of their own there: chmod go-w %s", dir, st.Mode&0o7777, dir)
	}
	return nil
}

// removeStale removes the socket file at path if nothing serves it; a live
// server keeps it and is an error, as the bind of a taken address is.
func removeStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("%s exists and is not a socket: remove it", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return fmt.Errorf("%s is served by a running process: %w", path, syscall.EADDRINUSE)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("%s: cannot tell whether a process serves it: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
