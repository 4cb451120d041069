// Package ranks is mpid's end of the rank channel: the unix socket on which
// the shim (libmpipause.so) of every MPI rank of the node registers after
// MPI_Init, and through which mpid closes, inspects and reopens the rank's
// send gate. The protocol is text lines; libmpi-shim/rankchan.c is the other
// end and docs/mpid.md, "Rank channel", describes both.
//
// A rank is authenticated by the kernel, not by what it says: the pid in its
// HELLO must be the pid SO_PEERCRED reports for the connection. A rank that
// exits or crashes is gone when its connection closes.
//
// Before all that, from the shim's constructor (before main, so before
// MPI_Init creates any socket), a rank of a named job may send one JOIN
// line on a connection of its own, asking to be moved into the job's
// cgroup: the kernel charges a socket to the cgroup of the process that
// creates it, at creation, for good, and mpid watches a job's sockets by
// cgroup. mpid answers OK or ERR and closes that connection; a JOIN does not
// register a rank.
package ranks

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/accept"
	"github.com/mpipause/mpipause/internal/jobid"
)

// DefaultAddr is where the shim looks for mpid unless MPIPAUSE_MPID_SOCKET
// says otherwise: a path in a directory only root may write, so that no
// user can serve it in mpid's place while mpid is down (an abstract name
// can be bound by anyone).
const DefaultAddr = "/run/mpipause/rank.sock"

// ErrGone: the rank's connection closed (it finalized, exited or crashed).
var ErrGone = errors.New("rank is gone")

// Rank is one registered MPI process.
type Rank struct {
	Job  string `json:"job"`
	Rank int    `json:"rank"`
	Size int    `json:"size"`
	Pid  int    `json:"pid"`
	UID  uint32 `json:"uid"`
	Host string `json:"host"`
	// Hosts: rank 0 only, the job's hosts. One copy a job, shared by its
	// rank 0 registrations (Server.keepHosts), bounded (MaxHosts,
	// MaxHostsBytes, MaxHostsPerUID, MaxHostsTotal).
	Hosts []string `json:"hosts,omitempty"`
	Root  string   `json:"root,omitempty"` // the host of rank 0 (a cross-check: the job key names the coordinator)
	// Key is the job key the launcher gave the rank (MPIPAUSE_JOBKEY): a
	// secret, so never marshalled.
	Key string `json:"-"`

	conn *net.UnixConn
	page *statePage // nil if the shim sent none
	proc *Proc      // the registered process, for the registration's life
	mu   sync.Mutex // one request at a time
	owed int        // replies still due to requests given up on (under mu)
	// full is the shim's last "EVENT stash full" since ClearStashFull.
	full atomic.Pointer[StashFull]
	// unheld is the shim's "EVENT unheld" reports since ClearStashFull, the
	// first MaxUnheld, however many a rank sends.
	unheldMu sync.Mutex
	unheld   []Unheld
	replies  chan string
	gone     chan struct{}
}

// Gate is a rank's send gate as its shim reports it.
type Gate struct {
	State   string `json:"state"`   // open, closed, flushing
	Gated   int    `json:"gated"`   // sockets at a call boundary under the closed gate
	Closing int    `json:"closing"` // sockets still mid-message
	Held    uint64 `json:"held"`    // bytes held in the shim
}

