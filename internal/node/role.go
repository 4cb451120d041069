// Package node is the node half of the pause protocol as mpid runs it:
// the quiesce.Node that a node's quiesce.Agent calls for each step of a
// pause of a job with ranks here. Role does the steps themselves, with the
// shims' gates (internal/ranks), the job's kernel observer (loader) and its
// cgroup's freezer (internal/cgroupv2, through mpid's Cgroups); Steps wraps
// them with what mpid adds around each one: step metrics, the fault tests'
// failpoints (FailpointsEnv, in a build with -tags failpoints only) and
// the record of every pause committed here, which a restarted mpid reads.
//
// What the steps need of the rest of mpid comes in as funcs and small
// interfaces (Role's Observer, Cgroups, Unready; Steps' Committed, Thawing,
// Job and Records), so this package does not import mpid, and mpid's
// coordinator reads what a failed step blamed on a rank through
// quiesce.Fault and the codes below (FaultRankGone, FaultStashFull,
// FaultHeld, FaultUnheld).
package node

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// Role is mpid's node role in the pause protocol: quiesce.Node for the
// ranks of a job registered with this node's rank socket, with the shims'
// gates (internal/ranks), the job's kernel observer and its cgroup's
// freezer, both given by mpid's registry.
type Role struct {
	// Name is the node's name in reports.
	Name string
	// Ranks is the node's rank socket, where the job's shims registered.
	Ranks *ranks.Server
	// Jobs are the jobs known on this node: their observers, cgroups and
	// readiness, and what a step tells them.
	Jobs Jobs
	// Netns, if set, is the Conn.Netns label of this node's namespace.
	Netns   string
	Freezer interface {
		Freeze(ctx context.Context, dir string) error
		Thaw(ctx context.Context, dir string) error
	}
	// HeldBy, if set, says what holds process pid still other than the
	// pause, or ""; nil reads the kernel (heldByKernel).
	HeldBy func(pid int) string
	// Metrics, if set, records each kernel snapshot's time and the bytes
	// sent through closed gates.
	Metrics *metrics.Metrics
	Log     *slog.Logger
	// Timelines, if set, keep and log each operation's steps here
	// (Timelines; mpid --log-timeline).
	Timelines *Timelines

	mu sync.Mutex
	// gated is, per job with a pause under way, the ranks Prepare closed
	// (rank → pid): a rank missing later exited during the pause.
	gated map[string]map[int]int
	// held is, per job, the connections the last report found holding
	// bytes, with when they were first seen so. Owners are looked up only
	// for a connection stuck for stuckAfter: reading /proc/PID/net/tcp walks
	// the kernel's whole TCP hash table (20-30 ms here), too much for the
	// rounds of a drain that is going well, and what a failure report needs.
	// An owner found is kept as long as the connection stays held: a busy
	// rank keeps its connections stuck for every later round, and a walk per
	// round made a node's drain step slower than the rounds near the drain
	// deadline allow.
	held map[string]map[[2]netip.AddrPort]heldConn
	// sentAt is, per job, what each connection had been given to send (by
	// socket cookie; sentOf) at the last kernel report taken while every
	// gate of the node was closed: what the next such report compares with
	// (violations).
	sentAt map[string]map[uint64]uint64
	// seen is, per job with a pause under way, each connection's state and
	// counters at the last kernel read (by socket cookie): what tells a
	// socket that began to close since (closing).
	seen map[string]map[uint64]seenConn
	// drains is, per job with a pause under way, the job's connections its
	// ranks were told to drain (by socket cookie) and this node's addresses.
	drains map[string]*drainSet
	// last is, per job with a pause under way, the connections of the
	// last kernel read: what a drain check rechecks (loader.Rechecker).
	last map[string][]loader.Conn
	// confirmed is, per job, that the last drain check was clean and read
	// by a walk: a clean recheck after it needs no walk of its own.
	confirmed map[string]bool
	// counted is, per job, the Counted of the report that took sentAt.
	counted map[string]bool
	// countFrom is, per job, when the first read that counted bytes sent
	// through closed gates began: a connection established since took
	// all its bytes through them (violations).
	countFrom map[string]time.Time
	// violated is, per job with a pause under way, the bytes its checks
	// counted as sent through closed gates that may have overtaken held
	// bytes (not late): every later report says them, up to the check
	// after the freeze, and the pause fails.
	violated map[string]uint64
	// unread is, per job, that Prepare closed its gates here and no drain
	// check has read the kernel since: the next one's read is PREPARE's
	// too (Prepare).
	unread map[string]bool
}

