package quiesce

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
)

// echo answers every request with its own job.
func echo(_ context.Context, req Message) (Message, error) {
	return Message{Version: ProtocolVersion, Job: req.Job, Seq: req.Seq, Kind: req.Kind, Reply: true}, nil
}

// refusals records what a server refuses, by cause.
type refusals struct {
	mu     sync.Mutex
	causes map[string]int
	seen   chan string
}

func newRefusals() *refusals {
	return &refusals{causes: map[string]int{}, seen: make(chan string, 100)}
}

func (r *refusals) note(cause string, _ net.Addr, _ error) {
	r.mu.Lock()
	r.causes[cause]++
	r.mu.Unlock()
	r.seen <- cause
}

func serveFlaky(t *testing.T, o ServerOptions, errs ...syscall.Errno) (*testutil.FlakyListener, chan error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fl := testutil.NewFlakyListener(ln, errs...)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- ServeTCPWith(ctx, fl, echo, o) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return fl, served
}

// TestTCPServesThroughAcceptErrors: the peer port waits out a process or
// kernel out of descriptors or buffers, reports each accept error to
// Refused, and serves the next client.
func TestTCPServesThroughAcceptErrors(t *testing.T) {
	r := newRefusals()
	fl, _ := serveFlaky(t, ServerOptions{Refused: r.note}, syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM)
	tr := &TCPTransport{}
	defer tr.CloseIdle()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rep, err := tr.Call(ctx, fl.Addr().String(), Message{Version: ProtocolVersion, Job: "j", Seq: 1, Kind: KindPrepare})
	if err != nil || rep.Job != "j" {
		t.Fatalf("call after %d accept errors: %+v, %v", fl.Failed(), rep, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range []string{"accept: too many open files", "accept: too many open files in system",
		"accept: no buffer space available", "accept: cannot allocate memory"} {
		if r.causes[c] != 1 {
			t.Errorf("Refused heard %q %d times, want 1 (all: %v)", c, r.causes[c], r.causes)
		}
	}
}

// TestTCPMaxConnsPerAddr: an address's connection past its bound is
// closed at once, before its handshake; another address's is served.
func TestTCPMaxConnsPerAddr(t *testing.T) {
	r := newRefusals()
	fl, _ := serveFlaky(t, ServerOptions{Refused: r.note, MaxConnsPerAddr: 2, MaxConns: 10})
	dial := func(src string) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		c, err := d.Dial("tcp", fl.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// Silent: held in their handshake.
	dial("127.0.0.1")
	dial("127.0.0.1")
	third := dial("127.0.0.1")
	if cause := <-r.seen; cause != "too many connections of one peer" {
		t.Errorf("refused: %q", cause)
	}
	third.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := third.Read(make([]byte, 1)); !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the third connection of 127.0.0.1: %v, want it closed", err)
	}
	other := dial("127.0.0.2")
	if _, err := other.Write(helloFrame(t)); err != nil {
		t.Fatal(err)
	}
	other.SetReadDeadline(time.Now().Add(10 * time.Second))
	var h Hello
	if err := readFrame(other, &h); err != nil || h.Err != "" {
		t.Errorf("127.0.0.2's hello: %+v, %v", h, err)
	}
}

func helloFrame(t *testing.T) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := writeFrame(&b, Hello{Magic: HelloMagic, Version: ProtocolVersion}); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}