// Server accepts ranks on one unix socket. Set its hooks before Serve.
type Server struct {
	// Admit, if set, decides whether a rank that passed the credential
	// check may register (mpid: is its pid in the job's cgroup?).
	Admit func(*Rank) error
	// OnChange, if set, is told of every rank that registers (gone false)
	// or goes away (gone true), and of refused connections (r nil, err).
	OnChange func(r *Rank, gone bool, err error)
	// OnEvent, if set, is told what a rank asks for unasked: "pause" when
	// it got SIGTSTP, "resume" when it got SIGCONT (ParseRequest), and
	// the outcome of a flush (ParseFlushed). It runs on the rank's
	// reader: it must not make requests to that rank itself.
	OnEvent func(r *Rank, event string)
	// Join, if set, acts on a JOIN: process p (p.Pid and p.UID from
	// SO_PEERCRED, the pid also the one the line names; p holds its pidfd,
	// taken at accept) asks to be moved into the cgroup of job, before it
	// has created any socket (mpid: check the job and the user, then
	// p.MoveTo the job's cgroup, never a write of the bare pid). p is alive
	// when Join is called and is closed when Join returns: Join must not
	// keep it. A nil return answers OK; an error answers ERR with its
	// text, which the rank prints. The shim waits 2 s for the answer, then
	// runs on unjoined. Without Join every JOIN is refused ("joining is not
	// supported here"). Refused JOINs also go to OnChange (r nil, err).
	Join func(JoinRequest) error

	// MaxPerUID bounds the registered ranks of one uid (0:
	// MaxRanksPerUID); a HELLO past it is refused before Admit.
	MaxPerUID int

	// Limits bound the connections open at once, per uid (its Key is
	// accept.UIDKey unless set) and in all, before a line is read; Serve
	// waits out accept errors (accept.Listener).
	Limits accept.Options

	// pending counts, per uid, the connections whose first line has not
	// arrived yet; held, the registered ranks and the HELLOs being
	// admitted (both under mu).
	pending map[uint32]int
	held    map[uint32]int
	// hosts is each job's host list (one, however many of its rank 0s
	// registered); hostBytes what they hold per uid, hostTotal in all
	// (under mu).
	hosts     map[string]*hostList
	hostBytes map[uint32]int
	hostTotal int

	ln      net.Listener
	mu      sync.Mutex
	ranks   []*Rank
	changed chan struct{} // closed and replaced at every change of ranks
	// left is, per job key, the ranks whose channel closed and that have
	// not registered again (Left), until Forget.
	left map[string]map[int]Departed
}

// Departed is a rank whose channel to mpid closed: Rank of its job, Pid
// its process.
type Departed struct{ Rank, Pid int }

// JoinRequest is a JOIN as the kernel and the line vouch for it: Proc is
// the process that connected (its pid, from SO_PEERCRED, equal to the
// line's; its uid; its pidfd, alive when Join is called and closed when it
// returns), Job and Key come from the line (Key is still to be checked).
type JoinRequest struct {
	Job  string
	Key  string
	Proc *Proc
}

// JobKey is where a job lives in mpid: a user's job ids are that user's
// namespace, so uid 1001's "4243.0" is another job than uid 1002's and
// neither can name the other's (docs/security.md).
func JobKey(uid uint32, id string) string { return strconv.FormatUint(uint64(uid), 10) + ":" + id }

// SplitJobKey is JobKey's inverse.
func SplitJobKey(key string) (uid uint32, id string, ok bool) {
	u, id, ok := strings.Cut(key, ":")
	n, err := strconv.ParseUint(u, 10, 32)
	if !ok || err != nil || u == "" || (len(u) > 1 && u[0] == '0') || !jobid.Valid(id) {
		return 0, "", false
	}
	return uint32(n), id, true
}

// JobKey is the key of the rank's job: its own uid's namespace.
func (r *Rank) JobKey() string { return JobKey(r.UID, r.Job) }

// Listen opens the rank socket at addr: "@name" for an abstract socket,
// else a path.
func Listen(addr string) (*Server, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: addr, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("rank socket %s: %w", addr, err)
	}
	return NewServer(ln), nil
}

// NewServer serves ranks on ln (for a listener made elsewhere, e.g. inside
// another network namespace).
func NewServer(ln *net.UnixListener) *Server {
	s := &Server{changed: make(chan struct{})}
	if ln != nil {
		s.ln = ln
	}
	return s
}

