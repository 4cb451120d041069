package mpid

import (
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
)

// operation is one pause or resume of a job that this node coordinates,
// as the registry hands it out (begin, claimFailed): it holds the job busy
// until it ends, and it keeps the job's record (state.go) true of the
// job's state as it goes. The coordinator runs the protocol between its
// steps and never touches the store.
//
// The record exists while a pause of the job may hold anywhere: written
// before a pause's first step (record), rewritten when the pause holds
// (endRecorded), kept while a failed rollback is unconfirmed, and removed
// when an operation ends with the job running. Each of these is done under
// the registry's lock with the job's state change, so no other operation
// of the job can begin between them (and, say, have its pausing record
// removed by this one's end).
type operation struct {
	r *registry
	j *job
	// v is the job as the coordinator sees it (its nodes, coordinator,
	// ranks): what its record says.
	v ctl.Job
}

// begin marks the job busy for op if its state allows op, and returns the
// operation; v is the job as the coordinator sees it.
func (r *registry) begin(id, op string, v ctl.Job) (*operation, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[id]
	if j == nil {
		return nil, ctl.Errorf(ctl.CodeUnknownJob, "job %s ended", id)
	}
	if j.busy {
		return nil, ctl.Errorf(ctl.CodeState, "job %s is %s: wait for it to finish", id, j.state)
	}
	j.before = j.state
	switch op {
	case ctl.OpPause:
		if j.state == ctl.StatePaused {
			return nil, ctl.Errorf(ctl.CodeState, "job %s is already paused (since %s); resume it with `mpipause resume %s`",
				id, j.since.Format(time.TimeOnly), id)
		}
		if j.unwatched != "" {
			return nil, ctl.Errorf(ctl.CodeUnpausable, "job %s cannot be paused cleanly: %s", id, j.unwatched)
		}
		if why := r.missingLocked(j); why != "" {
			return nil, ctl.Errorf(ctl.CodeUnpausable, "job %s cannot be paused yet: %s", id, why)
		}
		j.state = ctl.StatePausing
	case ctl.OpResume:
		if j.state == ctl.StateRunning {
			return nil, ctl.Errorf(ctl.CodeState, "job %s is running, not paused: nothing to resume", id)
		}
		j.state = ctl.StateResuming
	}
	if op == ctl.OpPause {
		j.prevPauseBegan, j.pauseBegan = j.pauseBegan, monotonic()
	}
	busyLocked(j)
	return &operation{r: r, j: j, v: v}, nil
}

// claimFailed begins a retry of job id's rollback if it is known, not
// busy and failed (a rollback some node did not confirm): the operation,
// with the job's last figures; false leaves the job alone.
func (r *registry) claimFailed(id string, v ctl.Job) (*operation, ctl.Job, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[id]
	if j == nil || j.busy || j.state != ctl.StateFailed {
		return nil, ctl.Job{}, false
	}
	busyLocked(j)
	return &operation{r: r, j: j, v: v}, j.last, true
}

// busyLocked and idleLocked mark j busy with an operation and done with
// it; idle wakes whoever waits for the job (whenIdle).
func busyLocked(j *job) {
	j.busy = true
	j.idle = make(chan struct{})
}

func idleLocked(j *job) {
	j.busy = false
	if j.idle != nil {
		close(j.idle)
		j.idle = nil
	}
}

// whenIdle is a channel that closes when job id's operation under way
// ends; nil if none is.
func (r *registry) whenIdle(id string) <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if j := r.jobs[id]; j != nil && j.busy {
		return j.idle
	}
	return nil
}

// undo ends an operation refused before it touched anything: the job is
// as begin found it.
func (o *operation) undo() {
	r, j := o.r, o.j
	r.mu.Lock()
	defer r.mu.Unlock()
	idleLocked(j)
	if j.state == ctl.StatePausing {
		j.pauseBegan = j.prevPauseBegan
	}
	j.state = j.before
	r.maybeEndLocked(j)
}

// record writes the job's record of its pause under way (state pausing),
// before the pause's first step: a successor of this mpid finds it and
// rolls the pause back everywhere (adopt).
func (o *operation) record() error {
	r, j := o.r, o.j
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.store.write(o.recordLocked(j.state, j.since, j.last))
}

func (o *operation) recordLocked(state string, since time.Time, last ctl.Job) record {
	v := o.v
	return record{Version: recordVersion, Job: o.j.id, Owner: o.j.owner, State: state, Since: since,
		Nodes: v.Nodes, Coordinator: v.Coordinator, Ranks: v.Ranks, LocalRanks: v.LocalRanks, Last: last, Cgroups: placesLocked(o.j)}
}

// end records the outcome of the operation, the job now in state, and
// returns fig as of now. A job running again has no pause to record: its
// record goes.
func (o *operation) end(state string, fig ctl.Job) ctl.Job {
	r, j := o.r, o.j
	r.mu.Lock()
	defer r.mu.Unlock()
	idleLocked(j)
	j.state = state
	j.since = time.Now()
	fig.State, fig.Since = state, j.since
	j.last = fig
	if state == ctl.StateRunning {
		r.store.drop(j.id)
	}
	r.maybeEndLocked(j)
	return fig
}

// endRecorded is end for an outcome that counts only once recorded (a
// pause that holds): the record of the job in that state is written
// first, and if it cannot be, the job stays as it was, still busy, and the
// error says why.
func (o *operation) endRecorded(state string, fig ctl.Job) (ctl.Job, error) {
	r, j := o.r, o.j
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	fig.State, fig.Since = state, now
	if err := r.store.write(o.recordLocked(state, now, fig)); err != nil {
		return fig, err
	}
	idleLocked(j)
	j.state, j.since, j.last = state, now, fig
	r.maybeEndLocked(j)
	return fig, nil
}
