package quiesce

import (
	"bufio"
	"context"
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

func writeFrame(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode frame: %w", err)
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

func readFrame(r io.Reader, v any) error {
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
	if err := writeFrame(conn, Hello{Magic: HelloMagic, Version: ProtocolVersion}); err != nil {
		return Message{}, t.fail(ctx, to, err)
	}
	var h Hello
	if err := readFrame(br, &h); err != nil {
		return Message{}, t.fail(ctx, to, err)
	}
	if h.Magic != HelloMagic || h.Version != ProtocolVersion || h.Err != "" {
		return Message{}, fmt.Errorf("%s: %w: hello %+v", to, ErrVersion, h)
	}
	if err := writeFrame(conn, f); err != nil {
		return Message{}, t.fail(ctx, to, err)
	}
	var rep frame
	if err := readFrame(br, &rep); err != nil {
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

// ServeTCP serves h on ln until ctx is done, then closes ln and waits for the
// connections it accepted to finish their current request.
func ServeTCP(ctx context.Context, ln net.Listener, h Handler) error {
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
		wg.Go(func() { serveConn(ctx, conn, h) })
	}
}

func serveConn(ctx context.Context, conn net.Conn, h Handler) {
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
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
	if err := writeFrame(conn, Hello{Magic: HelloMagic, Version: ProtocolVersion}); err != nil {
		return
	}
	for {
		_ = conn.SetReadDeadline(time.Time{})
		var f frame
		if err := readFrame(br, &f); err != nil {
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
		if err := writeFrame(conn, frame{Msg: rep}); err != nil {
			return
		}
	}
}