// Serve accepts ranks until ctx ends, then closes the listener and every
// rank connection.
func (s *Server) Serve(ctx context.Context) error {
	o := s.Limits
	if o.Key == nil {
		o.Key = accept.UIDKey
	}
	ln := accept.New(s.ln, o)
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	err := ln.ServeUnix(s.handshake)
	s.mu.Lock()
	for _, r := range s.ranks {
		r.conn.Close()
	}
	s.mu.Unlock()
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func (s *Server) handshake(c *net.UnixConn) {
	// The pidfd first, before anything is read: the process that connected,
	// whatever holds its pid number by the time its line comes.
	proc, err := peerProc(c)
	var f firstLine
	if err == nil {
		f, err = s.first(c, proc)
	}
	if err == nil && isJoin(f.line) {
		f.page.close() // a JOIN carries no state page
		s.join(c, f)
		proc.Close()
		return
	}
	var r *Rank
	if err == nil {
		r, err = hello(c, f)
	}
	held := false
	if err == nil {
		if err = s.hold(r.UID); err == nil {
			held = true
		} else {
			r.page.close()
		}
	}
	kept := false
	if err == nil {
		if err = s.keepHosts(r); err == nil {
			kept = true
		} else {
			r.page.close()
		}
	}
	if err == nil && s.Admit != nil {
		if err = s.Admit(r); err != nil {
			r.page.close()
		}
	}
	if err != nil {
		if kept {
			s.dropHosts(r)
		}
		if held {
			s.release(r.UID)
		}
		c.Close()
		proc.Close()
		if s.OnChange != nil {
			s.OnChange(nil, false, err)
		}
		return
	}
	if s.OnChange != nil {
		s.OnChange(r, false, nil)
	}
	s.mu.Lock()
	s.ranks = append(s.ranks, r)
	delete(s.left[r.JobKey()], r.Rank)
	s.notifyLocked()
	s.mu.Unlock()
	cut := r.read(bufio.NewReaderSize(c, MaxRankLine), s.OnEvent)
	s.mu.Lock()
	s.ranks = slices.DeleteFunc(s.ranks, func(x *Rank) bool { return x == r })
	if !slices.ContainsFunc(s.ranks, func(x *Rank) bool { return x.JobKey() == r.JobKey() && x.Rank == r.Rank }) {
		if s.left == nil {
			s.left = map[string]map[int]Departed{}
		}
		if s.left[r.JobKey()] == nil {
			s.left[r.JobKey()] = map[int]Departed{}
		}
		// A job's own process can register under any rank number and hang
		// up, again and again: as many departures are kept as one uid may
		// have ranks registered, no more. A rank past that is still found
		// gone by the registry's count and the kernel (internal/node).
		if l := s.left[r.JobKey()]; len(l) < cmp.Or(s.MaxPerUID, MaxRanksPerUID) {
			l[r.Rank] = Departed{Rank: r.Rank, Pid: r.Pid}
		}
	}
	s.notifyLocked()
	s.mu.Unlock()
	s.dropHosts(r)
	s.release(r.UID)
	r.proc.Close()
	if s.OnChange != nil {
		s.OnChange(r, true, cut)
	}
}

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
		if u, _, ok := SplitJobKey(k); ok && u == uid {
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

func (s *Server) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// firstLine is a connection's first line, the peer process and the state
// page the first byte brought, if any.
type firstLine struct {
	line string
	proc *Proc
	page *statePage
	perr error // the attached fd was not a valid state page
}

// MaxPendingPerUID bounds, per uid, the connections that wait for their
// first line (each up to 10 s). A shim writes its line right after its
// connect(), so its line is there when mpid reads; past the bound a
// connection is served only if its whole line is there already, and closed
// at once if not.
const MaxPendingPerUID = 16

// first reads a connection's first line, waiting for it (10 s at most)
// unless the peer's uid has MaxPendingPerUID connections waiting already.
func (s *Server) first(c *net.UnixConn, p *Proc) (firstLine, error) {
	s.mu.Lock()
	if s.pending == nil {
		s.pending = map[uint32]int{}
	}
	wait := s.pending[p.UID] < MaxPendingPerUID
	if wait {
		s.pending[p.UID]++
	}
	s.mu.Unlock()
	if wait {
		defer func() {
			s.mu.Lock()
			if s.pending[p.UID]--; s.pending[p.UID] == 0 {
				delete(s.pending, p.UID)
			}
			s.mu.Unlock()
		}()
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	f, err := readFirst(c, wait)
	if errors.Is(err, unix.EAGAIN) {
		return f, fmt.Errorf("uid %d has %d rank connections waiting for their first line already; closed one more whose line was not there", p.UID, MaxPendingPerUID)
	}
	f.proc = p
	return f, err
}

// maxFirstLine bounds a HELLO: rank 0's lists every host of the job, 64
// bytes at most each, so a 10,000-node job fits. What is held grows only
// with what the peer has sent, and MaxPendingPerUID bounds how many lines
// a user has mpid read at once.
const maxFirstLine = 1 << 20

// readFirst reads the first line without consuming anything after it (the
// rank's replies, which the buffered reader of read takes): it peeks at
// what has arrived and takes up to the newline. The first byte comes with
// the state page's fd, if the shim sent one. Without wait, a line that has
// not fully arrived is an EAGAIN.
func readFirst(c *net.UnixConn, wait bool) (firstLine, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return firstLine{}, err
	}
	recv := func(op func(fd int) (int, error)) (int, error) {
		var n int
		var oerr error
		err := raw.Read(func(fd uintptr) bool {
			n, oerr = op(int(fd))
			return !wait || !errors.Is(oerr, unix.EAGAIN)
		})
		if err != nil {
			return 0, err
		}
		if oerr == nil && n == 0 {
			return 0, io.EOF
		}
		return n, oerr
	}
	one := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(2*4))
	var oobn int
	if _, err := recv(func(fd int) (n int, err error) {
		n, oobn, _, _, err = unix.Recvmsg(fd, one, oob, unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
		return n, err
	}); err != nil {
		return firstLine{}, fmt.Errorf("HELLO: %w", err)
	}
	page, perr := receivePage(oob[:oobn])
	b := []byte{one[0]}
	buf := make([]byte, 4096)
	for b[len(b)-1] != '\n' {
		if len(b) >= maxFirstLine {
			page.close()
			return firstLine{}, errors.New("first line too long")
		}
		want := min(len(buf), maxFirstLine-len(b))
		n, err := recv(func(fd int) (int, error) {
			n, _, err := unix.Recvfrom(fd, buf[:want], unix.MSG_PEEK|unix.MSG_DONTWAIT)
			return n, err
		})
		if err == nil {
			if i := bytes.IndexByte(buf[:n], '\n'); i >= 0 {
				n = i + 1
			}
			n, err = recv(func(fd int) (int, error) { return unix.Read(fd, buf[:n]) })
		}
		if err != nil {
			page.close()
			return firstLine{}, err
		}
		b = append(b, buf[:n]...)
	}
	return firstLine{line: string(b[:len(b)-1]), page: page, perr: perr}, nil
}

// hello checks a HELLO first line.
func hello(c *net.UnixConn, f firstLine) (*Rank, error) {
	page, proc := f.page, f.proc
	r, err := ParseHello(f.line)
	if err != nil {
		page.close()
		return nil, err
	}
	if f.perr != nil {
		page.close()
		return nil, fmt.Errorf("rank %d (pid %d): state page: %w", r.Rank, r.Pid, f.perr)
	}
	if r.Pid != proc.Pid {
		page.close()
		return nil, fmt.Errorf("rank says pid %d, the kernel says %d", r.Pid, proc.Pid)
	}
	if err := proc.Alive(); err != nil {
		page.close()
		return nil, fmt.Errorf("rank %d (pid %d): %w", r.Rank, r.Pid, err)
	}
	r.page = page
	r.UID = proc.UID
	r.proc = proc
	r.conn = c
	// Room for the replies owed to callers that gave up (see request); a
	// shim that answers more than it was asked is cut off.
	r.replies = make(chan string, maxOwed)
	r.gone = make(chan struct{})
	return r, nil
}

// isJoin: the first line is a JOIN (well formed or not), not a HELLO.
func isJoin(line string) bool {
	verb, _, _ := strings.Cut(line, " ")
	return verb == "JOIN"
}

// join answers a JOIN (OK or ERR <reason>) and closes the connection.
func (s *Server) join(c *net.UnixConn, f firstLine) {
	defer c.Close()
	job, pid, key, err := ParseJoin(f.line)
	p := f.proc
	switch {
	case err != nil:
	case pid != p.Pid:
		err = errors.New("pid does not match the connection's credentials")
	case s.Join == nil:
		err = errors.New("joining is not supported here")
	default:
		// A JOIN of a process that has exited is refused even though
		// its line names its pid: the number may be another's by now.
		if err = p.Alive(); err == nil {
			err = s.Join(JoinRequest{Job: job, Key: key, Proc: p})
		}
	}
	reply := "OK\n"
	if err != nil {
		reply = "ERR " + oneLine(err.Error()) + "\n"
	}
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	c.Write([]byte(reply)) // a rank that gave up waiting has gone: nothing to do
	if err != nil && s.OnChange != nil {
		s.OnChange(nil, false, fmt.Errorf("JOIN from pid %d (uid %d) refused: %w", p.Pid, p.UID, err))
	}
}

// oneLine makes s fit an ERR line: printable ASCII, at most 200 bytes,
// never empty.
func oneLine(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c < ' ' || c > '~' {
			b[i] = ' '
		}
	}
	s = strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200]
	}
	if s == "" {
		s = "refused"
	}
	return s
}

