package quiesce

import (
	"bufio"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/mpipause/mpipause/internal/accept"
)

// Wire format of the TCP transport: with an Identity, a TLS 1.3 session
// (tls.go) carries everything below. Every frame is a 4-byte big-endian
// length followed by that many bytes. A connection opens with one hello
// frame each way, in JSON, so that two daemons of different versions refuse
// each other before any step is misread; then the client sends requests and
// reads one reply per request, in order, each frame in the binary encoding
// of wire.go.

// HelloMagic identifies the protocol in the hello frame.
const HelloMagic = "mpipause-quiesce"

// MaxFrame bounds a frame, so a corrupt length cannot make a daemon allocate
// without limit. A reply listing every connection of thousands of nodes fits.
const MaxFrame = 64 << 20

// MaxHello bounds a hello frame: it is read before the peer is known to
// speak this protocol.
const MaxHello = 4 << 10

// Hello is the first frame in each direction.
type Hello struct {
	Magic   string `json:"magic"`
	Version int    `json:"version"`
	// Err is set by a server that refuses the client.
	Err string `json:"err,omitempty"`
	// Node, in a client's hello, is the node it means to reach: a server
	// of another name refuses it (a name resolving to the wrong member).
	Node string `json:"node,omitempty"`
}

// frame carries a message and, on requests, the time the sender still waits:
// the receiving node sizes its forwarding budget from it. It is relative, not
// a wall-clock deadline, so clock skew between nodes does not matter; transit
// time makes the receiver's view slightly generous, which the parent's
// reserve absorbs.
type frame struct {
	TimeoutNanos int64   `json:"timeout_ns,omitempty"`
	Msg          Message `json:"msg"`
}

// writeFrame writes v as a frame: a request or reply (frame) in the
// binary encoding, anything else (a hello) as JSON.
func writeFrame(w io.Writer, v any) error {
	switch f := v.(type) {
	case frame:
		return (&framer{w: w}).send(&f)
	case *frame:
		return (&framer{w: w}).send(f)
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode frame: %w", err)
	}
	return writeBody(w, append(make([]byte, 4, 4+len(b)), b...))
}

// writeBody writes b, a frame with 4 bytes reserved in front for its
// length, in one write.
func writeBody(w io.Writer, b []byte) error {
	n := len(b) - 4
	if n > MaxFrame {
		return fmt.Errorf("frame of %d bytes exceeds %d", n, MaxFrame)
	}
	binary.BigEndian.PutUint32(b, uint32(n))
	if _, err := w.Write(b); err != nil {
		return fmt.Errorf("write frame: %w", err)
	}
	return nil
}

// readFrame reads a frame into v: a *frame in the binary encoding,
// anything else (a hello, at most MaxHello bytes) as JSON.
func readFrame(r io.Reader, v any) error {
	if f, ok := v.(*frame); ok {
		_, err := (&framer{r: r}).recv(f)
		return err
	}
	b, _, err := readBody(r, nil, MaxHello)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("decode frame: %w", err)
	}
	return nil
}

// readBody reads a frame of at most limit bytes into buf, grown if too
// small, and returns it; got says whether any byte of it came.
func readBody(r io.Reader, buf []byte, limit uint32) (b []byte, got bool, err error) {
	var hdr [4]byte
	if n, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, n > 0, fmt.Errorf("read frame header: %w", err)
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > limit {
		return nil, true, fmt.Errorf("frame of %d bytes exceeds %d", n, limit)
	}
	if uint32(cap(buf)) < n {
		buf = make([]byte, n)
	}
	b = buf[:n]
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, true, fmt.Errorf("read frame body: %w", err)
	}
	return b, true, nil
}

// framer sends and receives one connection's request and reply frames,
// reusing its buffers from frame to frame: a connection carries one frame
// at a time.
type framer struct {
	w    io.Writer
	r    io.Reader
	wbuf []byte
	rbuf []byte
}

// keepBuf is the largest buffer a framer keeps for its next frame; a
// larger one (a request carrying thousands of node names) is dropped.
const keepBuf = 64 << 10

func (c *framer) send(f *frame) error { return c.sendMsg(f.TimeoutNanos, &f.Msg) }

// sendMsg sends the frame of m with the timeout given.
func (c *framer) sendMsg(timeout int64, m *Message) error {
	b := appendFrame(append(c.wbuf[:0], 0, 0, 0, 0), timeout, m)
	if cap(b) <= keepBuf {
		c.wbuf = b
	}
	return writeBody(c.w, b)
}

