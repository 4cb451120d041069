package mpid

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/testutil"
)

// needRoot: a directory the test makes is root's only if the test runs as
// root (the unit tier does, without capabilities).
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv(testutil.PrivEnv) != "" {
		t.Fatal("needs uid 0")
	}
	t.Skip("needs uid 0: the socket's directory must be root's")
}

// TestSocketDirRefused: each directory another user could plant a socket
// in is refused with its own line, and nothing is bound there.
func TestSocketDirRefused(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	groupW := filepath.Join(base, "groupw")
	if err := os.Mkdir(groupW, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(groupW, 0o775); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(base, "link")
	if err := os.Symlink(groupW, link); err != nil {
		t.Fatal(err)
	}
	worldW := filepath.Join(base, "tmp")
	if err := os.Mkdir(worldW, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(worldW, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ dir, want string }{
		{groupW, groupW + " is writable by group or others (mode 0775)"},
		{worldW, worldW + " is writable by group or others (mode 1777)"},
		{link, link + " is a symbolic link"},
	} {
		ln, err := listenSocket(filepath.Join(tc.dir, "ctl.sock"))
		if err == nil {
			ln.Close()
			t.Errorf("%s: listened; want %q", tc.dir, tc.want)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %q; want one line with %q", tc.dir, err, tc.want)
		}
		if _, err := os.Lstat(filepath.Join(tc.dir, "ctl.sock")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: a socket was made in a refused directory (%v)", tc.dir, err)
		}
	}
}

// TestSocketDirOtherOwner: a directory of another uid is refused. Making
// one takes CAP_CHOWN, which the unit tier lacks, so the check itself is
// given the lstat of such a directory there; the privileged tier also
// chowns a real one.
func TestSocketDirOtherOwner(t *testing.T) {
	t.Run("lstat of uid 1001's directory", func(t *testing.T) {
		st := unix.Stat_t{Mode: unix.S_IFDIR | 0o755, Uid: 1001}
		want := "/run/x is owned by uid 1001, not root"
		if err := checkSocketDir("/run/x", &st); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("uid 1001's directory: %v; want %q", err, want)
		}
		st.Uid = 0
		if err := checkSocketDir("/run/x", &st); err != nil {
			t.Errorf("root's directory, mode 0755: %v", err)
		}
	})
	t.Run("chowned to uid 1001", func(t *testing.T) {
		testutil.RequirePrivileged(t)
		needRoot(t)
		dir := filepath.Join(t.TempDir(), "run")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(dir, 1001, 1001); err != nil {
			t.Fatal(err)
		}
		ln, err := listenSocket(filepath.Join(dir, "rank.sock"))
		if err == nil {
			ln.Close()
			t.Fatal("listened in uid 1001's directory")
		}
		if !strings.Contains(err.Error(), dir+" is owned by uid 1001, not root") {
			t.Errorf("uid 1001's directory: %v", err)
		}
	})
}

// TestListenSocket: a missing directory is made (root's, 0755), the
// socket is 0666, a socket file left by a dead server is replaced and one
// a live server holds is not.
func TestListenSocket(t *testing.T) {
	needRoot(t)
	dir := filepath.Join(t.TempDir(), "run", "mpipause")
	addr := filepath.Join(dir, "rank.sock")
	ln, err := listenSocket(addr)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(dir)
	if err != nil || fi.Mode().Perm() != 0o755 && fi.Mode().Perm() != 0o700 {
		t.Errorf("made directory: %v %v; want mode 0755 (or tighter by umask)", fi.Mode(), err)
	}
	if fi, err := os.Stat(addr); err != nil || fi.Mode().Perm() != 0o666 || fi.Mode()&os.ModeSocket == 0 {
		t.Errorf("socket: %v %v; want a socket, mode 0666", fi.Mode(), err)
	}
	if _, err := listenSocket(addr); !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("second listen while the first serves: %v; want EADDRINUSE", err)
	}
	// A killed server leaves its socket file behind.
	ln.SetUnlinkOnClose(false)
	ln.Close()
	if _, err := os.Lstat(addr); err != nil {
		t.Fatal(err)
	}
	ln, err = listenSocket(addr)
	if err != nil {
		t.Fatalf("over a dead server's socket: %v", err)
	}
	defer ln.Close()
	c, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatalf("the new socket does not answer: %v", err)
	}
	c.Close()
	if err := os.WriteFile(filepath.Join(dir, "ctl.sock"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := listenSocket(filepath.Join(dir, "ctl.sock")); err == nil || !strings.Contains(err.Error(), "is not a socket") {
		t.Errorf("over a plain file: %v; want it left alone", err)
	}
}