// JoinVersion and HelloVersion are the line formats mpid speaks; a shim of
// another release is refused with a reason that says so.
const (
	JoinVersion  = "2"
	HelloVersion = "2"
)

// MaxKey bounds a job key: a node name (253) and ':' and 64 hex digits.
const MaxKey = 320

// validKey: what a key= field may hold (checked for real by mpid, with the
// cluster key): printable ASCII without spaces or '='.
func validKey(v string) bool {
	if len(v) == 0 || len(v) > MaxKey {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c <= ' ' || c > '~' || c == '=' {
			return false
		}
	}
	return true
}

// ParseJoin parses "JOIN 2 job=<id> pid=<pid> key=<job key>" (one trailing
// newline allowed): exactly these fields, each once, single spaces. A job
// id is 1 to jobid.MaxLen printable ASCII characters other than '=' (so no
// spaces and no control characters); pid is a positive decimal without
// sign or leading zeros; the key is what the launcher gave the rank.
func ParseJoin(line string) (job string, pid int, key string, err error) {
	f := strings.Split(strings.TrimSuffix(line, "\n"), " ")
	if len(f) < 2 || f[0] != "JOIN" {
		return "", 0, "", fmt.Errorf("not a JOIN: %q", line)
	}
	if f[1] != JoinVersion {
		return "", 0, "", fmt.Errorf("JOIN version %q, this mpid speaks %s: the rank's shim is of another mpipause release; relaunch the job with this one", f[1], JoinVersion)
	}
	if len(f) != 5 {
		return "", 0, "", fmt.Errorf("JOIN wants job=, pid= and key=, got %q (launch the job with `mpipause run`, which gives its ranks their job key)", line)
	}
	var haveJob, havePid, haveKey bool
	for _, kv := range f[2:] {
		k, v, _ := strings.Cut(kv, "=")
		switch {
		case k == "job" && !haveJob:
			if !jobid.Valid(v) {
				return "", 0, "", fmt.Errorf("JOIN job id %q: %s", v, jobid.Rule)
			}
			job, haveJob = v, true
		case k == "pid" && !havePid:
			n, perr := strconv.ParseInt(v, 10, 32)
			if perr != nil || n <= 0 || v[0] == '0' || v[0] == '+' {
				return "", 0, "", fmt.Errorf("JOIN pid %q", v)
			}
			pid, havePid = int(n), true
		case k == "key" && !haveKey:
			if !validKey(v) {
				return "", 0, "", errors.New("JOIN key malformed")
			}
			key, haveKey = v, true
		default:
			return "", 0, "", fmt.Errorf("JOIN field %q", kv)
		}
	}
	return job, pid, key, nil
}

