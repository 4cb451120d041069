package mpid

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"golang.org/x/sys/unix"
)

// A rank's SIGTSTP or SIGCONT asks for its job's pause or resume
// (coordinator.rankEvent): the kernel's generation times of the signals
// (signalClock), or where it cannot keep them the handler's stamps and the
// looks at a thaw, tell a request that an operation since has answered
// from one still to act on, and a SIGCONT sent to a rank of a job paused
// here is noticed (watchContinue).

// signalClock is when the kernel generated each watched rank's last
// SIGTSTP and SIGCONT (loader.SignalClock). A handler's own stamp cannot
// order its signal: a SIGTSTP whose handler's frame a freeze caught (this
// node's or a resource manager's) runs after the thaw, after the SIGCONT
// that ended the stop was sent, and a handler stamps when it runs.
type signalClock interface {
	Watch(pid int) error
	Forget(pid int)
	Last(pid int) (loader.SignalTimes, bool)
}

// watchSignals starts the clock on a rank that registered. A full map
// leaves the rank to the stamps and the looks.
func (r *registry) watchSignals(rk *ranks.Rank) {
	if r.signals == nil {
		return
	}
	if err := r.signals.Watch(rk.Pid); err != nil {
		if ok, held := r.refusals.allow("signal clock: " + err.Error()); ok {
			r.log.Warn("rank's signals not timed by the kernel; its SIGTSTP is ordered by its handler's stamp", "job", rk.Job, "rank", rk.Rank, "pid", rk.Pid, "error", err, "repeats_not_logged", held)
		}
	}
}

// unwatchSignals stops the clock on a rank gone, unless its process has
// registered again meanwhile (a new connection before the old one's end).
func (r *registry) unwatchSignals(rk *ranks.Rank) {
	if r.signals == nil || r.ranks == nil {
		return
	}
	for _, o := range r.ranks.Ranks(rk.JobKey()) {
		if o.Pid == rk.Pid {
			return
		}
	}
	r.signals.Forget(rk.Pid)
}

// signalTimes is rank pid's times, if the kernel keeps them.
func (r *registry) signalTimes(pid int) (loader.SignalTimes, bool) {
	if r.signals == nil {
		return loader.SignalTimes{}, false
	}
	return r.signals.Last(pid)
}

// monotonic is CLOCK_MONOTONIC in nanoseconds: the clock the shim's signal
// handler stamps a rank's request with, on the same machine.
func monotonic() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0 // never on Linux; 0 answers nothing
	}
	return ts.Nano()
}

