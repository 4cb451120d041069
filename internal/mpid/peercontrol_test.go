package mpid

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/quiesce"
)

// TestPeerControlWire: a control message comes back as it went, an empty
// one stays present, and its bytes are what mpid sent when the protocol
// package held the type (the hex), so that daemons of either version
// understand each other on the peer port.
func TestPeerControlWire(t *testing.T) {
	full := &peerControl{Op: "pause", UID: 1<<32 - 1, Timeout: -time.Second, Token: "1002:j:node0:00", Node: "node1", Size: 6,
		Result: json.RawMessage(`{"a":1}`), Code: "busy", Message: "later"}
	const fullHex = "0a05706175736510ffffffff0f18ffa7d6b90722077b2261223a317d2a04627573793a0f313030323a6a3a6e6f6465303a303042056e6f646531480c32056c61746572"
	if got := hex.EncodeToString(full.encode()); got != fullHex {
		t.Errorf("encoded\n got %s\nwant %s", got, fullHex)
	}
	placed := &peerControl{Op: "register", Node: "node1", Cgroups: []ctl.Cgroup{
		{Node: "node1", Dir: "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/step_0/user/task_0", Placed: "own"},
		{Node: "node1", Dir: "/sys/fs/cgroup/user.slice/run-r1.scope/mpipause-0:j", Placed: "inner"}}}
	for _, in := range []*peerControl{full, {}, placed} {
		m := in.message("j", "n0")
		if m.Kind != kindControl || m.Payload == nil {
			t.Fatalf("message %+v", m)
		}
		if out, err := decodeControl(m); err != nil || !reflect.DeepEqual(in, out) {
			t.Errorf("round trip: %v\n got %+v\nwant %+v", err, out, in)
		}
	}
	if _, err := decodeControl(quiesce.Message{Kind: kindControl}); !errors.Is(err, errNoControl) {
		t.Errorf("no payload: %v", err)
	}
	if c, err := decodeControl(quiesce.Message{Payload: quiesce.AppendUintField(nil, tagCtlUID, 1<<32-1)}); err != nil || c.UID != 1<<32-1 {
		t.Errorf("the largest uid: %+v, %v", c, err)
	}
	for name, p := range map[string][]byte{
		"uid past 32 bits":     quiesce.AppendUintField(nil, tagCtlUID, 1<<32),
		"negative size":        quiesce.AppendIntField(nil, tagCtlSize, -1),
		"size past 31 bits":    quiesce.AppendIntField(nil, tagCtlSize, 1<<31),
		"op as varint":         quiesce.AppendUintField(nil, tagCtlOp, 1),
		"cut short":            full.encode()[:10],
		"cgroup not absolute":  quiesce.AppendStringField(nil, tagCtlCgroup, "inner sys/fs/cgroup/x"),
		"cgroup of no mode":    quiesce.AppendStringField(nil, tagCtlCgroup, "moved /sys/fs/cgroup/x"),
		"cgroup without mode":  quiesce.AppendStringField(nil, tagCtlCgroup, "/sys/fs/cgroup/x"),
		"cgroup path too long": quiesce.AppendStringField(nil, tagCtlCgroup, "inner /"+strings.Repeat("x", 4096)),
		"more cgroups than an observer watches": func() []byte {
			var b []byte
			for i := range maxRemoteCgroups + 1 {
				b = quiesce.AppendStringField(b, tagCtlCgroup, fmt.Sprintf("own /sys/fs/cgroup/t%d", i))
			}
			return b
		}(),
	} {
		if c, err := decodeControl(quiesce.Message{Payload: p}); err == nil {
			t.Errorf("%s: decoded %+v", name, c)
		}
	}
}

// FuzzDecodeControl: a control message comes from any holder of the
// cluster key. What decodes keeps its ranges, and encodes to a message
// that decodes to the same.
func FuzzDecodeControl(f *testing.F) {
	f.Add((&peerControl{Op: "register", UID: 1002, Token: "1002:j:node0:00", Node: "node1", Size: 6}).encode())
	f.Add((&peerControl{Op: "pause", Result: json.RawMessage(`{"id":"j"}`), Code: "busy", Message: "later", Timeout: time.Second}).encode())
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, in []byte) {
		c, err := decodeControl(quiesce.Message{Payload: in})
		if err != nil {
			return
		}
		if c.Size < 0 {
			t.Fatalf("size %d", c.Size)
		}
		again, err := decodeControl(c.message("j", "n0"))
		if err != nil || !reflect.DeepEqual(c, again) {
			t.Fatalf("%+v came back as %+v, %v", c, again, err)
		}
	})
}
