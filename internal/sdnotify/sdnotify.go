// Package sdnotify tells a service manager (systemd's Type=notify) how a
// daemon is doing: READY=1 once it serves, STOPPING=1 when it shuts down,
// STATUS= for `systemctl status`. The protocol is one unix datagram of
// newline-separated VAR=value lines to the socket named by $NOTIFY_SOCKET
// (sd_notify(3)); a few lines, so no library.
package sdnotify

import (
	"fmt"
	"net"
	"os"
	"strings"
)

// SocketEnv names the service manager's notification socket: a path, or
// "@name" for an abstract socket.
const SocketEnv = "NOTIFY_SOCKET"

// Notify sends state lines such as "READY=1" to $NOTIFY_SOCKET. It reports
// false, and no error, when the variable is not set: the daemon was not
// started by a manager that listens.
func Notify(state ...string) (bool, error) {
	return NotifyTo(os.Getenv(SocketEnv), state...)
}

// NotifyTo is Notify to the socket addr ("" does nothing).
func NotifyTo(addr string, state ...string) (bool, error) {
	if addr == "" {
		return false, nil
	}
	if !strings.HasPrefix(addr, "@") && !strings.HasPrefix(addr, "/") {
		return false, fmt.Errorf("%s=%q: want an absolute path or @name", SocketEnv, addr)
	}
	for _, s := range state {
		if !strings.Contains(s, "=") || strings.Contains(s, "\n") {
			return false, fmt.Errorf("notify %q: want one VAR=value line", s)
		}
	}
	// Go's net package takes a leading '@' as the abstract namespace, as
	// sd_notify does.
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		return false, fmt.Errorf("notify %s: %w", addr, err)
	}
	defer c.Close()
	// One datagram: the manager reads each message whole.
	if _, err := c.Write([]byte(strings.Join(state, "\n") + "\n")); err != nil {
		return false, fmt.Errorf("notify %s: %w", addr, err)
	}
	return true, nil
}
