package quiesce

import (
	"bufio"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/mpipause/mpipause/internal/accept"
	"golang.org/x/time/rate"
)

// The peer port's server side: connections accepted within per-address
// and total bounds, handshakes rate-limited per address, each
// authenticated connection's frames handed to the node's Handler.

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
