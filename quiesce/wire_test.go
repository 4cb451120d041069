package quiesce

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"
)

// wireSample has every field set, the signed ones negative where they can
// be, and an empty name in a list, which must survive.
func wireSample() frame {
	return frame{TimeoutNanos: int64(3 * time.Second), Msg: Message{
		Version: ProtocolVersion, Job: "job-1", Epoch: 1<<63 + 5, Seq: 7, Kind: KindDrain, Reply: true,
		Nodes: []string{"n0", "", "n2:4711"},
		Report: &Report{Nodes: 3, Checked: 9, Ranks: 4, Drained: 1 << 40, Ports: Ports{22}, Own: Ports{5432, 9000}, Pending: []NodeReport{
			{Node: "n0", Conns: []Conn{{Node: "n0", Local: "10.0.0.1:1", Remote: "10.0.0.2:2", SendQueue: 5, Unread: 1 << 33, Rank: -1}, {Rank: 3}},
				Ungated: 2, Violations: 11, Late: 12, Err: "DRAIN: boom", Fault: &Fault{Code: "gone", Rank: -3}, Unreached: true, Checked: 1, Ranks: -2, Drained: 8},
			{Node: "n2:4711", Empty: true},
			{Node: "n3", Err: "PREPARE: rank 0 gone", Fault: &Fault{}},
		}},
		Err:     "refused",
		Payload: AppendStringField(AppendUintField(nil, 1, 1<<32-1), 2, "later"),
		Wait:    20 * time.Millisecond, Fanout: FanoutStar, Ports: Ports{0, 1, 300, 65535},
		Coordinator: "n0", Decider: "n2:4711",
	}}
}

func roundTripWire(t *testing.T, in frame) frame {
	t.Helper()
	var b bytes.Buffer
	if err := writeFrame(&b, in); err != nil {
		t.Fatal(err)
	}
	var out frame
	if err := readFrame(&b, &out); err != nil {
		t.Fatalf("decode %+v: %v", in, err)
	}
	return out
}

// TestWireRoundTrip: every field comes back as it went, nil stays nil and
// a present but empty report or payload stays present.
func TestWireRoundTrip(t *testing.T) {
	for _, in := range []frame{
		wireSample(),
		{},
		{Msg: Message{Version: ProtocolVersion, Job: "j", Kind: KindCommit, Nodes: []string{"a"}, Report: &Report{}, Payload: []byte{}}},
	} {
		if out := roundTripWire(t, in); !reflect.DeepEqual(in, out) {
			t.Errorf("round trip:\n got %+v\nwant %+v", out, in)
		}
	}
}

// TestWirePayloadFrame: tag 10 held a nested message of the protocol's
// own (the forwarding message mpid now owns): a payload holding that
// message's bytes makes the frame a daemon of that version sent, byte for
// byte, and a frame of that version decodes to the payload, so that nodes
// of either version read each other. The hex is what that version wrote.
func TestWirePayloadFrame(t *testing.T) {
	const ctl = "0a05706175736510ffffffff0f18ffa7d6b90722077b2261223a317d2a04627573793a0f313030323a6a3a6e6f6465303a303042056e6f646531480c32056c61746572"
	for payload, want := range map[string]string{
		ctl: "080a12de808000080412016a2a07434f4e54524f4c3a026e3052c38080000a05706175736510ffffffff0f18ffa7d6b90722077b2261223a317d2a04627573793a0f313030323a6a3a6e6f6465303a303042056e6f646531480c32056c617465726a026e30",
		"":  "080a129b808000080412016a2a07434f4e54524f4c3a026e3052808080006a026e30",
	} {
		p, _ := hex.DecodeString(payload)
		if p == nil {
			p = []byte{}
		}
		in := frame{TimeoutNanos: 5, Msg: Message{Version: ProtocolVersion, Job: "j", Kind: "CONTROL", Nodes: []string{"n0"}, Coordinator: "n0", Payload: p}}
		if got := hex.EncodeToString(in.appendWire(nil)); got != want {
			t.Errorf("payload %q:\n got %s\nwant %s", payload, got, want)
		}
		b, _ := hex.DecodeString(want)
		var out frame
		if err := decodeFrame(string(b), &out); err != nil || !reflect.DeepEqual(in, out) {
			t.Errorf("the frame of payload %q: %v\n got %+v\nwant %+v", payload, err, out, in)
		}
	}
}