// drainSet is what a pause's DRAIN requests named on this node, and what
// tells the job's connections from a program's own.
type drainSet struct {
	sent map[uint64]bool
	here map[netip.Addr]bool // this node's addresses, at PREPARE
	// mine are the local ports of the job's sockets here at the last
	// kernel read; peers every node's, as the coordinator last sent them
	// (nil before the first DRAIN).
	mine, peers quiesce.Ports
	// answered is closed once every rank sent the last DRAIN has answered
	// it or gone (DrainWake); nil before the first, and once a check began
	// after it closed.
	answered chan struct{}
}

// startDrains tells every rank of the job on this node which connections
// to drain: at PREPARE, and again whenever the kernel shows a job
// connection the last DRAIN did not name (one made during the pause: its
// bytes must be drained too, or the pause would wait for a rank that does
// not read; or one the coordinator's ports showed to be the job's). set
// is what sides.jobConns found in the last kernel read.
func (l *Role) startDrains(job string, d *drainSet, set []uint64, first bool) error {
	l.mu.Lock()
	fresh := first
	for _, c := range set {
		fresh = fresh || !d.sent[c]
	}
	if fresh {
		d.sent = make(map[uint64]bool, len(set))
		for _, c := range set {
			d.sent[c] = true
		}
	}
	l.mu.Unlock()
	if !fresh || len(set) == 0 {
		return nil // a shim drains nothing until told what
	}
	if len(set) > ranks.MaxDrainSet {
		l.Log.Warn("more job connections than a DRAIN names; the rest are not drained", "job", job, "node", l.Name, "connections", len(set), "named", ranks.MaxDrainSet)
	}
	// left counts the answers still due, and one more until every DRAIN
	// has gone: a rank answering fast cannot close answered early.
	answered := make(chan struct{})
	var left atomic.Int64
	left.Store(1)
	one := func() {
		if left.Add(-1) == 0 {
			close(answered)
		}
	}
	l.mu.Lock()
	d.answered = answered
	l.mu.Unlock()
	defer one()
	return l.eachRank(job, "drain", func(r *ranks.Rank) error {
		left.Add(1)
		return r.StartDrain(set, func() {
			l.Timelines.answer(job, r.Rank)
			one()
		})
	})
}

// DrainWake is closed once every rank of job on this node has answered the
// last DRAIN sent to it (quiesce.DrainWaker): each shim has then drained
// what waited on the job's connections and acknowledged what its rank had
// read, so the next check need not wait for the agent's poll to find
// that. nil if no DRAIN has gone in this pause, or a check began after
// the last one's answers.
func (l *Role) DrainWake(job string) <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if d := l.drains[job]; d != nil && d.answered != nil {
		return d.answered
	}
	return nil
}

// stashFull names the ranks whose shims said their stash is full since
// PREPARE: their drain takes nothing more, so the pause cannot empty their
// queues and fails now, saying why, rather than at its deadline.
func (l *Role) stashFull(job string) error {
	var errs []error
	for _, r := range l.Ranks.Ranks(job) {
		if f := r.StashFullSince(); f != nil {
			errs = append(errs, &StashFullError{Rank: r.Rank, Pid: r.Pid, Node: l.Name, Bytes: f.Bytes, Max: f.Max})
		}
	}
	return errors.Join(errs...)
}

// unheld names the ranks whose shims passed a call they cannot hold on one
// of the job's connections here (a cookie the pause's DRAIN named) since
// the gate closed: the kernel check would fail the pause for the bytes,
// and this says which call sent them. Reports on a program's own
// connections are not the pause's concern.
func (l *Role) unheld(job string) error {
	l.mu.Lock()
	var sent map[uint64]bool
	if d := l.drains[job]; d != nil {
		sent = d.sent
	}
	l.mu.Unlock()
	var errs []error
	for _, r := range l.Ranks.Ranks(job) {
		for _, u := range r.UnheldSince() {
			if sent[u.Cookie] {
				errs = append(errs, &UnheldError{Rank: r.Rank, Pid: r.Pid, Node: l.Name, Call: u.Call, Fd: u.Fd, Cookie: u.Cookie})
				break // one a rank says why
			}
		}
	}
	return errors.Join(errs...)
}

