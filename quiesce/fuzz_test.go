package quiesce

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// FuzzReadFrame: a frame's length and body come from the network.
func FuzzReadFrame(f *testing.F) {
	var b bytes.Buffer
	writeFrame(&b, frame{TimeoutNanos: 5, Msg: Message{Version: ProtocolVersion, Job: "j", Epoch: 1, Seq: 1, Kind: KindDrain, Nodes: []string{"a", "b"}}})
	f.Add(b.Bytes())
	b.Reset()
	writeFrame(&b, wireSample())
	f.Add(b.Bytes())
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0, 0, 0, 2, '{', '}'})
	f.Fuzz(func(t *testing.T, in []byte) {
		var fr frame
		if err := readFrame(bytes.NewReader(in), &fr); err != nil {
			return
		}
		if err := fr.Msg.Validate(); err == nil && (fr.Msg.Job == "" || len(fr.Msg.Nodes) == 0) {
			t.Fatalf("validated %+v", fr.Msg)
		}
	})
}

// FuzzServeConn: whatever a client without the cluster key sends to a
// server that has one, no request reaches the handler.
func FuzzServeConn(f *testing.F) {
	var b bytes.Buffer
	writeFrame(&b, Hello{Magic: HelloMagic, Version: ProtocolVersion, Node: "a"})
	writeFrame(&b, frame{Msg: Message{Version: ProtocolVersion, Job: "j", Epoch: 1, Seq: 1, Kind: KindPrepare, Nodes: []string{"a"}}})
	f.Add(b.Bytes())
	b.Reset()
	writeFrame(&b, Hello{Magic: HelloMagic, Version: ProtocolVersion})
	f.Add(b.Bytes())
	// A TLS ClientHello's record header, then garbage.
	f.Add([]byte{0x16, 0x03, 0x01, 0x00, 0x40, 0x01, 0x00, 0x00, 0x3c, 0x03, 0x03})
	id := mustIdentity(f, "a", NewKeyring(mustKey(f)))
	f.Fuzz(func(t *testing.T, in []byte) {
		var called atomic.Bool
		h := func(ctx context.Context, m Message) (Message, error) {
			called.Store(true)
			return Message{}, nil
		}
		client, conn := net.Pipe()
		s := newServer(h, ServerOptions{Identity: id, HandshakeTimeout: time.Second, MaxPending: 1, MaxPendingPerAddr: 1})
		if err := s.pending.take(netip.Addr{}); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.serveConn(context.Background(), conn, netip.Addr{})
		}()
		go func() {
			// Drain what the server writes, so that it never blocks.
			buf := make([]byte, 4096)
			for {
				if _, err := client.Read(buf); err != nil {
					return
				}
			}
		}()
		client.SetWriteDeadline(time.Now().Add(time.Second))
		client.Write(in)
		client.Close()
		<-done
		if called.Load() {
			t.Fatalf("an unauthenticated client reached the handler with %q", in)
		}
	})
}

// FuzzReadHello: the hello is the first thing read after the handshake,
// from any member; it must stay small whatever its length says.
func FuzzReadHello(f *testing.F) {
	var b bytes.Buffer
	writeFrame(&b, Hello{Magic: HelloMagic, Version: ProtocolVersion, Node: "node1"})
	f.Add(b.Bytes())
	f.Add([]byte{0, 0, 0x10, 0x01})
	f.Fuzz(func(t *testing.T, in []byte) {
		var h Hello
		if err := readFrame(bytes.NewReader(in), &h); err == nil {
			if n := binary.BigEndian.Uint32(in); n > MaxHello {
				t.Fatalf("a hello of %d bytes was read", n)
			}
		}
	})
}

// FuzzParseKeys: a key file parses into 1 to MaxKeys keys or not at all.
func FuzzParseKeys(f *testing.F) {
	f.Add([]byte(strings.Repeat("ab", KeySize) + "\n"))
	f.Add([]byte(strings.Repeat("ab", KeySize) + "\n" + strings.Repeat("cd", KeySize)))
	f.Fuzz(func(t *testing.T, in []byte) {
		if r, ok := parseKeys(in); ok && (len(r.All()) == 0 || len(r.All()) > MaxKeys) {
			t.Fatalf("%d keys", len(r.All()))
		}
	})
}