// recv reads the next frame into f, which must be zero; got says whether
// any byte of it came.
func (c *framer) recv(f *frame) (got bool, err error) { return c.recvMsg(&f.TimeoutNanos, &f.Msg) }

// recvMsg reads the next frame's timeout and message; m must be zero.
func (c *framer) recvMsg(timeout *int64, m *Message) (got bool, err error) {
	b, got, err := readBody(c.r, c.rbuf, MaxFrame)
	if err != nil {
		return got, err
	}
	if cap(b) <= keepBuf {
		c.rbuf = b
	}
	// One string for the whole body: every string decoded is a part of it.
	if err := decodeFrameMsg(string(b), timeout, m); err != nil {
		return true, fmt.Errorf("decode frame: %w", err)
	}
	return true, nil
}

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

	mu   sync.Mutex
	idle map[peerAddr][]*tcpConn // most recently used last
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

// ServerOptions configure ServeTCPWith.
type ServerOptions struct {
	// Identity, if set, is what the server proves and what it requires of
	// every client (see TCPTransport.Identity); nil serves the
	// unauthenticated protocol in the clear, for tests.
	Identity *Identity
	// Refused, if set, hears every client refused (not TLS, another key,
	// another node's name, too many connections, too slow) and every accept
	// error waited out (peer nil): why, in a few words that stay the same
	// for the same cause (a flood of refusals should be logged per cause,
	// not per client), its address, and the error. Never with key material.
	Refused func(cause string, peer net.Addr, err error)
	// IdleTimeout closes a connection with no request for that long; 0
	// means DefaultServerIdle.
	IdleTimeout time.Duration
	// HandshakeTimeout bounds a client's TLS handshake and hello together;
	// 0 means DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// MaxPending and MaxPendingPerAddr bound the connections not yet
	// through their handshake and hello, in all and from one address; 0
	// means DefaultMaxPending and DefaultMaxPendingPerAddr. A connection
	// beyond either is closed at once.
	MaxPending, MaxPendingPerAddr int
	// HandshakeRate and HandshakeRatePerAddr bound how many connections a
	// second may start a handshake, in all and from one address (each
	// with a burst of twice its rate, at least 1); 0 means
	// DefaultHandshakeRate and DefaultHandshakeRatePerAddr. A connection
	// beyond either is closed before its handshake: a stranger's loop of
	// handshakes costs the server at most the rate's worth of key
	// exchanges and signatures, whatever its speed.
	HandshakeRate, HandshakeRatePerAddr rate.Limit
	// Unauthenticated, if set, runs fn, the work a client can cause before
	// it has proved it holds the cluster key (the accept loop, with its
	// refusals, for the server's life; each handshake and hello), and
	// returns when fn has. mpid runs it on a thread without its own
	// real-time priority, so that a stranger's handshakes compete for the
	// CPU as the stranger's own processes would. nil runs fn in place.
	Unauthenticated func(fn func())
	// MaxConns and MaxConnsPerAddr bound the connections open at once, in
	// all and from one address, authenticated or not; 0: no bound (mpid
	// derives them from its file descriptor limit). A connection beyond
	// either is closed at once.
	MaxConns, MaxConnsPerAddr int
	// Busy, if set, is asked at each accept: an error closes the new
	// connection (mpid: its heap near its memory limit).
	Busy func() error
}

// DefaultHandshakeTimeout is how long a client may take to authenticate:
// a cluster member does it in a few milliseconds.
const DefaultHandshakeTimeout = 5 * time.Second

// A tree round opens one connection to a node per job pausing at once
// (from its parent), and a pooled one is reused; a flood of strangers past
// these limits is closed before it costs a handshake. A client refused for
// the cap sees a reset, which it retries like a loss. A connection in its
// handshake holds a few tens of KiB, so the cap is a few MiB.
const (
	DefaultMaxPending        = 256
	DefaultMaxPendingPerAddr = 32
)

// A node's mpid dials a peer once per pooled connection (a tree round
// reuses it), so even thousands of jobs pausing at once start far fewer
// handshakes a second to one address than these rates let through; a
// handshake costs the server about half a millisecond of CPU (an
// X25519MLKEM768 exchange and an Ed25519 signature and verification), so
// the rates cap what all strangers together can make it spend at about 6%
// of a CPU, and one address at a quarter of that.
const (
	DefaultHandshakeRate        rate.Limit = 128
	DefaultHandshakeRatePerAddr rate.Limit = 32
)

// maxRateAddrs bounds the addresses the per-address rate remembers; past
// it, those whose buckets are full again are forgotten (they would start
// full anyway), and a connection from a new address finding no room is
// refused.
const maxRateAddrs = 4096