type heldConn struct {
	since  time.Time
	rank   int  // the owner, or -1 if not looked up or not found
	looked bool // looked up once: a connection no rank owns is not looked up every round
}

// stuckAfter is how long a connection holds bytes before its owner is looked up.
const stuckAfter = 250 * time.Millisecond

// gone reports the ranks Prepare gated that are no longer registered;
// with kernel set, also those the kernel says are dead or dying (see
// dying), which the registry learns only once mpid has read the end of
// their channel.
func (l *Role) gone(job string, kernel bool) error {
	l.mu.Lock()
	was := l.gated[job]
	l.mu.Unlock()
	now := map[int]bool{}
	for _, r := range l.Ranks.Ranks(job) {
		now[r.Rank] = true
	}
	var errs []error
	for _, rank := range slices.Sorted(maps.Keys(was)) {
		if pid := was[rank]; !now[rank] || (kernel && dying(pid)) {
			errs = append(errs, &RankGoneError{Rank: rank, Pid: pid})
		}
	}
	return errors.Join(errs...)
}

// left names the ranks of the job that registered here and whose channel
// has closed since (ranks.Server.Left): a rank killed while the pause was
// on its way to this node is no longer registered when PREPARE comes,
// and the ranks that are would pass for the node's whole part of the job.
func (l *Role) left(job string) error {
	var errs []error
	for _, d := range l.Ranks.Left(job) {
		errs = append(errs, &RankGoneError{Rank: d.Rank, Pid: d.Pid, Before: true})
	}
	return errors.Join(errs...)
}

// seenConn is a connection as a kernel read found it (Role.seen).
type seenConn struct {
	state   loader.TCPState
	seq     uint32
	sent    uint64
	counted bool // seq and sent were read (a recheck reads no seq)
}

// closing records conns as the job's last kernel read on this node and
// says whether, since the previous one, a connection that was established
// left that state or went away, or one queued a FIN (its write_seq moved
// past what its process gave it to send). A rank killed shows there
// first, often before mpid has read the end of its channel: its sockets
// close as it exits, and its peers close theirs when they see it. It
// costs the read that follows a look at /proc for each rank gated here,
// which every drain poll cannot afford (tens of µs each on a loaded
// node). first starts afresh (PREPARE).
func (l *Role) closing(job string, conns []loader.Conn, first, seqs bool) bool {
	now := make(map[uint64]seenConn, len(conns))
	for _, c := range conns {
		if c.State != loader.StateListen {
			now[c.Cookie] = seenConn{state: c.State, seq: c.WriteSeq, sent: c.BytesSent, counted: c.Counted && seqs}
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen == nil {
		l.seen = map[string]map[uint64]seenConn{}
	}
	was := l.seen[job]
	l.seen[job] = now
	if first {
		return false
	}
	for _, c := range conns {
		p, ok := was[c.Cookie]
		if ok && c.Counted && p.counted && c.WriteSeq-p.seq > uint32(c.BytesSent-p.sent) {
			return true // a FIN: write_seq counts it, what was sent does not
		}
	}
	for cookie, p := range was {
		if c, ok := now[cookie]; p.state == loader.StateEstablished && (!ok || c.state != loader.StateEstablished) {
			return true
		}
	}
	return false
}

// dying says whether process pid is gone, a zombie, or has a SIGKILL
// pending. VERIFY must not commit a job with a rank killed while frozen:
// the kill wakes the rank only to exit, and its channel to mpid closes some
// milliseconds later (on a loaded node, after VERIFY has run), so the
// registry alone let such a pause commit with a rank about to vanish. The
// pending bit is what kill(2) leaves at once (complete_signal adds SIGKILL
// to every thread's pending set, proc(5): SigPnd, ShdPnd).
func dying(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		// Gone; any other error says nothing, and the registry decides.
		return errors.Is(err, fs.ErrNotExist)
	}
	return statusDying(string(b))
}

// statusDying is dying's reading of a /proc/PID/status text.
func statusDying(s string) bool {
	const sigkill = 1 << (9 - 1)
	for _, line := range strings.Split(s, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "State":
			if strings.HasPrefix(v, "Z") || strings.HasPrefix(v, "X") {
				return true
			}
		case "SigPnd", "ShdPnd":
			if m, err := strconv.ParseUint(v, 16, 64); err == nil && m&sigkill != 0 {
				return true
			}
		}
	}
	return false
}

