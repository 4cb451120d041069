package sdnotify

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// listen makes a unixgram socket at addr: the service manager's side.
func listen(t *testing.T, addr string) *net.UnixConn {
	t.Helper()
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func receive(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 4096)
	n, err := c.Read(b)
	if err != nil {
		t.Fatalf("no notification: %v", err)
	}
	return string(b[:n])
}

func TestNotifyPath(t *testing.T) {
	addr := filepath.Join(t.TempDir(), "notify")
	c := listen(t, addr)
	t.Setenv(SocketEnv, addr)
	sent, err := Notify("READY=1", "STATUS=serving")
	if err != nil || !sent {
		t.Fatalf("Notify: sent %v, %v", sent, err)
	}
	if got, want := receive(t, c), "READY=1\nSTATUS=serving\n"; got != want {
		t.Errorf("datagram %q, want %q", got, want)
	}
}

func TestNotifyAbstract(t *testing.T) {
	addr := fmt.Sprintf("@mpipause-sdnotify-test-%d", os.Getpid())
	c := listen(t, addr)
	sent, err := NotifyTo(addr, "STOPPING=1")
	if err != nil || !sent {
		t.Fatalf("NotifyTo: sent %v, %v", sent, err)
	}
	if got := receive(t, c); got != "STOPPING=1\n" {
		t.Errorf("datagram %q, want STOPPING=1", got)
	}
}

func TestNotifyUnset(t *testing.T) {
	t.Setenv(SocketEnv, "")
	if sent, err := Notify("READY=1"); sent || err != nil {
		t.Errorf("without %s: sent %v, %v; want nothing done", SocketEnv, sent, err)
	}
}

func TestNotifyErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, addr, state, want string
	}{
		{"relative path", "notify", "READY=1", "absolute path"},
		{"no listener", filepath.Join(dir, "none"), "READY=1", "no such file"},
		{"not a VAR=value", filepath.Join(dir, "none"), "READY", "VAR=value"},
		{"two lines in one", filepath.Join(dir, "none"), "READY=1\nX=2", "VAR=value"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sent, err := NotifyTo(tc.addr, tc.state)
			if sent || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("NotifyTo(%q, %q): sent %v, error %v; want an error containing %q", tc.addr, tc.state, sent, err, tc.want)
			}
		})
	}
}
