// Package accept serves a listening socket through exhaustion: a local
// user who opens connections until mpid runs out of file descriptors (or
// the kernel of socket buffers) must not end the daemon, and must not take
// every connection from the other users. Every socket mpid serves (control,
// rank channel, peer port, metrics) accepts through a Listener.
//
// golang.org/x/net/netutil's LimitListener bounds the total only, and does
// so by not accepting: past its bound every client waits in the kernel's
// backlog, the victims behind the flood. Here a connection past a bound is
// accepted and closed at once, so the others go on being served.
package accept

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/mpipause/mpipause/internal/peercred"
)

// Options bound a Listener. The zero value bounds nothing and only backs
// off from accept errors.
type Options struct {
	// Key names who a connection counts against: its peer's uid on a unix
	// socket (UIDKey), its source address over TCP (AddrKey). An empty key
	// counts toward Total only. An error closes the connection (cause "no
	// peer identity").
	Key func(net.Conn) (string, error)
	// PerKey bounds the connections open at once of one key; Total, of all.
	// 0: no bound.
	PerKey, Total int
	// Busy, if set, is asked before each connection is served: an error
	// closes it (cause "busy"); mpid's heap near its memory limit, say.
	Busy func() error
	// Log hears every connection closed at accept and every accept error
	// backed off from: cause is a few words that stay the same for the same
	// cause (callers log a line per cause per interval); key and peer say
	// whose connection it was ("" and nil for accept errors).
	Log func(cause, key string, peer net.Addr, err error)
}

// Causes Log hears for connections closed past a bound.
const (
	CausePerKey = "too many connections of one peer"
	CauseTotal  = "too many connections in all"
	CauseBusy   = "busy"
	CauseNoKey  = "no peer identity"
)

// Back-off after an accept error: a descriptor freed by a closing
// connection is soon there, so the first retry is quick; an exhaustion
// that lasts is tried once a second, which costs nothing.
const (
	minBackoff = 5 * time.Millisecond
	maxBackoff = time.Second
)

// Listener is a net.Listener whose Accept returns only connections within
// its bounds and fails only once it is closed.
type Listener struct {
	ln net.Listener
	o  Options
	// sleep waits d or until done closes (false then); a test's seam.
	sleep func(d time.Duration, done <-chan struct{}) bool

	closeOnce sync.Once
	done      chan struct{}

	mu    sync.Mutex
	total int
	byKey map[string]int
}

// New serves ln within o.
func New(ln net.Listener, o Options) *Listener {
	return &Listener{ln: ln, o: o, sleep: sleep, done: make(chan struct{}), byKey: map[string]int{}}
}

func sleep(d time.Duration, done <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-done:
		return false
	}
}

// Next returns the next connection within the bounds and the function to
// call once it is closed (its slot is free again), or net.ErrClosed (as
// the wrapped listener says it) once the listener is closed.
func (l *Listener) Next() (net.Conn, func(), error) {
	backoff := time.Duration(0)
	for {
		c, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || l.closed() {
				return nil, nil, err
			}
			// Anything else is waited out: an exhausted process or kernel
			// (EMFILE, ENFILE, ENOBUFS, ENOMEM) recovers as connections
			// close, and a daemon that stops accepting for good is worse
			// than one that retries once a second.
			backoff = min(max(2*backoff, minBackoff), maxBackoff)
			if l.o.Log != nil {
				l.o.Log(AcceptCause(err), "", nil, err)
			}
			if !l.sleep(backoff, l.done) {
				return nil, nil, net.ErrClosed
			}
			continue
		}
		backoff = 0
		if done, ok := l.admit(c); ok {
			return c, done, nil
		}
	}
}

// admit counts c in, or closes it and says why.
func (l *Listener) admit(c net.Conn) (func(), bool) {
	key := ""
	refuse := func(cause string, err error) (func(), bool) {
		c.Close()
		if l.o.Log != nil {
			l.o.Log(cause, key, c.RemoteAddr(), err)
		}
		return nil, false
	}
	if l.o.Key != nil {
		k, err := l.o.Key(c)
		if err != nil {
			return refuse(CauseNoKey, err)
		}
		key = k
	}
	if l.o.Busy != nil {
		if err := l.o.Busy(); err != nil {
			return refuse(CauseBusy, err)
		}
	}
	l.mu.Lock()
	switch {
	case l.o.Total > 0 && l.total >= l.o.Total:
		l.mu.Unlock()
		return refuse(CauseTotal, errTotal{l.o.Total})
	case key != "" && l.o.PerKey > 0 && l.byKey[key] >= l.o.PerKey:
		l.mu.Unlock()
		return refuse(CausePerKey, errPerKey{key, l.o.PerKey})
	}
	l.total++
	if key != "" {
		l.byKey[key]++
	}
	l.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.total--
			if key != "" {
				if l.byKey[key]--; l.byKey[key] <= 0 {
					delete(l.byKey, key)
				}
			}
		})
	}, true
}

// Open is how many connections are open, in all and of key.
func (l *Listener) Open(key string) (total, ofKey int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total, l.byKey[key]
}

type errTotal struct{ max int }

func (e errTotal) Error() string {
	return fmt.Sprintf("the socket has %d connections open, the most it serves at once", e.max)
}

type errPerKey struct {
	key string
	max int
}

func (e errPerKey) Error() string {
	return fmt.Sprintf("%s has %d connections open, the most one peer may have", e.key, e.max)
}

// ServeUnix runs handle on each connection of a unix socket, each on a
// goroutine of its own, until the listener is closed: then it returns
// Next's error. A connection is closed, and its slot freed, when handle
// returns.
func (l *Listener) ServeUnix(handle func(*net.UnixConn)) error {
	for {
		c, done, err := l.Next()
		if err != nil {
			return err
		}
		go func() {
			defer done()
			defer c.Close()
			if uc, ok := c.(*net.UnixConn); ok {
				handle(uc)
			}
		}()
	}
}

// Accept is Next for net.Listener's users: the connection frees its slot
// when closed.
func (l *Listener) Accept() (net.Conn, error) {
	c, done, err := l.Next()
	if err != nil {
		return nil, err
	}
	return &conn{Conn: c, done: done}, nil
}

type conn struct {
	net.Conn
	done func()
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.done()
	return err
}

// Close closes the wrapped listener and ends a back-off under way.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.ln.Close()
}

func (l *Listener) closed() bool {
	select {
	case <-l.done:
		return true
	default:
		return false
	}
}

// Addr is the wrapped listener's.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// AcceptCause is the cause Log hears for an accept error: the errno's text
// where there is one (EMFILE: "accept: too many open files"), so that each
// kind of exhaustion has a line of its own.
func AcceptCause(err error) string {
	var en syscall.Errno
	if errors.As(err, &en) {
		return "accept: " + en.Error()
	}
	return "accept: " + err.Error()
}

// UIDKey keys a unix socket's connections by their peer's uid, as the
// kernel recorded it at connect (SO_PEERCRED). Root's too: its clients
// (the SPANK plugin, an administrator's CLI) ask one thing at a time.
func UIDKey(c net.Conn) (string, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return "", fmt.Errorf("not a unix socket: %T", c)
	}
	cred, err := peercred.Of(uc)
	if err != nil {
		return "", err
	}
	return "uid " + strconv.FormatUint(uint64(cred.Uid), 10), nil
}

// AddrKey keys TCP connections by their source address, without the port.
func AddrKey(c net.Conn) (string, error) {
	t, ok := c.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return c.RemoteAddr().String(), nil
	}
	return t.AddrPort().Addr().Unmap().String(), nil
}
