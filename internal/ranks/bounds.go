package ranks

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/mpipause/mpipause/internal/jobid"
)

// What one uid, and all of them, can make mpid hold through the rank
// socket: registered ranks, first lines pending, and the host lists of
// rank 0s. Past a bound a HELLO is refused with the reason in its error.

// MaxRanksPerUID is the default bound on one uid's registered ranks on a
// node: each holds a connection, a goroutine and a pidfd in mpid. Far above
// any node's cores times its jobs, far below what would exhaust mpid.
const MaxRanksPerUID = 4096

// hold counts a HELLO of uid in, or refuses it past the bound.
func (s *Server) hold(uid uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	max := cmp.Or(s.MaxPerUID, MaxRanksPerUID)
	if s.held[uid] >= max {
		return fmt.Errorf("uid %d has %d ranks registered on this node, the most one user may have: let some end first", uid, max)
	}
	if s.held == nil {
		s.held = map[uint32]int{}
	}
	s.held[uid]++
	return nil
}

// A job's host list, as rank 0 sends it, is kept once a job; these bound
// what the lists of one uid, and of all, hold on a node. A HELLO past a
// bound is refused, its reason in the rank's error.
const (
	// MaxHosts: a job's list names at most this many hosts.
	MaxHosts = 16384
	// MaxHostsBytes: a job's list is at most this long (10,000 names of
	// 64 bytes fit).
	MaxHostsBytes = 640 << 10
	// MaxHostsPerUID: the lists of one uid's jobs on a node, together.
	MaxHostsPerUID = 4 << 20
	// MaxHostsTotal: the lists of every job on a node, together.
	MaxHostsTotal = 64 << 20
)

// hostList is one job's host list and the rank 0 registrations sharing it.
type hostList struct {
	hosts []string
	cost  int // what it holds: its names and one string header a name
	refs  int
}

// hostsCost is what a host list holds in mpid.
func hostsCost(hosts []string) int {
	n := 0
	for _, h := range hosts {
		n += len(h) + 16
	}
	return n
}

// keepHosts keeps rank 0's host list as its job's, the one copy all of the
// job's rank 0 registrations share, or refuses it past a bound or when the
// job has another list already.
func (s *Server) keepHosts(r *Rank) error {
	if r.Hosts == nil {
		return nil
	}
	key := r.JobKey()
	s.mu.Lock()
	defer s.mu.Unlock()
	if l := s.hosts[key]; l != nil {
		if !slices.Equal(l.hosts, r.Hosts) {
			return fmt.Errorf("rank 0 of job %s sent a host list other than the one its rank 0 registered with already", r.Job)
		}
		l.refs++
		r.Hosts = l.hosts
		return nil
	}
	cost := hostsCost(r.Hosts)
	if s.hostBytes[r.UID]+cost > MaxHostsPerUID {
		return fmt.Errorf("uid %d's jobs on this node hold %d bytes of host lists; rank 0 of job %s would add %d, past the %d one user may: let some jobs end first", r.UID, s.hostBytes[r.UID], r.Job, cost, MaxHostsPerUID)
	}
	if s.hostTotal+cost > MaxHostsTotal {
		return fmt.Errorf("the jobs on this node hold %d bytes of host lists; rank 0 of job %s would add %d, past the %d mpid keeps", s.hostTotal, r.Job, cost, MaxHostsTotal)
	}
	if s.hosts == nil {
		s.hosts, s.hostBytes = map[string]*hostList{}, map[uint32]int{}
	}
	s.hosts[key] = &hostList{hosts: r.Hosts, cost: cost, refs: 1}
	s.hostBytes[r.UID] += cost
	s.hostTotal += cost
	return nil
}

// dropHosts lets go of r's share of its job's host list.
func (s *Server) dropHosts(r *Rank) {
	if r.Hosts == nil {
		return
	}
	key := r.JobKey()
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.hosts[key]
	if l == nil {
		return
	}
	if l.refs--; l.refs > 0 {
		return
	}
	delete(s.hosts, key)
	if s.hostBytes[r.UID] -= l.cost; s.hostBytes[r.UID] <= 0 {
		delete(s.hostBytes, r.UID)
	}
	s.hostTotal -= l.cost
}

// HostsHeld is what the host lists of uid's jobs hold on this node, and
// of all jobs.
func (s *Server) HostsHeld(uid uint32) (lists, bytes, total int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k := range s.hosts {
		if u, _, ok := jobid.SplitKey(k); ok && u == uid {
			lists++
		}
	}
	return lists, s.hostBytes[uid], s.hostTotal
}

func (s *Server) release(uid uint32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held[uid]--; s.held[uid] <= 0 {
		delete(s.held, uid)
	}
}

// MaxPendingPerUID bounds, per uid, the connections that wait for their
// first line (each up to 10 s). A shim writes its line right after its
// connect(), so its line is there when mpid reads; past the bound a
// connection is served only if its whole line is there already, and closed
// at once if not.
const MaxPendingPerUID = 16