// ParseHello parses "HELLO 2 job=... rank=... size=... pid=... host=...
// key=... [root=h] [hosts=a,b]".
func ParseHello(line string) (*Rank, error) {
	f := strings.Fields(line)
	if len(f) < 2 || f[0] != "HELLO" {
		return nil, fmt.Errorf("not a HELLO: %q", line)
	}
	if f[1] != HelloVersion {
		return nil, fmt.Errorf("HELLO version %q, this mpid speaks %s: the rank's shim is of another mpipause release; relaunch the job with this one", f[1], HelloVersion)
	}
	r := &Rank{Rank: -1}
	seen := map[string]bool{}
	var hosts string
	for _, kv := range f[2:] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || seen[k] {
			return nil, fmt.Errorf("HELLO field %q", kv)
		}
		seen[k] = true
		var err error
		switch k {
		case "job":
			r.Job = v
		case "rank":
			r.Rank, err = strconv.Atoi(v)
		case "size":
			r.Size, err = strconv.Atoi(v)
		case "pid":
			r.Pid, err = strconv.Atoi(v)
		case "host":
			r.Host = v
		case "hosts":
			hosts = v
		case "root":
			r.Root = v
		case "key":
			if !validKey(v) {
				return nil, errors.New("HELLO key malformed")
			}
			r.Key = v
		}
		if err != nil {
			return nil, fmt.Errorf("HELLO field %q: %w", kv, err)
		}
	}
	if r.Job == "" || r.Pid <= 0 {
		return nil, fmt.Errorf("HELLO without job or pid: %q", line)
	}
	// Copies: a substring would keep the whole line (up to maxFirstLine)
	// for as long as the rank is registered.
	r.Job, r.Host, r.Root, r.Key = strings.Clone(r.Job), strings.Clone(r.Host), strings.Clone(r.Root), strings.Clone(r.Key)
	if r.Key == "" {
		return nil, errors.New("HELLO without a job key: launch the job with `mpipause run`, which gives its ranks their job key")
	}
	// The same rules as everywhere a job id or rank comes in: what mpid
	// builds paths and reports from must hold whatever a process sends.
	if !jobid.Valid(r.Job) {
		return nil, fmt.Errorf("HELLO job id %q: %s", r.Job, jobid.Rule)
	}
	if r.Size <= 0 || r.Rank < 0 || r.Rank >= r.Size {
		return nil, fmt.Errorf("HELLO rank %d of size %d", r.Rank, r.Size)
	}
	// Only rank 0's list is read (coordinator's cross-check); any other
	// rank's is neither checked nor kept.
	if seen["hosts"] && r.Rank == 0 {
		if len(hosts) > MaxHostsBytes {
			return nil, fmt.Errorf("HELLO hosts= of %d bytes: mpid keeps at most %d bytes of a job's host list", len(hosts), MaxHostsBytes)
		}
		if n := strings.Count(hosts, ",") + 1; n > MaxHosts {
			return nil, fmt.Errorf("HELLO hosts= of %d names: mpid keeps at most %d hosts of a job", n, MaxHosts)
		}
		// A copy of its own: the line it came in goes.
		r.Hosts = strings.Split(strings.Clone(hosts), ",")
	}
	// Host names become node names, peers' addresses and lines in root's
	// terminal: only what a host name may be.
	names := map[string][]string{"host": {r.Host}, "root": {r.Root}, "hosts": r.Hosts}
	for _, k := range []string{"host", "root", "hosts"} {
		for _, h := range names[k] {
			if seen[k] && !ValidHostName(h) {
				return nil, fmt.Errorf("HELLO %s %q: %s", k, h, HostNameRule)
			}
		}
	}
	return r, nil
}

