package testutil

import (
	"net"
	"os"
	"sync"
	"syscall"
)

// FlakyListener is a listener that fails its next Accepts with the errors
// queued by Fail, as the kernel does when the process or the system is out
// of descriptors or buffers (EMFILE, ENFILE, ENOBUFS, ENOMEM), then accepts
// on the listener it wraps: exhaustion on demand, without exhausting the
// test process.
type FlakyListener struct {
	net.Listener

	mu     sync.Mutex
	errs   []syscall.Errno
	failed int
}

// NewFlakyListener wraps ln; its first Accepts fail with errs.
func NewFlakyListener(ln net.Listener, errs ...syscall.Errno) *FlakyListener {
	return &FlakyListener{Listener: ln, errs: errs}
}

// Fail queues errs for the next Accepts.
func (l *FlakyListener) Fail(errs ...syscall.Errno) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, errs...)
}

// Failed is how many Accepts failed so far.
func (l *FlakyListener) Failed() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.failed
}

// Accept fails with the next queued error, as net's listeners report it
// (an *net.OpError around the system call's), or accepts a connection.
func (l *FlakyListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	if len(l.errs) > 0 {
		e := l.errs[0]
		l.errs = l.errs[1:]
		l.failed++
		l.mu.Unlock()
		return nil, &net.OpError{Op: "accept", Net: l.Addr().Network(), Addr: l.Addr(), Err: os.NewSyscallError("accept4", e)}
	}
	l.mu.Unlock()
	return l.Listener.Accept()
}