// ServeTCP serves h on ln without authentication until ctx is done; see
// ServeTCPWith.
func ServeTCP(ctx context.Context, ln net.Listener, h Handler) error {
	return ServeTCPWith(ctx, ln, h, ServerOptions{})
}

// ServeTCPWith serves h on ln until ctx is done, then closes ln and waits
// for the connections it accepted to finish their current request.
func ServeTCPWith(ctx context.Context, ln net.Listener, h Handler, o ServerOptions) error {
	s := newServer(h, o)
	// Accept errors (a process or kernel out of descriptors or buffers)
	// are waited out and logged by cause with the refusals: only closing
	// ln ends the loop.
	bounded := accept.New(ln, accept.Options{Key: accept.AddrKey, PerKey: o.MaxConnsPerAddr, Total: o.MaxConns, Busy: o.Busy,
		Log: func(cause, _ string, peer net.Addr, err error) { s.refused(cause, peer, err) }})
	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { bounded.Close() })
	defer stop()
	defer wg.Wait()
	// Accepting and refusing is work any client causes too, as often as
	// it connects: it runs where the handshakes do.
	var err error
	s.unauthenticated(func() { err = s.accept(ctx, bounded, &wg) })
	return err
}

// accept takes connections until ln is closed, refusing those beyond the
// caps and rates before their handshake.
func (s *server) accept(ctx context.Context, ln net.Listener, wg *sync.WaitGroup) error {
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accept: %w", err)
		}
		from := addrOf(conn.RemoteAddr())
		if err := s.pending.take(from); err != nil {
			cause := "too many connections not yet authenticated"
			if errors.Is(err, errRate) {
				cause = "too many handshakes a second"
			}
			s.refused(cause, conn.RemoteAddr(), err)
			conn.Close()
			continue
		}
		wg.Go(func() { s.serveConn(ctx, conn, from) })
	}
}

// unauthenticated runs fn through ServerOptions.Unauthenticated.
func (s *server) unauthenticated(fn func()) {
	if s.o.Unauthenticated != nil {
		s.o.Unauthenticated(fn)
		return
	}
	fn()
}

func newServer(h Handler, o ServerOptions) *server {
	return &server{h: h, o: o, pending: pending{max: cmp.Or(o.MaxPending, DefaultMaxPending),
		perAddr:  cmp.Or(o.MaxPendingPerAddr, DefaultMaxPendingPerAddr),
		rate:     newLimiter(cmp.Or(o.HandshakeRate, DefaultHandshakeRate)),
		addrRate: cmp.Or(o.HandshakeRatePerAddr, DefaultHandshakeRatePerAddr)}}
}

// server is one peer port's state across its connections.
type server struct {
	h       Handler
	o       ServerOptions
	pending pending
}

func (s *server) refused(cause string, peer net.Addr, err error) {
	if s.o.Refused != nil {
		s.o.Refused(cause, peer, err)
	}
}

// pending counts the connections still in their handshake, in all and by
// source address, and holds the handshake rates.
type pending struct {
	max, perAddr int
	rate         *rate.Limiter
	addrRate     rate.Limit

	mu     sync.Mutex
	n      int
	byAddr map[netip.Addr]int
	rates  map[netip.Addr]*rate.Limiter
}

func newLimiter(r rate.Limit) *rate.Limiter { return rate.NewLimiter(r, max(1, int(2*r))) }

// errRate is a connection refused for a handshake rate.
var errRate = errors.New("handshake rate")

func (p *pending) take(a netip.Addr) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n >= p.max {
		return fmt.Errorf("%d connections in their handshake", p.n)
	}
	if p.byAddr[a] >= p.perAddr {
		return fmt.Errorf("%d connections from %s in their handshake", p.byAddr[a], a)
	}
	// The address's bucket first: a flood from one address must not use
	// up the budget every other address shares.
	now := time.Now()
	ar, err := p.addrLimiterLocked(a, now)
	if err != nil {
		return err
	}
	if !ar.AllowN(now, 1) {
		return fmt.Errorf("%w: more than %v handshakes a second from %s", errRate, p.addrRate, a)
	}
	if !p.rate.AllowN(now, 1) {
		return fmt.Errorf("%w: more than %v handshakes a second in all", errRate, p.rate.Limit())
	}
	if p.byAddr == nil {
		p.byAddr = map[netip.Addr]int{}
	}
	p.n++
	p.byAddr[a]++
	return nil
}

