package quiesce

import "slices"

// Ports is a set of TCP port numbers, sorted, without repeats: the local
// ports of a job's sockets. A node's kernel tells it which of its job's
// connections to another host end in a socket of the job only by these
// ports gathered from every node: a rank's connection to a server of its
// own elsewhere (a database, a monitoring collector) ends in a port no
// socket of the job has, and its bytes are the program's to read, not the
// drain's (docs/protocol.md, "Which connections are the job's"). Ports
// rather than addresses and ports bound the set (65,536 numbers, however
// large the job); a port that two hosts share makes a connection count as
// the job's, which costs a drain, never a byte.
type Ports []uint16

// PortsOf returns the set of the ports in ps (which it sorts).
func PortsOf(ps []uint16) Ports {
	slices.Sort(ps)
	return Ports(slices.Compact(ps))
}

// Has reports whether port is in p.
func (p Ports) Has(port uint16) bool {
	_, ok := slices.BinarySearch(p, port)
	return ok
}

// Union returns the ports in p or o. It returns p itself when o adds
// nothing, so that a round that finds no new port copies nothing.
func (p Ports) Union(o Ports) Ports {
	if len(o) == 0 {
		return p
	}
	if len(p) == 0 {
		return slices.Clone(o)
	}
	out := make(Ports, 0, len(p)+len(o))
	i, j := 0, 0
	for i < len(p) && j < len(o) {
		switch {
		case p[i] < o[j]:
			out = append(out, p[i])
			i++
		case p[i] > o[j]:
			out = append(out, o[j])
			j++
		default:
			out = append(out, p[i])
			i, j = i+1, j+1
		}
	}
	out = append(append(out, p[i:]...), o[j:]...)
	if len(out) == len(p) {
		return p
	}
	return out
}

// Meets returns a port in both p and o, if there is one.
func (p Ports) Meets(o Ports) (uint16, bool) {
	for _, x := range o {
		if p.Has(x) {
			return x, true
		}
	}
	return 0, false
}

// Peered is a Node that tells its job's connections to other hosts from a
// program's own by the job's ports on every node (see Ports). The agent
// asks it for its own ports after every step that reads the kernel
// (PREPARE, DRAIN, VERIFY: NodeReport.Ports) and, before DRAIN, FREEZE and
// VERIFY, tells it every node's as the pause has gathered them so far
// (Message.Ports). A Node without it reports every connection it has.
type Peered interface {
	// Ports returns the local ports of the job's sockets on this node as
	// its last step found them.
	Ports(job string) Ports
	// Peers gives the node the job's ports on every node.
	Peers(job string, all Ports)
}