// HostNameRule says what ValidHostName accepts, for error messages.
const HostNameRule = "want a host name (RFC 1123): labels of 1 to 63 letters, digits and '-', not starting or ending with '-', joined by dots, 253 characters at most"

// ValidHostName is the one rule for the names of nodes (HELLO's host=,
// root= and hosts=, mpid's --node): an RFC 1123 host name.
func ValidHostName(s string) bool {
	if len(s) == 0 || len(s) > 253 {
		return false
	}
	for _, l := range strings.Split(s, ".") {
		if len(l) == 0 || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
			return false
		}
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}

// MaxRankLine bounds a line from a registered rank (replies and events,
// some tens of bytes): a longer one cuts the rank off.
const MaxRankLine = 4096

// read delivers the rank's reply lines until its connection closes, and
// says why it cut the rank off, if it did (nil when the rank hung up). br
// holds MaxRankLine bytes: what a rank sends never takes more.
func (r *Rank) read(br *bufio.Reader, onEvent func(*Rank, string)) error {
	defer close(r.gone)
	defer r.conn.Close()
	defer r.page.close()
	for {
		b, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			return fmt.Errorf("rank %d (pid %d, uid %d) of job %s sent a line longer than %d bytes; cut off", r.Rank, r.Pid, r.UID, r.Job, MaxRankLine)
		}
		if err != nil {
			return nil
		}
		line := string(b)
		if ev, ok := strings.CutPrefix(line, "EVENT "); ok {
			if f, err := ParseStashFull(strings.TrimSpace(ev)); err == nil {
				r.full.Store(&f)
				continue
			}
			if u, err := ParseUnheld(strings.TrimSpace(ev)); err == nil {
				r.noteUnheld(u)
				continue
			}
			if onEvent != nil {
				onEvent(r, strings.TrimSpace(ev))
			}
			continue
		}
		select {
		case r.replies <- strings.TrimSuffix(line, "\n"):
		default:
			return fmt.Errorf("rank %d (pid %d, uid %d) of job %s answered more than it was asked; cut off", r.Rank, r.Pid, r.UID, r.Job)
		}
	}
}

