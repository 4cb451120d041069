package quiesce

import (
	"bufio"
	"context"
	"crypto/hmac"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// Wire format of the TCP transport: every frame is a 4-byte big-endian length
// followed by that many bytes of JSON. A connection opens with one hello frame
// each way, so that two daemons of different versions refuse each other
// before any step is misread; then the client sends requests and reads one
// reply per request, in order.

// HelloMagic identifies the protocol in the hello frame.
const HelloMagic = "mpipause-quiesce"

// MaxFrame bounds a frame, so a corrupt length cannot make a daemon allocate
// without limit. A reply listing every connection of thousands of nodes fits.
const MaxFrame = 64 << 20

// Hello is the first frame in each direction.
type Hello struct {
	Magic   string `json:"magic"`
	Version int    `json:"version"`
	// Err is set by a server that refuses the client.
	Err string `json:"err,omitempty"`
	// Nonce is the sender's fresh nonce when it authenticates (auth.go);
	// Proof, in the server's hello, shows that it holds the cluster key.
	Nonce []byte `json:"nonce,omitempty"`
	Proof []byte `json:"proof,omitempty"`
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

func writeFrame(w io.Writer, v any) error { return writeSealed(w, nil, v) }

func readFrame(r io.Reader, v any) error { return readSealed(r, nil, v) }

// writeSealed writes v as a frame, with its MAC when s is not nil.
func writeSealed(w io.Writer, s *session, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode frame: %w", err)
	}
	if s != nil {
		b = s.seal(b)
	}
	if len(b) > MaxFrame {
		return fmt.Errorf("frame of %d bytes exceeds %d", len(b), MaxFrame)
	}
	buf := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(buf, uint32(len(b)))
	copy(buf[4:], b)
	if _, err := w.Write(buf); err != nil {
		return fmt.Errorf("write frame: %w", err)
	}
	return nil
}

// readSealed reads a frame into v, checking its MAC first when s is not
// nil: nothing of a frame that fails it is decoded.
func readSealed(r io.Reader, s *session, v any) error {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return fmt.Errorf("read frame header: %w", err)
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > MaxFrame {
		return fmt.Errorf("frame of %d bytes exceeds %d", n, MaxFrame)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return fmt.Errorf("read frame body: %w", err)
	}
	if s != nil {
		var err error
		if b, err = s.open(b); err != nil {
			return err
		}
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("decode frame: %w", err)
	}
	return nil
}

// TCPTransport is a Transport over TCP. A node name is dialled as a TCP
// address unless Resolve maps it. Each Call uses its own connection: a round
// makes one call per tree edge, so pooling would save little, and a fresh
// connection never carries a stale reply of a cancelled call.
type TCPTransport struct {
	// Resolve maps a node name to a "host:port" address; nil dials the name.
	Resolve func(name string) (string, error)
	// Dialer is used for connections; the zero value is fine.
	Dialer net.Dialer
	// Key, if set, authenticates every connection (auth.go): the server
	// must prove it holds the same key, and every frame is MACed. nil
	// speaks the unauthenticated protocol, for tests.
	Key *Key
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
	conn, err := t.Dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return Message{}, fmt.Errorf("dial %s: %w", to, err)
	}
	defer conn.Close()
	// Closing the connection is the only way to interrupt a blocked read
	// when ctx is cancelled rather than timed out.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	f := frame{Msg: req}
	if dl, ok := ctx.Deadline(); ok {
		f.TimeoutNanos = max(int64(time.Until(dl)), 1)
		_ = conn.SetDeadline(dl)
	}
	br := bufio.NewReader(conn)
	mine := Hello{Magic: HelloMagic, Version: ProtocolVersion}
	if t.Key != nil {
		if mine.Nonce, err = newNonce(); err != nil {
			return Message{}, err
		}
	}
	if err := writeFrame(conn, mine); err != nil {
		return Message{}, t.fail(ctx, to, err)
	}
	var h Hello
	if err := readFrame(br, &h); err != nil {
		return Message{}, t.fail(ctx, to, err)
	}
	if h.Err != "" && h.Magic == HelloMagic && h.Version == ProtocolVersion {
		return Message{}, fmt.Errorf("%s refused the connection: %s", to, h.Err)
	}
	if h.Magic != HelloMagic || h.Version != ProtocolVersion || h.Err != "" {
		return Message{}, fmt.Errorf("%s: %w: hello magic %q version %d: %s", to, ErrVersion, h.Magic, h.Version, h.Err)
	}
	var s *session
	if t.Key != nil {
		if len(h.Nonce) != nonceSize || len(h.Proof) == 0 {
			return Message{}, fmt.Errorf("%s: %w: it does not authenticate (started without the cluster key?)", to, ErrAuth)
		}
		s = newSession(t.Key, mine.Nonce, h.Nonce, true)
		if !hmac.Equal(h.Proof, s.proof()) {
			return Message{}, fmt.Errorf("%s: %w: it does not hold this node's cluster key", to, ErrAuth)
		}
	}
	if err := writeSealed(conn, s, f); err != nil {
		return Message{}, t.fail(ctx, to, err)
	}
	var rep frame
	if err := readSealed(br, s, &rep); err != nil {
		return Message{}, t.fail(ctx, to, err)
	}
	return rep.Msg, nil
}