// Thawing records that this node begins to thaw job id (a resume, or
// the rollback of a pause), and Committed that a pause of it commits.
func (r *registry) Thawing(id string) {
	// The time first: a handler stamped before it took its signal off the
	// pending set before the look below, which then sees a later one.
	t := monotonic()
	var held map[int]bool
	if r.ranks != nil {
		procs := r.procsOr()
		for _, rk := range r.ranks.Ranks(id) {
			if _, ok := r.signalTimes(rk.Pid); ok {
				continue // answered orders its requests by the kernel's times
			}
			// A SIGTSTP the freeze caught waiting, or one whose handler's
			// frame the kernel had built on a thread when the freeze
			// caught it: out of the pending set, its handler runs after
			// the thaw, and a SIGCONT taken by another thread does not
			// cancel it (the shim's on_cont sees only its own thread).
			if procs.pending(rk.Pid, syscall.SIGTSTP) || rk.Tstp != 0 && procs.framed(rk.Pid, rk.Tstp) {
				if held == nil {
					held = map[int]bool{}
				}
				held[rk.Pid] = true
			}
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if j := r.jobs[id]; j != nil {
		j.resumed, j.tstpHeld = t, held
	}
}

func (r *registry) Committed(id string) {
	t := monotonic()
	r.mu.Lock()
	j := r.jobs[id]
	if j != nil {
		// A pause since: a SIGTSTP held at the last thaw is answered by it.
		j.committed, j.tstpHeld = t, nil
	}
	r.mu.Unlock()
	if j != nil && r.events != nil && r.ranks != nil {
		go r.watchContinue(id, t)
	}
}

// contPoll is how often a paused job's ranks here are looked at for a
// SIGCONT: the delay it adds to a resume by signal.
const contPoll = 200 * time.Millisecond

// watchContinue looks, while the pause of job id that committed at t holds
// here, for a SIGCONT pending on one of its ranks, and tells continued of
// the first. A frozen rank runs no handler, so the SIGCONT that a
// resource manager's resume sends it (Slurm's proctrack/cgroup sends it to
// the tasks alone, and thaws its own cgroup, not the rank's) waits in the
// kernel's pending set: mpid reads it there, as the request the rank's
// handler would make (docs/slurm.md, "scontrol suspend and resume").
// Whoever may signal the rank may have it resume its job: the same as the
// handler's request.
func (r *registry) watchContinue(id string, t int64) {
	procs := r.procsOr()
	tick := time.NewTicker(contPoll)
	defer tick.Stop()
	for {
		select {
		case <-r.done:
			return
		case <-tick.C:
		}
		r.mu.Lock()
		j := r.jobs[id]
		held := j != nil && j.committed == t && j.resumed < t
		r.mu.Unlock()
		if !held {
			return
		}
		for _, rk := range r.ranks.Ranks(id) {
			// The pid read is the rank's: its process still holds it
			// after the read (a recycled pid would be another's signal).
			if procs.pending(rk.Pid, syscall.SIGCONT) && (rk.Proc() == nil || rk.Proc().Alive() == nil) {
				r.events.rankContinued(rk)
				return
			}
		}
	}
}

// answered says whether a rank's request of job id has been answered
// since: a pause signalled before the job's last resume here, or before
// the rank's last SIGCONT (the rank was frozen by the pause another rank
// asked for, or by a resource manager's freeze, and its own handler runs
// after the resume: pausing again would undo the user's resume), or a
// resume signalled before the last pause began here.
//
// Where the kernel times the rank's signals (signalClock) their generation
// times decide. Otherwise the handler's stamp does, and the looks at the
// last thaw (Thawing): a rank that had SIGTSTP pending or framed then
// stamps it after the resume, so its first pause request since (or
// unstamped) is that signal's; an unstamped request (a shim of an older
// release) is taken as it comes. A SIGTSTP a freeze that is not this
// node's caught is seen by the kernel's times alone.
func (r *registry) answered(id string, pid int, q ranks.Request) bool {
	sig, timed := r.signalTimes(pid)
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[id]
	if q.Overtaken {
		// The shim left it out itself; it answers what Thawing saw.
		if j != nil {
			delete(j.tstpHeld, pid)
		}
		return true
	}
	if j == nil {
		return false
	}
	if q.Op != "pause" {
		// Against the pause's beginning, not its commit: a SIGCONT handled
		// while the pause drained came after the request that began it.
		if timed && sig.Cont > 0 {
			return sig.Cont < j.pauseBegan
		}
		return q.At > 0 && q.At < j.pauseBegan
	}
	if timed && sig.Tstp > 0 {
		delete(j.tstpHeld, pid)
		return sig.Tstp < max(sig.Cont, j.resumed)
	}
	if q.At > 0 && q.At < j.resumed {
		return true
	}
	if j.tstpHeld[pid] {
		delete(j.tstpHeld, pid)
		return true
	}
	return false
}

// signalPending says whether process pid has signal sig pending (proc(5):
// ShdPnd for kill(2), SigPnd for its main thread). A frozen process's
// signals wait there; the shim's handlers of SIGTSTP and SIGCONT keep the
// kernel from discarding them.
func signalPending(pid int, sig syscall.Signal) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	return err == nil && statusPending(string(b), sig)
}

// statusPending is signalPending's reading of a /proc/PID/status text.
func statusPending(s string, sig syscall.Signal) bool {
	for _, line := range strings.Split(s, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok && (k == "SigPnd" || k == "ShdPnd") {
			if m, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err == nil && m&(1<<(sig-1)) != 0 {
				return true
			}
		}
	}
	return false
}