// Ranks returns the ranks of the job with that key (JobKey) registered
// now, by rank; all ranks for "".
func (s *Server) Ranks(key string) []*Rank {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*Rank
	for _, r := range s.ranks {
		if key == "" || r.JobKey() == key {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b *Rank) int { return a.Rank - b.Rank })
	return out
}

// Left returns the ranks of the job with that key whose channel closed
// (the process exited, was killed, or called MPI_Finalize) and that have
// not registered again since, by rank. A pause must know them: by the time
// it reaches this node such a rank is no longer among Ranks, and the
// node's part of the job would look whole without it.
func (s *Server) Left(key string) []Departed {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Departed
	for _, d := range s.left[key] {
		out = append(out, d)
	}
	slices.SortFunc(out, func(a, b Departed) int { return a.Rank - b.Rank })
	return out
}

// Forget drops what Left remembers of the job with that key: it has ended
// on this node.
func (s *Server) Forget(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.left, key)
}

// Wait returns once cond holds for the registered ranks, or ctx ends.
func (s *Server) Wait(ctx context.Context, cond func(all []*Rank) bool) error {
	for {
		s.mu.Lock()
		all := slices.Clone(s.ranks)
		ch := s.changed
		s.mu.Unlock()
		if cond(all) {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// maxOwed is the room for replies nobody waits for yet: a request is sent
// only once every earlier reply is in, and notify collects those already
// there before it sends, so only the notifications of a few quick pause and
// resume cycles can be outstanding at once.
const maxOwed = 16

// request sends one line and returns the reply.
func (r *Rank) request(ctx context.Context, req string) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	// The replies to requests whose callers gave up are still coming: they
	// are this rank's answers in order, and must not pass for this one's.
	for r.owed > 0 {
		select {
		case <-r.replies:
			r.owed--
		case <-r.gone:
			return "", fmt.Errorf("rank %d (pid %d): %w", r.Rank, r.Pid, ErrGone)
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	if _, err := r.conn.Write([]byte(req + "\n")); err != nil {
		return "", fmt.Errorf("rank %d (pid %d): %w", r.Rank, r.Pid, ErrGone)
	}
	select {
	case line := <-r.replies:
		return line, nil
	case <-r.gone:
		return "", fmt.Errorf("rank %d (pid %d): %w", r.Rank, r.Pid, ErrGone)
	case <-ctx.Done():
		r.owed++
		return "", ctx.Err()
	}
}

// Close closes the rank's send gate and returns its state right after.
func (r *Rank) Close(ctx context.Context) (Gate, error) { return r.gateRequest(ctx, "CLOSE", "CLOSED") }

// State returns the rank's gate.
func (r *Rank) State(ctx context.Context) (Gate, error) { return r.gateRequest(ctx, "STATE", "STATE") }

// Opened is what a rank reports when its gate has reopened.
type Opened struct {
	Flushed uint64 `json:"flushed"` // held bytes sent
	// Errors counts held chunks the kernel refused, and Errno says why: a
	// connection the peer closed during the pause (EPIPE, ECONNRESET), on
	// which the kernel would have dropped those bytes just the same.
	Errors int `json:"errors"`
	Errno  int `json:"errno,omitempty"`
}

// Open reopens the rank's gate; the shim has sent every held byte when it
// answers.
func (r *Rank) Open(ctx context.Context) (Opened, error) {
	line, err := r.request(ctx, "OPEN")
	if err != nil {
		return Opened{}, err
	}
	return ParseOpened(line)
}

// Reopen reopens the rank's gate and returns as soon as the rank sends
// again (held bytes first, in order); unlike Open it does not wait for the
// held bytes to be flushed. The flush's outcome comes later as the event
// "flushed bytes=<n> errors=<n> errno=<e>" (ParseFlushed).
func (r *Rank) Reopen(ctx context.Context) error {
	line, err := r.request(ctx, "REOPEN")
	if err != nil {
		return err
	}
	// "stale": the gate was open already, which is no failure.
	if line != "REOPENED" && line != "REOPENED stale" {
		return fmt.Errorf("malformed reply %q", line)
	}
	return nil
}

// notify sends a request whose answer nobody waits for: it is owed, and the
// next request consumes it first (see request).
func (r *Rank) notify(req string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for collected := false; r.owed > 0 && !collected; {
		select {
		case <-r.replies:
			r.owed--
		default:
			collected = true
		}
	}
	if r.owed >= maxOwed {
		return fmt.Errorf("rank %d (pid %d): %d answers overdue", r.Rank, r.Pid, r.owed)
	}
	if _, err := r.conn.Write([]byte(req + "\n")); err != nil {
		return fmt.Errorf("rank %d (pid %d): %w", r.Rank, r.Pid, ErrGone)
	}
	r.owed++
	return nil
}

// Request is what a rank asks for unasked: the event "pause" (it got
// SIGTSTP) or "resume" (SIGCONT), "at=<ns>" after it since shims stamp it.
type Request struct {
	Op string // "pause" or "resume"
	// At is CLOCK_MONOTONIC, in nanoseconds, when the rank's handler ran:
	// the user's action, which the rank may send much later (frozen in
	// between by a pause another rank asked for). 0: not stamped (a shim
	// of an older release).
	At int64
}

// ParseRequest parses the event "pause[ at=<ns>]" or "resume[ at=<ns>]",
// ns a positive decimal without sign.
func ParseRequest(ev string) (Request, error) {
	op, at, stamped := strings.Cut(ev, " ")
	if op != "pause" && op != "resume" {
		return Request{}, fmt.Errorf("not a pause or resume request: %q", ev)
	}
	if !stamped {
		return Request{Op: op}, nil
	}
	v, ok := strings.CutPrefix(at, "at=")
	if !ok || v == "" || strings.Trim(v, "0123456789") != "" {
		return Request{}, fmt.Errorf("malformed request %q", ev)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return Request{}, fmt.Errorf("malformed request %q", ev)
	}
	return Request{Op: op, At: n}, nil
}

// ParseFlushed parses the event "flushed bytes=<n> errors=<n> errno=<e>".
func ParseFlushed(ev string) (Opened, error) {
	rest, ok := strings.CutPrefix(ev, "flushed ")
	if !ok {
		return Opened{}, fmt.Errorf("not a flush report: %q", ev)
	}
	return ParseOpened("OPENED " + strings.ReplaceAll(rest, "bytes=", "flushed="))
}

// ParseOpened parses "OPENED flushed=<n> errors=<n> errno=<e>".
func ParseOpened(line string) (Opened, error) {
	kv, err := fields(line, "OPENED")
	if err != nil {
		return Opened{}, err
	}
	var o Opened
	var e1, e2, e3 error
	o.Flushed, e1 = strconv.ParseUint(kv["flushed"], 10, 64)
	o.Errors, e2 = strconv.Atoi(kv["errors"])
	if v, ok := kv["errno"]; ok {
		o.Errno, e3 = strconv.Atoi(v)
	}
	if errors.Join(e1, e2, e3) != nil || o.Errors < 0 {
		return Opened{}, fmt.Errorf("malformed reply %q", line)
	}
	return o, nil
}

func (r *Rank) gateRequest(ctx context.Context, req, verb string) (Gate, error) {
	line, err := r.request(ctx, req)
	if err != nil {
		return Gate{}, err
	}
	return ParseGate(line, verb)
}

// ParseGate parses "<verb> gate=closed gated=1 closing=0 held=123".
func ParseGate(line, verb string) (Gate, error) {
	kv, err := fields(line, verb)
	if err != nil {
		return Gate{}, err
	}
	var g Gate
	g.State = kv["gate"]
	var e1, e2, e3 error
	g.Gated, e1 = strconv.Atoi(kv["gated"])
	g.Closing, e2 = strconv.Atoi(kv["closing"])
	g.Held, e3 = strconv.ParseUint(kv["held"], 10, 64)
	okState := g.State == "open" || g.State == "closed" || g.State == "flushing"
	if !okState || errors.Join(e1, e2, e3) != nil || g.Gated < 0 || g.Closing < 0 {
		return Gate{}, fmt.Errorf("malformed reply %q", line)
	}
	return g, nil
}

func fields(line, verb string) (map[string]string, error) {
	f := strings.Fields(line)
	if len(f) == 0 || f[0] != verb {
		return nil, fmt.Errorf("want %s, got %q", verb, line)
	}
	kv := map[string]string{}
	for _, x := range f[1:] {
		k, v, _ := strings.Cut(x, "=")
		kv[k] = v
	}
	return kv, nil
}
