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
	// Tstp is where the shim's SIGTSTP handler begins in the rank (0: a
	// shim that does not say): a frozen thread about to run it holds a
	// SIGTSTP delivered before the freeze. The rank's word, trusted only
	// about its own requests.
	Tstp uint64 `json:"-"`

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
	// sent counts the requests written (under mu); the reader counts the
	// answers (under ansMu): the shim answers every request once, in
	// order, so answer n is request n's. answered holds what waits for
	// one (StartDrain), at most maxOwed: notify refuses more unanswered.
	sent     uint64
	ansMu    sync.Mutex
	answers  uint64
	ended    bool // the channel ended: nothing more is answered
	answered []answerWait
}

// answerWait is fn, to run once request n has been answered (or the rank
// has gone).
type answerWait struct {
	n  uint64
	fn func()
}

// Gate is a rank's send gate as its shim reports it.
type Gate struct {
	State   string `json:"state"`   // open, closed, flushing
	Gated   int    `json:"gated"`   // sockets at a call boundary under the closed gate
	Closing int    `json:"closing"` // sockets still mid-message
	Held    uint64 `json:"held"`    // bytes held in the shim
}

// Jobs is what the rank server asks of the jobs its ranks belong to:
// mpid's registry implements it.
type Jobs interface {
	// Join acts on a JOIN: process p (p.Pid and p.UID from SO_PEERCRED,
	// the pid also the one the line names; p holds its pidfd, taken at
	// accept) asks to be moved into the cgroup of job, before it has
	// created any socket (mpid: check the job and the user, then p.MoveTo
	// the job's cgroup, never a write of the bare pid). p is alive when
	// Join is called and is closed when Join returns: Join must not keep
	// it. A nil return answers OK; an error answers ERR with its text,
	// which the rank prints. The shim waits 2 s for the answer, then runs
	// on unjoined. Refused JOINs also go to Changed (r nil, err).
	Join(JoinRequest) error
	// Admit decides whether a rank that passed the credential check may
	// register (mpid: is its pid in the job's cgroup?).
	Admit(*Rank) error
	// Changed is told of every rank that registers (gone false) or goes
	// away (gone true), and of refused connections (r nil, err).
	Changed(r *Rank, gone bool, err error)
	// Event is told what a rank asks for unasked: "pause" when it got
	// SIGTSTP, "resume" when it got SIGCONT (ParseRequest), and the
	// outcome of a flush (ParseFlushed). It runs on the rank's reader: it
	// must not make requests to that rank itself.
	Event(r *Rank, event string)
}

// Server accepts ranks on one unix socket. Set Jobs before Serve.
type Server struct {
	// Jobs, if set, admits and hears of the ranks. Without it every JOIN
	// is refused ("joining is not supported here") and every HELLO that
	// passes the credential check registers.
	Jobs Jobs

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

// JobKey is the key of the rank's job: its own uid's namespace.
func (r *Rank) JobKey() string { return jobid.Key(r.UID, r.Job) }

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
	if err == nil && s.Jobs != nil {
		if err = s.Jobs.Admit(r); err != nil {
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
		if s.Jobs != nil {
			s.Jobs.Changed(nil, false, err)
		}
		return
	}
	if s.Jobs != nil {
		s.Jobs.Changed(r, false, nil)
	}
	s.mu.Lock()
	s.ranks = append(s.ranks, r)
	delete(s.left[r.JobKey()], r.Rank)
	s.notifyLocked()
	s.mu.Unlock()
	cut := r.read(bufio.NewReaderSize(c, MaxRankLine), s.Jobs)
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
	if s.Jobs != nil {
		s.Jobs.Changed(r, true, cut)
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

// join answers a JOIN (OK or ERR <reason>) and closes the connection.
func (s *Server) join(c *net.UnixConn, f firstLine) {
	defer c.Close()
	job, pid, key, err := ParseJoin(f.line)
	p := f.proc
	switch {
	case err != nil:
	case pid != p.Pid:
		err = errors.New("pid does not match the connection's credentials")
	case s.Jobs == nil:
		err = errors.New("joining is not supported here")
	default:
		// A JOIN of a process that has exited is refused even though
		// its line names its pid: the number may be another's by now.
		if err = p.Alive(); err == nil {
			err = s.Jobs.Join(JoinRequest{Job: job, Key: key, Proc: p})
		}
	}
	reply := "OK\n"
	if err != nil {
		reply = "ERR " + oneLine(err.Error()) + "\n"
	}
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	c.Write([]byte(reply)) // a rank that gave up waiting has gone: nothing to do
	if err != nil && s.Jobs != nil {
		s.Jobs.Changed(nil, false, fmt.Errorf("JOIN from pid %d (uid %d) refused: %w", p.Pid, p.UID, err))
	}
}

// read delivers the rank's reply lines until its connection closes, and
// says why it cut the rank off, if it did (nil when the rank hung up). br
// holds MaxRankLine bytes: what a rank sends never takes more.
func (r *Rank) read(br *bufio.Reader, jobs Jobs) error {
	defer r.answer(true)
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
			if jobs != nil {
				jobs.Event(r, strings.TrimSpace(ev))
			}
			continue
		}
		r.answer(false)
		select {
		case r.replies <- strings.TrimSuffix(line, "\n"):
		default:
			return fmt.Errorf("rank %d (pid %d, uid %d) of job %s answered more than it was asked; cut off", r.Rank, r.Pid, r.UID, r.Job)
		}
	}
}

// Ranks returns the ranks of the job with that key (jobid.Key) registered
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
	r.sent++
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
// next request consumes it first (see request). answered, if not nil, runs
// once: when the answer has been read, when the rank has gone, or at once
// if the request could not be sent. It runs from the channel's reader or
// under mu, so it must not block.
func (r *Rank) notify(req string, answered func()) error {
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
		if answered != nil {
			answered()
		}
		return fmt.Errorf("rank %d (pid %d): %d answers overdue", r.Rank, r.Pid, r.owed)
	}
	if _, err := r.conn.Write([]byte(req + "\n")); err != nil {
		if answered != nil {
			answered()
		}
		return fmt.Errorf("rank %d (pid %d): %w", r.Rank, r.Pid, ErrGone)
	}
	r.sent++
	r.owed++
	if answered != nil {
		r.onAnswer(r.sent, answered)
	}
	return nil
}

// onAnswer has fn run when the answer to request n is read: at once if it
// has been already, or if the channel has ended.
func (r *Rank) onAnswer(n uint64, fn func()) {
	r.ansMu.Lock()
	if r.ended || r.answers >= n {
		r.ansMu.Unlock()
		fn()
		return
	}
	r.answered = append(r.answered, answerWait{n: n, fn: fn})
	r.ansMu.Unlock()
}

// answer counts one answer read from the shim, or, with end, the end of
// the channel, and runs what waited for it.
func (r *Rank) answer(end bool) {
	r.ansMu.Lock()
	if end {
		r.ended = true
	} else {
		r.answers++
	}
	var due []func()
	keep := r.answered[:0]
	for _, w := range r.answered {
		if r.ended || w.n <= r.answers {
			due = append(due, w.fn)
		} else {
			keep = append(keep, w)
		}
	}
	r.answered = keep
	r.ansMu.Unlock()
	for _, fn := range due {
		fn()
	}
}

func (r *Rank) gateRequest(ctx context.Context, req, verb string) (Gate, error) {
	line, err := r.request(ctx, req)
	if err != nil {
		return Gate{}, err
	}
	return ParseGate(line, verb)
}
