package quiesce

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
)

func TestPortsSet(t *testing.T) {
	p := PortsOf([]uint16{80, 22, 80, 65535, 0})
	if !slices.Equal(p, Ports{0, 22, 80, 65535}) {
		t.Fatalf("PortsOf: %v", p)
	}
	if !p.Has(22) || p.Has(23) {
		t.Errorf("Has(22), Has(23): %v, %v", p.Has(22), p.Has(23))
	}
	if u := p.Union(Ports{1, 80, 9000}); !slices.Equal(u, Ports{0, 1, 22, 80, 9000, 65535}) {
		t.Errorf("Union: %v", u)
	}
	if u := p.Union(Ports{22}); &u[0] != &p[0] {
		t.Errorf("a union that adds nothing copied the set")
	}
	if x, ok := p.Meets(Ports{7, 80}); !ok || x != 80 {
		t.Errorf("Meets: %d, %v; want 80", x, ok)
	}
	if _, ok := p.Meets(Ports{7}); ok {
		t.Errorf("Meets found a port in disjoint sets")
	}
}

// TestWirePortsMalformed: a set that is not strictly increasing 16-bit
// ports is refused, since receivers search it as a sorted set.
func TestWirePortsMalformed(t *testing.T) {
	for name, body := range map[string][]byte{
		"repeat":       {80, 0},
		"out of range": {0xff, 0xff, 0x04},
		"sum past max": {0xff, 0xff, 0x03, 1},
	} {
		b := appendInt(nil, tagMsgVersion, ProtocolVersion)
		b = append(appendKey(b, tagMsgPorts, wtBytes), byte(len(body)))
		b = append(b, body...)
		var m Message
		r := wireReader{s: string(b)}
		r.message(&m)
		if r.err == nil {
			t.Errorf("%s: decoded as %v", name, m.Ports)
		}
	}
}

// peeredNode is a fakeNode with ports: its own (late ones appear only once
// the job is frozen: a socket made during the pause, after its node's last
// DRAIN check), and a connection to port far on another host whose bytes
// it leaves alone as a program's own until the coordinator says far is a
// port of the job's; then the drain takes them.
type peeredNode struct {
	*fakeNode
	pm      sync.Mutex
	mine    Ports
	late    Ports
	far     uint16
	drained bool
	told    []Ports
}

func (p *peeredNode) Ports(string) Ports {
	p.pm.Lock()
	defer p.pm.Unlock()
	return p.mine
}

func (p *peeredNode) Peers(_ string, all Ports) {
	p.pm.Lock()
	defer p.pm.Unlock()
	p.told = append(p.told, all)
}

func (p *peeredNode) side(r NodeReport) NodeReport {
	p.pm.Lock()
	defer p.pm.Unlock()
	if p.far == 0 || p.drained {
		return r
	}
	if len(p.told) > 0 && p.told[len(p.told)-1].Has(p.far) {
		p.drained = true
		r.Empty = false
		r.Conns = append(r.Conns, Conn{Local: p.name + ":1", Remote: "far:" + string(rune('0'+p.far%10)), Unread: 10, Rank: 0})
		return r
	}
	r.Own = Ports{p.far}
	return r
}

func (p *peeredNode) Drain(ctx context.Context, job string) (NodeReport, error) {
	r, err := p.fakeNode.Drain(ctx, job)
	return p.side(r), err
}

func (p *peeredNode) Verify(ctx context.Context, job string) (NodeReport, error) {
	r, err := p.fakeNode.Verify(ctx, job)
	p.pm.Lock()
	p.mine = p.mine.Union(p.late)
	p.pm.Unlock()
	return p.side(r), err
}

func peeredCluster(ps ...*peeredNode) *cluster {
	c := &cluster{net: NewMemNetwork(1, Faults{}), byName: map[string]*fakeNode{}}
	for _, p := range ps {
		c.names = append(c.names, p.name)
		c.fakes = append(c.fakes, p.fakeNode)
		c.byName[p.name] = p.fakeNode
		a := NewAgent(p, c.net, fastOpts().Retry)
		c.agents = append(c.agents, a)
		c.net.Register(p.name, a.Handle)
	}
	return c
}

// TestPortsAcrossNodes: the coordinator gathers every node's ports and
// hands them to every node; a node that left a connection holding bytes
// out as a program's own, whose far port turns out to be the job's after
// the freeze, keeps the pause from committing on that report: it thaws,
// drains the connection and commits. A program's own connection to a port
// no node has does not hold the pause.
func TestPortsAcrossNodes(t *testing.T) {
	a := &peeredNode{fakeNode: newFake("a"), mine: Ports{5000}, far: 7000}
	b := &peeredNode{fakeNode: newFake("b"), mine: Ports{6000}, late: Ports{7000}}
	own := &peeredNode{fakeNode: newFake("c"), mine: Ports{6001}, far: 5432}
	c := peeredCluster(a, b, own)
	defer c.net.Close()
	res, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
	if err != nil {
		t.Fatalf("pause: %v", err)
	}
	var phases []Kind
	for _, p := range res.Phases {
		phases = append(phases, p.Phase)
	}
	if got := kinds(phases); got != "PREPARE DRAIN FREEZE VERIFY THAW DRAIN FREEZE VERIFY COMMIT" {
		t.Errorf("phases %s; want one more drain, for the connection left out", got)
	}
	if e := res.Phases[3].Err; !strings.Contains(e, "port 7000") {
		t.Errorf("the first VERIFY failed with %q, want it to name port 7000", e)
	}
	checkPaused(t, c)
	if !a.drained || own.drained {
		t.Errorf("drained a's connection to the job's port: %v, c's to a port of no node: %v; want true, false", a.drained, own.drained)
	}
	if first := a.told[0]; !slices.Equal(first, Ports{5000, 6000, 6001}) {
		t.Errorf("the first DRAIN gave the nodes %v, want every node's PREPARE ports", first)
	}
}