var (
	_ quiesce.Node       = (*Role)(nil)
	_ quiesce.DrainWaker = (*Steps)(nil)
)

func (l *Role) ranksOf(job string) ([]*ranks.Rank, error) {
	rs := l.Ranks.Ranks(job)
	if len(rs) == 0 {
		return nil, fmt.Errorf("node %s, job %s: %w", l.Name, job, ErrNoRanks)
	}
	return rs, nil
}

// eachRank runs fn on every rank of the job registered on this node, all
// at once: each call waits for a rank's control thread to be scheduled, and
// one after the other those waits would add up.
func (l *Role) eachRank(job, what string, fn func(*ranks.Rank) error) error {
	rs, err := l.ranksOf(job)
	if err != nil {
		return err
	}
	errs := make([]error, len(rs))
	var wg sync.WaitGroup
	for i, r := range rs {
		wg.Go(func() {
			err := fn(r)
			switch {
			case errors.Is(err, ranks.ErrGone):
				errs[i] = &RankGoneError{Rank: r.Rank, Pid: r.Pid, At: what}
			case err != nil:
				errs[i] = fmt.Errorf("%s of rank %d: %w", what, r.Rank, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Prepare closes the gate of every rank of the job on this node. It leaves
// its kernel read to the drain check that follows it (in PREPARE's round,
// quiesce.Message.Check): that one read, taken once every rank has
// answered for its gate, is both PREPARE's (the drain set the ranks are
// told, this node's addresses, the connections later reads are compared
// with) and the check's, where a read of its own a few milliseconds
// before would cost a walk of the kernel's TCP table more a node a pause
// (docs/guarantees.md, "PREPARE's read is its first drain check's").
func (l *Role) Prepare(ctx context.Context, job string) error {
	// Only closing waits for every rank: a rank not registered again
	// could not be gated, while opening and thawing what is registered
	// is always right.
	if why := l.Jobs.Unready(job); why != "" {
		return fmt.Errorf("node %s, job %s: %w", l.Name, job, &NotReadyError{why})
	}
	if err := l.left(job); err != nil {
		return err
	}
	rs, err := l.ranksOf(job)
	if err != nil {
		return err
	}
	was := make(map[int]int, len(rs))
	for _, r := range rs {
		was[r.Rank] = r.Pid
	}
	l.mu.Lock()
	if l.gated == nil {
		l.gated = map[string]map[int]int{}
	}
	if l.unread == nil {
		l.unread = map[string]bool{}
	}
	l.gated[job] = was
	l.unread[job] = true
	delete(l.sentAt, job)
	delete(l.countFrom, job)
	delete(l.violated, job)
	delete(l.last, job)
	delete(l.confirmed, job)
	delete(l.drains, job) // the last pause's: what unheld would match
	l.mu.Unlock()
	err = l.eachRank(job, "close gate", func(r *ranks.Rank) error {
		r.ClearStashFull()
		if r.HasGatePage() {
			// A write of its gate word: nothing to wait for, held or not.
			return r.CloseGate(ctx)
		}
		return l.unlessHeld(ctx, r, r.CloseGate)
	})
	if err != nil {
		return err
	}
	// A rank killed just before its gate closed has SIGKILL pending at
	// once; its channel's end and its sockets' may reach mpid much later.
	return l.gone(job, true)
}

// conns reads the job's connections on this node from the kernel.
func (l *Role) conns(ctx context.Context, job string) ([]loader.Conn, error) {
	obs, err := l.Jobs.Observer(job)
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	conns, err := obs.Snapshot(ctx)
	if err != nil {
		return nil, err
	}
	l.Metrics.Snapshot(time.Since(t0))
	mine := conns[:0]
	for _, c := range conns {
		if l.Netns == "" || c.Netns == l.Netns {
			mine = append(mine, c)
		}
	}
	return mine, nil
}

// Drain asks every rank for its gate (sockets still mid-message are
// Ungated) and reads the job's connections on this node from the kernel;
// the first check after Prepare walks, and its read is PREPARE's too.
func (l *Role) Drain(ctx context.Context, job string) (quiesce.NodeReport, error) {
	rep := quiesce.NodeReport{Node: l.Name}
	l.mu.Lock()
	if d := l.drains[job]; d != nil && d.answered != nil {
		select {
		case <-d.answered:
			d.answered = nil // this check sees what the answers did
		default:
		}
	}
	l.mu.Unlock()
	if err := l.gone(job, false); err != nil {
		return rep, err
	}
	if err := l.stashFull(job); err != nil {
		return rep, err
	}
	if err := l.unheld(job); err != nil {
		return rep, err
	}
	var ungated atomic.Int64
	var mu sync.Mutex
	closing := map[int]bool{}
	t0 := time.Now()
	err := l.eachRank(job, "gate state", func(r *ranks.Rank) error {
		if r.Quiet() {
			return nil
		}
		var g ranks.Gate
		err := l.unlessHeld(ctx, r, func(ctx context.Context) (err error) {
			g, err = r.State(ctx)
			return err
		})
		ungated.Add(int64(g.Closing))
		if g.Closing > 0 {
			mu.Lock()
			closing[r.Rank] = true
			mu.Unlock()
		}
		return err
	})
	rep.Ungated = int(ungated.Load())
	if err != nil {
		return rep, err
	}
	t1 := time.Now()
	var kr kernelRead
	under := checkOpen
	if rep.Ungated == 0 {
		under = checkGated
	}
	l.mu.Lock()
	first := l.unread[job]
	l.mu.Unlock()
	rep, kr, err = l.kernelReportBy(ctx, job, rep, under, first, first)
	if err == nil && first {
		l.mu.Lock()
		delete(l.unread, job)
		l.mu.Unlock()
	}
	if err == nil {
		err = l.heldStill(job, rep, closing)
	}
	if err == nil {
		err = l.startDrains(job, kr.d, kr.sides.jobConns(kr.conns), first)
	}
	// A drain round is a few milliseconds; one that is not delays every
	// node's next round, so say where the time went.
	if d := time.Since(t0); d > slowStep {
		l.Log.Warn("slow drain step", "job", job, "ms", d.Milliseconds(),
			"gates_ms", t1.Sub(t0).Milliseconds(), "kernel_ms", time.Since(t1).Milliseconds(), "error", err)
	}
	return rep, err
}

// heldStill fails the drain of job at once when a rank with bytes unread on
// this node, or with a message still going out (closing: its gate waits
// for the send to end), is held still by something other than the pause: stopped by a
// signal (Open MPI's orted turns the SIGTSTP of a scheduler's suspend into
// a SIGSTOP of its ranks; a debugger) or frozen by a cgroup above the ones
// the pause freezes (Slurm's freeze of the step, 2 s after its SIGTSTP).
// Neither the rank nor its shim's drain runs again until that lets go, so
// waiting would only spend the drain's deadline and then roll back the
// same; the report says what holds the rank instead of "not reading". Only
// ranks the kernel report names are looked at: a drain going well reads
// nothing more.
func (l *Role) heldStill(job string, rep quiesce.NodeReport, closing map[int]bool) error {
	waiting := maps.Clone(closing)
	if waiting == nil {
		waiting = map[int]bool{}
	}
	for _, c := range rep.Conns {
		if c.Unread > 0 && c.Rank >= 0 {
			waiting[c.Rank] = true
		}
	}
	if len(waiting) == 0 {
		return nil
	}
	heldBy := l.heldBy()
	var errs []error
	for _, r := range l.Ranks.Ranks(job) {
		if !waiting[r.Rank] {
			continue
		}
		if how := heldBy(r.Pid); how != "" {
			errs = append(errs, &HeldError{Rank: r.Rank, Pid: r.Pid, Node: l.Name, How: how})
		}
	}
	return errors.Join(errs...)
}

func (l *Role) heldBy() func(pid int) string {
	if l.HeldBy == nil {
		return heldByKernel
	}
	return l.HeldBy
}

// heldPoll is how often a request to a rank that has not answered yet
// looks whether something else holds the rank still (unlessHeld): a
// shim answers in well under a millisecond when it runs.
const heldPoll = 100 * time.Millisecond

// unlessHeld makes ask, a request to rank r's shim, and gives it up as
// soon as something other than the pause holds the rank still (heldBy): a
// stopped or frozen shim answers only once that lets go, so waiting spends
// the drain's whole deadline (30 s on the VMs, where Slurm's freeze came
// during the request) before the same rollback. The request itself is
// left owed (ranks.Rank.request), as any abandoned one.
func (l *Role) unlessHeld(ctx context.Context, r *ranks.Rank, ask func(context.Context) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- ask(ctx) }()
	tick := time.NewTicker(heldPoll)
	defer tick.Stop()
	heldBy := l.heldBy()
	for {
		select {
		case err := <-done:
			return err
		case <-tick.C:
			if how := heldBy(r.Pid); how != "" {
				cancel()
				<-done
				return &HeldError{Rank: r.Rank, Pid: r.Pid, Node: l.Name, How: how}
			}
		}
	}
}

// heldByKernel says what holds process pid still, from /proc and its
// cgroup's events, or "" if nothing does (or it cannot tell). During a
// drain the pause has frozen nothing (a rethaw is confirmed before the
// drain goes on), so a frozen cgroup is someone else's freeze, of it or
// of a cgroup above it.
func heldByKernel(pid int) string {
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil && statusStopped(string(b)) {
		return "stopped by a signal (state T: a SIGSTOP, from the scheduler, the MPI launcher or a debugger)"
	}
	if dir, err := cgroupv2.Of(pid); err == nil {
		if frozen, err := cgroupv2.Frozen(dir); err == nil && frozen {
			return "frozen by its cgroup or one above it (" + dir + "; a scheduler's suspend?)"
		}
	}
	return ""
}

// statusStopped says whether a /proc/PID/status text is of a process in a
// job-control stop ("T (stopped)"). A tracer's stop ("t") is left to the
// drain's deadline: strace's stops at each system call pass by themselves.
func statusStopped(s string) bool {
	for _, line := range strings.Split(s, "\n") {
		if v, ok := strings.CutPrefix(line, "State:"); ok {
			return strings.HasPrefix(strings.TrimSpace(v), "T")
		}
	}
	return false
}

// slowStep is how long a node's drain step may take before it is logged.
const slowStep = 100 * time.Millisecond

// Verify is the kernel's report after the freeze: the ranks cannot answer
// now, and need not: only the kernel's queues count (G1,
// docs/guarantees.md).
func (l *Role) Verify(ctx context.Context, job string) (quiesce.NodeReport, error) {
	if err := l.gone(job, true); err != nil {
		return quiesce.NodeReport{Node: l.Name}, err
	}
	rep, _, err := l.kernelReport(ctx, job, quiesce.NodeReport{Node: l.Name}, checkFrozen)
	return rep, err
}

// Freeze freezes the job's cgroups and waits for the kernel to say each
// is frozen. They are frozen at once, not one after the other: a pause's
// freeze then takes as long as the slowest, however many ranks have a
// cgroup of their own (Slurm's tasks).
func (l *Role) Freeze(ctx context.Context, job string) error {
	return l.eachCgroup(ctx, job, l.Freezer.Freeze)
}

// Thaw thaws the job's cgroups.
func (l *Role) Thaw(ctx context.Context, job string) error {
	return l.eachCgroup(ctx, job, l.Freezer.Thaw)
}

func (l *Role) eachCgroup(ctx context.Context, job string, fn func(context.Context, string) error) error {
	dirs, err := l.Jobs.Cgroups(job)
	if err != nil {
		return err
	}
	errs := make([]error, len(dirs))
	var wg sync.WaitGroup
	for i, dir := range dirs {
		wg.Go(func() { errs[i] = fn(ctx, dir) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Open reopens every rank's gate; the shims flush what they held. Ranks
// that exited meanwhile are not its business: a pause they were part of
// failed on them already (Drain, Verify), and after a COMMIT the job's own
// launcher sees the loss.
func (l *Role) Open(ctx context.Context, job string) error {
	// ReopenGate, not Open: the rank runs again once its gate lets sends
	// through; the flush of what it held (MiBs, for MPICH) goes on behind,
	// in order, and is reported as an event.
	err := l.eachRank(job, "open gate", func(r *ranks.Rank) error {
		return r.ReopenGate(ctx)
	})
	if errors.Is(err, ErrNoRanks) {
		err = nil // every rank here is gone: nothing to open
	}
	if err == nil {
		l.mu.Lock()
		delete(l.gated, job)
		delete(l.held, job) // a job's next pause starts its clocks afresh
		delete(l.sentAt, job)
		delete(l.seen, job)
		delete(l.drains, job)
		delete(l.last, job)
		delete(l.confirmed, job)
		delete(l.counted, job)
		delete(l.countFrom, job)
		delete(l.violated, job)
		delete(l.unread, job)
		l.mu.Unlock()
	}
	return err
}
