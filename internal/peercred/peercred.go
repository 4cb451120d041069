// Package peercred reads what the kernel says of the process at the other
// end of a unix socket (SO_PEERCRED): who is asking, whatever the request
// claims. mpid's two local sockets (ranks, ctl) and the CLI, which checks
// who serves the control socket, all trust this and nothing else.
package peercred

import (
	"net"

	"golang.org/x/sys/unix"
)

// Of returns the credentials of c's peer as the kernel recorded them at
// connect (or socketpair).
func Of(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return nil, err
	}
	return cred, cerr
}
