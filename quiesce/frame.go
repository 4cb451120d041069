package quiesce

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
)

// The peer port's frames: a hello, then length-prefixed messages, read
// with a bound on every length before anything is allocated.

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