// TestWireUnknownFields: a field this version does not know, of either
// wire type and at any level, is skipped, as JSON ignored an unknown key,
// so that a field can be added without a new version.
func TestWireUnknownFields(t *testing.T) {
	in := wireSample()
	body := in.appendWire(nil)
	extra := appendStr(appendUint(nil, 99, 12345), 100, "from a newer agent")
	// Unknown fields at the end of the frame, of the message (inside the
	// frame's nested message: rebuild it with them) and of a report.
	m := in.Msg.appendWire(nil)
	m = append(m, extra...)
	withMsg := appendInt(nil, tagFrameTimeout, in.TimeoutNanos)
	withMsg, at := beginNested(withMsg, tagFrameMsg)
	withMsg = endNested(append(withMsg, m...), at)
	for _, b := range [][]byte{append(body, extra...), append(withMsg, extra...)} {
		var out frame
		if err := decodeFrame(string(b), &out); err != nil || !reflect.DeepEqual(in, out) {
			t.Errorf("with unknown fields: %v\n got %+v\nwant %+v", err, out, in)
		}
	}
}

// TestWireMalformed: every truncation of a valid frame, a wrong wire type
// for a known field, an unknown wire type and a varint past 64 bits are
// refused, never read as something else.
func TestWireMalformed(t *testing.T) {
	in := wireSample()
	body := in.appendWire(nil)
	for n := range len(body) {
		var out frame
		err := decodeFrame(string(body[:n]), &out)
		if n > 0 && err == nil && reflect.DeepEqual(out, in) {
			t.Fatalf("a frame cut to %d of %d bytes decoded whole", n, len(body))
		}
		if err != nil && !errors.Is(err, errWire) {
			t.Fatalf("cut to %d: %v, want errWire", n, err)
		}
	}
	for name, b := range map[string][]byte{
		"string as varint": appendUint(nil, tagFrameMsg, 3),
		"varint as string": appendStr(nil, tagFrameTimeout, "x"),
		"wire type 5":      appendKey(nil, 1, 5),
		"varint overflow":  append(appendKey(nil, tagFrameTimeout, wtVarint), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f),
		"length past end":  append(appendKey(nil, tagFrameMsg, wtBytes), 0x20, 1),
	} {
		var out frame
		if err := decodeFrame(string(b), &out); !errors.Is(err, errWire) {
			t.Errorf("%s: %v, want errWire", name, err)
		}
	}
}

// TestWireMixedVersions: a daemon of the JSON wire (version 1) and one of
// this version refuse each other at the hello, with ErrVersion on the
// client, before any frame is misread.
func TestWireMixedVersions(t *testing.T) {
	names, _, tr := tcpCluster(t, 1)
	// An old client: the server refuses its hello and says why.
	conn := rawHello(t, names[0], 1)
	var h Hello
	if err := readFrame(conn, &h); err != nil || !strings.Contains(h.Err, "version") {
		t.Fatalf("a version 1 client: %+v %v", h, err)
	}
	// An old server: the client gets ErrVersion.
	old := oldServer(t)
	if _, err := tr.Call(t.Context(), old, Message{Version: ProtocolVersion, Job: "j", Epoch: 1, Seq: 1, Kind: KindPrepare, Nodes: []string{old}}); !errors.Is(err, ErrVersion) {
		t.Fatalf("a version 1 server: %v, want ErrVersion", err)
	}
}

// rawHello dials addr and sends a hello of the given version.
func rawHello(t *testing.T, addr string, version int) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if err := writeFrame(conn, Hello{Magic: HelloMagic, Version: version}); err != nil {
		t.Fatal(err)
	}
	return conn
}

// oldServer answers every hello as a daemon of the JSON wire (version 1)
// did: with its version and a refusal.
func oldServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			var h Hello
			if readFrame(c, &h) == nil {
				writeFrame(c, Hello{Magic: HelloMagic, Version: 1, Err: fmt.Sprintf("speak version 1, got %q version %d", h.Magic, h.Version)})
			}
			c.Close()
		}
	}()
	return ln.Addr().String()
}
