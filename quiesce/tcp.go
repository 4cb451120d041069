package quiesce

import (
	"bufio"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"
)

// Wire format of the TCP transport: with an Identity, a TLS 1.3 session
// (tls.go) carries everything below. Every frame is a 4-byte big-endian
// length followed by that many bytes. A connection opens with one hello
// frame each way, in JSON, so that two daemons of different versions refuse
// each other before any step is misread; then the client sends requests and
// reads one reply per request, in order, each frame in the binary encoding
// of wire.go.

// TCPTransport is a Transport over TCP. A node name is dialled as a TCP
// address unless Resolve maps it.
//
// Connections are kept for reuse, a few per peer: opening one costs a TCP
// and, with an Identity, a TLS handshake and two hellos, which is most of
// what a small request costs (measured with 4,096 simulated nodes: 3.8 s a
// pause with a connection per call, before TLS). A connection goes back to
// the pool only after a request and its reply both went through whole and
// in time; any error, timeout or cancellation closes it, so a reply that
// arrives late can never be read as the answer to a later request.
type TCPTransport struct {
	// Resolve maps a node name to a "host:port" address; nil dials the name.
	Resolve func(name string) (string, error)
	// Dialer is used for connections; the zero value is fine.
	Dialer net.Dialer
	// Identity, if set, runs every connection over TLS (tls.go): the
	// server must prove it is the node dialled, under the cluster's key,
	// and this node proves it is one of the cluster. nil speaks the
	// unauthenticated protocol in the clear, for tests.
	Identity *Identity
	// MaxIdle bounds the idle connections kept per peer; 0 means
	// DefaultMaxIdle, a negative value keeps none (a connection per call).
	MaxIdle int
	// IdleTimeout closes a connection left idle that long; 0 means
	// DefaultIdleTimeout. It is shorter than a server's, so that a pooled
	// connection is seldom one the server has already closed.
	IdleTimeout time.Duration
	// OnDial, if set, hears every connection opened and authenticated (a
	// TCP and, with an Identity, a TLS handshake paid).
	OnDial func(to string)

	mu    sync.Mutex
	idle  map[peerAddr][]*tcpConn // most recently used last
	local localSlot               // ServeLocal's
}

// peerAddr keys the pool by the node a connection was opened to as well as
// its address: the handshake proved that node's name, and only for it. Two
// names that resolve to one address (a redirected name: DNS, /etc/hosts)
// must not share a connection, or the second would be answered by the
// first's node without its name ever being checked (TestAnotherNodeAnswers).
type peerAddr struct{ node, addr string }

// DefaultMaxIdle suits the tree: a node calls each child once a round, and
// a few jobs may pause at once.
const DefaultMaxIdle = 4

// DefaultIdleTimeout keeps a connection across the rounds of a pause and a
// resume soon after it, not across hours of a job running.
const DefaultIdleTimeout = 30 * time.Second

// DefaultServerIdle is how long a server keeps a connection with no request
// on it.
const DefaultServerIdle = 2 * time.Minute

type tcpConn struct {
	conn     net.Conn // the TCP connection: closed or given deadlines directly, so that no TLS alert waits
	fr       framer   // over the TLS session on conn, or conn itself
	since    time.Time
	deadline time.Time // the connection's, zero for none
}

// get returns a pooled connection to node to at addr that has not idled
// too long.
func (t *TCPTransport) get(to, addr string) *tcpConn {
	k := peerAddr{to, addr}
	if t.MaxIdle < 0 {
		return nil
	}
	timeout := cmp.Or(t.IdleTimeout, DefaultIdleTimeout)
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.idle[k]
	for len(l) > 0 {
		c := l[len(l)-1]
		l = l[:len(l)-1]
		if time.Since(c.since) < timeout {
			t.idle[k] = l
			return c
		}
		c.conn.Close()
	}
	delete(t.idle, k)
	return nil
}

// put keeps c for the next call to node to at addr, or closes it if the
// pool is full.
func (t *TCPTransport) put(to, addr string, c *tcpConn) {
	k := peerAddr{to, addr}
	limit := cmp.Or(t.MaxIdle, DefaultMaxIdle)
	if limit < 0 {
		c.conn.Close()
		return
	}
	c.since = time.Now()
	t.mu.Lock()
	if t.idle == nil {
		t.idle = map[peerAddr][]*tcpConn{}
	}
	l := t.idle[k]
	if len(l) >= limit {
		t.mu.Unlock()
		c.conn.Close()
		return
	}
	t.idle[k] = append(l, c)
	t.mu.Unlock()
}

// CloseIdle closes every pooled connection; calls in progress keep theirs.
func (t *TCPTransport) CloseIdle() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	t.mu.Unlock()
	for _, l := range idle {
		for _, c := range l {
			c.conn.Close()
		}
	}
}