// addrLimiterLocked is a's handshake bucket, made full if a has none.
func (p *pending) addrLimiterLocked(a netip.Addr, now time.Time) (*rate.Limiter, error) {
	if l, ok := p.rates[a]; ok {
		return l, nil
	}
	if p.rates == nil {
		p.rates = map[netip.Addr]*rate.Limiter{}
	}
	if len(p.rates) >= maxRateAddrs {
		for k, l := range p.rates {
			if l.TokensAt(now) >= float64(l.Burst()) {
				delete(p.rates, k)
			}
		}
		if len(p.rates) >= maxRateAddrs {
			return nil, fmt.Errorf("%w: %d addresses handshaking at their rate", errRate, len(p.rates))
		}
	}
	l := newLimiter(p.addrRate)
	p.rates[a] = l
	return l, nil
}

func (p *pending) done(a netip.Addr) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n--
	if p.byAddr[a]--; p.byAddr[a] <= 0 {
		delete(p.byAddr, a)
	}
}

// addrOf is a connection's source address without its port (the zero
// Addr for a listener that is not TCP: every such peer counts as one).
func addrOf(a net.Addr) netip.Addr {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// handshake authenticates a client on conn and reads its hello, within
// the handshake timeout. It returns what the connection is read and
// written through, or nil having refused the client.
func (s *server) handshake(ctx context.Context, conn net.Conn) (net.Conn, *bufio.Reader) {
	_ = conn.SetDeadline(time.Now().Add(cmp.Or(s.o.HandshakeTimeout, DefaultHandshakeTimeout)))
	var rw net.Conn = conn
	if id := s.o.Identity; id != nil {
		tc := tls.Server(conn, id.serverConfig())
		if err := tc.HandshakeContext(ctx); err != nil {
			s.refused(handshakeCause(err), conn.RemoteAddr(), err)
			return nil, nil
		}
		rw = tc
	}
	br := bufio.NewReader(rw)
	var hello Hello
	if err := readFrame(br, &hello); err != nil {
		if s.o.Identity != nil {
			s.refused("no hello after the handshake", conn.RemoteAddr(), err)
		}
		return nil, nil
	}
	if hello.Magic != HelloMagic || hello.Version != ProtocolVersion {
		s.refused("another protocol version", conn.RemoteAddr(), ErrVersion)
		_ = writeFrame(rw, Hello{Magic: HelloMagic, Version: ProtocolVersion,
			Err: fmt.Sprintf("speak version %d, got %q version %d", ProtocolVersion, hello.Magic, hello.Version)})
		return nil, nil
	}
	if id := s.o.Identity; id != nil && hello.Node != id.name {
		// Log before the refusal goes out, so the line is there by the
		// time the peer can report the error.
		err := fmt.Errorf("%w: it dialled %q", ErrWrongNode, hello.Node)
		s.refused("it meant another node", conn.RemoteAddr(), err)
		_ = writeFrame(rw, Hello{Magic: HelloMagic, Version: ProtocolVersion,
			Err: fmt.Sprintf("this is %s, not %s (the name %s resolves to this node's address)", id.name, hello.Node, hello.Node)})
		return nil, nil
	}
	if err := writeFrame(rw, Hello{Magic: HelloMagic, Version: ProtocolVersion}); err != nil {
		return nil, nil
	}
	_ = conn.SetDeadline(time.Time{})
	return rw, br
}

func (s *server) serveConn(ctx context.Context, conn net.Conn, from netip.Addr) {
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	var rw net.Conn
	var br *bufio.Reader
	s.unauthenticated(func() { rw, br = s.handshake(ctx, conn) })
	s.pending.done(from)
	if rw == nil {
		return
	}
	idle := cmp.Or(s.o.IdleTimeout, DefaultServerIdle)
	fr := framer{w: rw, r: br}
	for {
		// Clients keep connections for their next request (TCPTransport);
		// one that never sends it should not hold a goroutine for ever.
		_ = conn.SetReadDeadline(time.Now().Add(idle))
		var f frame
		if _, err := fr.recv(&f); err != nil {
			return // EOF: the client is done
		}
		rctx, cancel := ctx, context.CancelFunc(func() {})
		if f.TimeoutNanos > 0 {
			rctx, cancel = context.WithTimeout(ctx, time.Duration(f.TimeoutNanos))
		}
		rep, err := s.h(rctx, f.Msg)
		cancel()
		if err != nil {
			// No reply: the client's retry is the recovery, as for a loss.
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				return
			}
			rep = Message{Version: ProtocolVersion, Job: f.Msg.Job, Epoch: f.Msg.Epoch, Seq: f.Msg.Seq,
				Kind: f.Msg.Kind, Reply: true, Err: err.Error()}
		}
		if err := fr.send(&frame{Msg: rep}); err != nil {
			return
		}
	}
}
