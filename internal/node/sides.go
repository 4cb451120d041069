package node

import (
	"net"
	"net/netip"
	"slices"

	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// Which of the connections in a job's cgroup are the job's own, drained
// and checked, and which are a program's own servers or not known yet
// (docs/protocol.md, "Which connections are the job's").

// side is whose a connection of the job's cgroup is, as far as the node
// can tell: the job's (its other end is a socket of the job: drained, and
// checked), the program's own (a server of its own: neither), or not known
// yet (to another host, before the coordinator has sent the job's ports:
// checked, but not drained, the drain having no right to its bytes).
type side int

const (
	sideJob side = iota
	sideOwn
	sideUnknown
)

// sides tells, for one kernel read of the job's connections, whose each
// one is (docs/protocol.md, "Which connections are the job's").
type sides struct {
	here  map[netip.Addr]bool
	peers quiesce.Ports
	ends  map[netip.AddrPort]bool // local ends of the job's sockets here
}

func newSides(d *drainSet, conns []loader.Conn) sides {
	s := sides{here: d.here, peers: d.peers, ends: make(map[netip.AddrPort]bool, len(conns))}
	for _, c := range conns {
		s.ends[unmap(c.Local)] = true
	}
	return s
}

// of says whose c is. Its other end on this node (loopback, or an address
// in here) is the job's only if that end is a socket of the job too: the
// kernel read shows them all. On another host it is the job's if its port
// is a port of the job's sockets on some node (quiesce.Ports).
func (s sides) of(c loader.Conn) side {
	r := unmap(c.Remote)
	switch {
	case r.Addr().IsLoopback() || s.here[r.Addr()]:
		if s.ends[r] {
			return sideJob
		}
		return sideOwn
	case s.peers == nil:
		return sideUnknown
	case s.peers.Has(r.Port()):
		return sideJob
	}
	return sideOwn
}

// jobConns returns the cookies of the job's connections in conns (this
// node's, from the job's observer: sockets of the job's cgroup): the only
// ones a rank's shim may drain.
func (s sides) jobConns(conns []loader.Conn) []uint64 {
	var out []uint64
	for _, c := range conns {
		if c.State == loader.StateListen || c.Cookie == 0 || s.of(c) != sideJob {
			continue
		}
		out = append(out, c.Cookie)
	}
	slices.Sort(out)
	return out
}

// checked leaves out of conns the program's own connections: the drain
// takes nothing from them, so the check that every job connection is empty
// must not wait for them either. own are the remote ports of those to
// another host that hold bytes, which the coordinator holds against every
// node's ports after the freeze (quiesce.Report.Own).
func (s sides) checked(conns []loader.Conn) (out []loader.Conn, own quiesce.Ports) {
	out = conns[:0:0]
	var far []uint16
	for _, c := range conns {
		if c.State == loader.StateListen || s.of(c) != sideOwn {
			out = append(out, c)
			continue
		}
		if r := unmap(c.Remote); !r.Addr().IsLoopback() && !s.here[r.Addr()] && !c.Empty() {
			far = append(far, r.Port())
		}
	}
	return out, quiesce.PortsOf(far)
}

// sidesOf returns the job's drainSet (made anew at PREPARE, when first)
// with mine read from conns, and the sides of conns.
func (l *Role) sidesOf(job string, conns []loader.Conn, first bool) (*drainSet, sides) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.drains == nil {
		l.drains = map[string]*drainSet{}
	}
	d := l.drains[job]
	if d == nil || first {
		d = &drainSet{here: nodeAddrs(conns)}
		l.drains[job] = d
	}
	ports := make([]uint16, 0, len(conns))
	for _, c := range conns {
		ports = append(ports, c.Local.Port())
	}
	d.mine = quiesce.PortsOf(ports)
	return d, newSides(d, conns)
}

// Ports is quiesce.Peered's: the job's ports here at the last kernel read.
func (l *Role) Ports(job string) quiesce.Ports {
	l.mu.Lock()
	defer l.mu.Unlock()
	if d := l.drains[job]; d != nil {
		return d.mine
	}
	return nil
}

// Peers is quiesce.Peered's: the job's ports on every node.
func (l *Role) Peers(job string, all quiesce.Ports) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if d := l.drains[job]; d != nil {
		d.peers = all
	}
}

var _ quiesce.Peered = (*Role)(nil)

// nodeAddrs is the set of this node's addresses: its interfaces' (mpid
// runs in the node's network namespace) and the local ends of the job's
// connections (a rank in a namespace of its own).
func nodeAddrs(conns []loader.Conn) map[netip.Addr]bool {
	here := map[netip.Addr]bool{}
	if as, err := net.InterfaceAddrs(); err == nil {
		for _, a := range as {
			if p, err := netip.ParsePrefix(a.String()); err == nil {
				here[p.Addr().Unmap()] = true
			}
		}
	}
	for _, c := range conns {
		here[unmap(c.Local).Addr()] = true
	}
	return here
}

func unmap(a netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(a.Addr().Unmap(), a.Port()) }