// Call implements Transport.
func (t *TCPTransport) Call(ctx context.Context, to string, req Message) (Message, error) {
	if l := t.localTo(to); l != nil {
		return l.call(ctx, &req)
	}
	addr := to
	if t.Resolve != nil {
		var err error
		if addr, err = t.Resolve(to); err != nil {
			return Message{}, fmt.Errorf("resolve %s: %w", to, err)
		}
	}
	var rep Message
	if c := t.get(to, addr); c != nil {
		err, sent := t.roundTrip(ctx, addr, to, c, &req, &rep)
		// A pooled connection the server closed meanwhile (its idle
		// timeout, a restart) fails before any byte of a reply: ask again
		// on a new one. The request may have been served; a repeat is what
		// a retransmission is, and receivers coalesce those.
		if err == nil || sent || ctx.Err() != nil {
			return rep, err
		}
	}
	c, err := t.dial(ctx, to, addr)
	if err != nil {
		return Message{}, err
	}
	err, _ = t.roundTrip(ctx, addr, to, c, &req, &rep)
	return rep, err
}

// dial opens and authenticates a connection to node to at addr.
func (t *TCPTransport) dial(ctx context.Context, to, addr string) (c *tcpConn, err error) {
	conn, err := t.Dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, dialError(to, err)
	}
	defer func() {
		if err != nil {
			conn.Close()
		}
	}()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	dl, _ := ctx.Deadline()
	if !dl.IsZero() {
		_ = conn.SetDeadline(dl)
	}
	var rw net.Conn = conn
	if t.Identity != nil {
		tc := tls.Client(conn, t.Identity.clientConfig(to, addr))
		if err := tc.HandshakeContext(ctx); err != nil {
			if permanent(err) {
				return nil, err
			}
			return nil, t.fail(ctx, to, fmt.Errorf("TLS handshake: %w", err))
		}
		rw = tc
	}
	br := bufio.NewReader(rw)
	if err := writeFrame(rw, Hello{Magic: HelloMagic, Version: ProtocolVersion, Node: to}); err != nil {
		return nil, t.fail(ctx, to, err)
	}
	var h Hello
	if err := readFrame(br, &h); err != nil {
		return nil, t.fail(ctx, to, refusedByPeer(to, err))
	}
	if h.Err != "" && h.Magic == HelloMagic && h.Version == ProtocolVersion {
		// A peer of our version refused: it is another node.
		return nil, permanentError{fmt.Errorf("%w: %s refused the connection: %s", ErrWrongNode, to, h.Err)}
	}
	if h.Magic != HelloMagic || h.Version != ProtocolVersion || h.Err != "" {
		return nil, permanentError{fmt.Errorf("%s: %w: hello magic %q version %d: %s", to, ErrVersion, h.Magic, h.Version, h.Err)}
	}
	if t.OnDial != nil {
		t.OnDial(to)
	}
	return &tcpConn{conn: conn, fr: framer{w: rw, r: br}, deadline: dl}, nil
}

// dialError says what to do about a name that does not resolve: with a
// node's own name (mpid --node, the host name) the coordinator cannot even
// reach its own node.
func dialError(to string, err error) error {
	var dns *net.DNSError
	if errors.As(err, &dns) && dns.IsNotFound {
		return permanentError{fmt.Errorf("dial %s: %w (every node's name must resolve on every node: /etc/hosts or DNS)", to, err)}
	}
	return fmt.Errorf("dial %s: %w", to, err)
}

// roundTrip sends req on c and reads its reply into rep. It returns c to
// the pool after a whole exchange and closes it otherwise. sent reports
// whether any byte of a reply came. The messages go by pointer: this runs
// on the goroutine of a tree edge, and copies of them in its frames made
// that goroutine grow its stack on every call.
func (t *TCPTransport) roundTrip(ctx context.Context, addr, to string, c *tcpConn, req, rep *Message) (err error, sent bool) {
	// Closing the connection is the only way to interrupt a blocked read
	// when ctx is cancelled rather than timed out.
	stop := context.AfterFunc(ctx, func() { c.conn.Close() })
	var timeout int64
	dl, ok := ctx.Deadline()
	if ok {
		timeout = max(int64(time.Until(dl)), 1)
	}
	// A pooled connection keeps the deadline of its last call, which is
	// harmless while it is idle: set it only when it changes.
	if !dl.Equal(c.deadline) {
		_ = c.conn.SetDeadline(dl)
		c.deadline = dl
	}
	if err = c.fr.sendMsg(timeout, req); err == nil {
		var ignored int64
		sent, err = c.fr.recvMsg(&ignored, rep)
	}
	if !stop() || err != nil {
		// ctx ended: the connection is closed or closing, whatever came.
		c.conn.Close()
		if err == nil {
			return nil, true
		}
		*rep = Message{}
		return t.fail(ctx, to, err), sent
	}
	t.put(to, addr, c)
	return nil, true
}

// fail prefers ctx's error, since a read interrupted by cancellation reports
// a closed connection, which would hide why. The connection's deadline is
// ctx's, and the poller can pass it a moment before ctx's own timer fires:
// a caller then still learns that its deadline, not the peer, ended the call.
func (t *TCPTransport) fail(ctx context.Context, to string, err error) error {
	cause := ctx.Err()
	if cause == nil && errors.Is(err, os.ErrDeadlineExceeded) {
		if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
			cause = context.DeadlineExceeded
		}
	}
	if cause != nil {
		return fmt.Errorf("call %s: %w (%v)", to, cause, err)
	}
	return fmt.Errorf("call %s: %w", to, err)
}