// fail prefers ctx's error, since a read interrupted by cancellation reports
// a closed connection, which would hide why.
func (t *TCPTransport) fail(ctx context.Context, to string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("call %s: %w (%v)", to, ctx.Err(), err)
	}
	return fmt.Errorf("call %s: %w", to, err)
}

// ServerOptions configure ServeTCPWith.
type ServerOptions struct {
	// Key, if set, is required of every client (see TCPTransport.Key);
	// nil serves the unauthenticated protocol, for tests.
	Key *Key
	// Log, if set, hears every client refused or cut off for failing
	// authentication, with its address. Never with key material.
	Log func(msg string, args ...any)
}

// ServeTCP serves h on ln without authentication until ctx is done; see
// ServeTCPWith.
func ServeTCP(ctx context.Context, ln net.Listener, h Handler) error {
	return ServeTCPWith(ctx, ln, h, ServerOptions{})
}

// ServeTCPWith serves h on ln until ctx is done, then closes ln and waits
// for the connections it accepted to finish their current request.
func ServeTCPWith(ctx context.Context, ln net.Listener, h Handler, o ServerOptions) error {
	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	defer wg.Wait()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accept: %w", err)
		}
		wg.Go(func() { serveConn(ctx, conn, h, o) })
	}
}

func serveConn(ctx context.Context, conn net.Conn, h Handler, o ServerOptions) {
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	logf := func(msg string, err error) {
		if o.Log != nil {
			o.Log(msg, "peer", conn.RemoteAddr().String(), "error", err)
		}
	}
	br := bufio.NewReader(conn)
	// The hello must come quickly: a silent peer should not hold a goroutine.
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	var hello Hello
	if err := readFrame(br, &hello); err != nil {
		return
	}
	if hello.Magic != HelloMagic || hello.Version != ProtocolVersion {
		_ = writeFrame(conn, Hello{Magic: HelloMagic, Version: ProtocolVersion,
			Err: fmt.Sprintf("speak version %d, got %q version %d", ProtocolVersion, hello.Magic, hello.Version)})
		return
	}
	mine := Hello{Magic: HelloMagic, Version: ProtocolVersion}
	var s *session
	if o.Key != nil {
		if len(hello.Nonce) != nonceSize {
			_ = writeFrame(conn, Hello{Magic: HelloMagic, Version: ProtocolVersion,
				Err: "this node requires the cluster key (mpid --cluster-key)"})
			logf("peer refused: it does not authenticate", ErrAuth)
			return
		}
		var err error
		if mine.Nonce, err = newNonce(); err != nil {
			return
		}
		s = newSession(o.Key, hello.Nonce, mine.Nonce, false)
		mine.Proof = s.proof()
	}
	if err := writeFrame(conn, mine); err != nil {
		return
	}
	for {
		_ = conn.SetReadDeadline(time.Time{})
		var f frame
		if err := readSealed(br, s, &f); err != nil {
			if errors.Is(err, ErrAuth) {
				logf("peer frame rejected; connection closed", err)
			}
			return // EOF: the client is done
		}
		rctx, cancel := ctx, context.CancelFunc(func() {})
		if f.TimeoutNanos > 0 {
			rctx, cancel = context.WithTimeout(ctx, time.Duration(f.TimeoutNanos))
		}
		rep, err := h(rctx, f.Msg)
		cancel()
		if err != nil {
			// No reply: the client's retry is the recovery, as for a loss.
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				return
			}
			rep = Message{Version: ProtocolVersion, Job: f.Msg.Job, Epoch: f.Msg.Epoch, Seq: f.Msg.Seq,
				Kind: f.Msg.Kind, Reply: true, Err: err.Error()}
		}
		if err := writeSealed(conn, s, frame{Msg: rep}); err != nil {
			return
		}
	}
}
