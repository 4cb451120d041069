package mpid

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// job is what this node knows of one job.
type job struct {
	// id is the job's key (ranks.JobKey: "<owner uid>:<name>"), the name
	// of its cgroup, its records and its protocol messages; name is the id
	// its owner chose, what the CLI shows.
	id   string
	name string
	// dir is the cgroup mpid makes for the job's ranks that nobody else
	// placed (PlaceCreated), or the one it was given (PlaceFixed).
	dir string
	// places are the cgroups the job's ranks here are watched and frozen
	// in (placement.go), each with its Place* mode; own holds the ranks
	// (pid → cgroup) watched in a cgroup of their manager's as it is.
	// Under mu.
	places map[string]string
	own    map[int]string
	owner  uint32
	joined int             // ranks moved in by JOIN
	obs    loader.Observer // under mu; opened under obsMu (openObserver)
	obsMu  sync.Mutex
	// watched are the places obs watches; under obsMu.
	watched map[string]bool
	// unwatched, if set, says why the kernel cannot vouch for the job.
	unwatched string
	// Coordinator side (coordinator.go).
	state string // ctl.State*
	busy  bool
	// idle closes when the operation under way ends (whenIdle).
	idle chan struct{}
	// before is the state begin found, for unbegin.
	before string
	last   ctl.Job // the last pause or resume's figures
	since  time.Time
	// adopted: found at start, left by a previous mpid (state.go); what its
	// ranks' registrations told the old mpid comes from its record, until
	// they register again. missing: the adopted ranks (pids) that have not
	// registered again yet; the job cannot be paused before they have.
	adopted bool
	missing map[int]bool
	nodes   []string
	// coordinator is the node named by the job key (authority.go): the
	// only one whose protocol steps this node runs for the job.
	coordinator string
	size        int
	localRanks  []int
	// Coordinator side: remotes are the other nodes whose mpid registered
	// ranks of the job here; creator is the `mpipause run` that created it
	// (the job is kept while it lives, ranks or not).
	remotes map[string]bool
	// remotePlaces are where each remote node placed the job's ranks, as
	// its last registration said (for status only).
	remotePlaces map[string][]ctl.Cgroup
	creator      *os.Process
	// Other nodes: registered says the coordinator has confirmed this
	// node (registration is retried by sweep until it has, and repeated
	// so that a restarted coordinator learns its nodes again).
	registered bool
	token      string
	// resumed and committed are CLOCK_MONOTONIC (ns) when this node last
	// began to thaw the job (a resume or a rollback) and when a pause of it
	// last committed here; pauseBegan when the last pause that this node
	// coordinates began (prevPauseBegan: the one before, for unbegin). A
	// rank's request signalled before the operation that followed it has
	// been answered (answered). tstpHeld are the ranks (pids)
	// that had a SIGTSTP pending as that thaw began: a frozen rank runs no
	// handler, so its stamp comes after the thaw.
	resumed, committed         int64
	pauseBegan, prevPauseBegan int64
	tstpHeld                   map[int]bool
}

// registry is mpid's record of the jobs with ranks on this node, one file
// for each of its jobs: the table and each job's life, from its making to
// its end once nothing of it is left here (sweep), with its observer
// (this file); the admission of ranks (JOIN, HELLO) by their job key
// (admission.go); the registration of the job with its coordinator over
// the peer port, and on the coordinator the nodes that registered
// (registration.go); the adoption of the jobs a previous mpid left
// (adopt.go); the ranks' SIGTSTP and SIGCONT (signals.go); and the pauses
// and resumes it hands the coordinator (operation.go).
type registry struct {
	node string
	key  *quiesce.Keyring
	// parent is where job cgroups are made; fixed, if set, is the one
	// cgroup every job's ranks are in already (Config.FixedCgroup).
	parent, fixed string
	cgroups       Cgroups
	observers     Observers
	ranks         *ranks.Server
	// store keeps the records of the jobs whose pause may hold (state.go):
	// an operation's (operation.go), and adoption reads them at start.
	store *store
	// tr carries registrations to the jobs' coordinators.
	tr  quiesce.Transport
	log *slog.Logger
	// refusals keeps a rank that retries a refused JOIN or HELLO from
	// flooding the log.
	refusals *logLimiter
	// agent is this node's protocol agent: a job with a step of it under
	// way here is kept (Pausing); an ended job is forgotten there too.
	agent interface {
		Pausing(id string) bool
		Forget(id string)
	}
	// events hears what ranks ask for unasked (the coordinator).
	events rankEvents

	// procs is the look at the ranks' processes: the kernel's (nil), or a
	// test's, whose ranks are not frozen and whose processes are made up.
	procs processes
	// signals orders a rank's SIGTSTP against its SIGCONT and this node's
	// thaws by the kernel's generation times (signals.go); nil where the
	// kernel cannot keep them (no BTF, the program refused).
	signals signalClock
	// done closes when mpid stops.
	done <-chan struct{}
	// treeChanged hears (without blocking, buffered by one) that a node
	// registered ranks of a job this node coordinates (keepWarm).
	treeChanged chan struct{}

	// mu guards jobs and every job's fields but obs's opening (obsMu);
	// only the registry's methods and its operations take it.
	mu   sync.Mutex
	jobs map[string]*job
}

var (
	_ node.Jobs  = (*registry)(nil)
	_ ranks.Jobs = (*registry)(nil)
)

// processes is the look at a process: whether it has sig pending (a
// frozen rank runs no handler) and its parent.
type processes interface {
	pending(pid int, sig syscall.Signal) bool
	framed(pid int, entry uint64) bool
	parent(pid int) int
}

// kernelProcs reads /proc.
type kernelProcs struct{}

func (kernelProcs) pending(pid int, sig syscall.Signal) bool { return signalPending(pid, sig) }
func (kernelProcs) framed(pid int, entry uint64) bool        { return ranks.SignalFramed(pid, entry) }
func (kernelProcs) parent(pid int) int                       { return ppid(pid) }

// procsOr is r's look at processes, the kernel's unless a test set one.
func (r *registry) procsOr() processes {
	if r.procs == nil {
		return kernelProcs{}
	}
	return r.procs
}

// rankEvents hears what a rank asks for unasked: its SIGTSTP or SIGCONT
// (rankEvent), or a SIGCONT noticed pending on a rank of a job paused here
// (rankContinued, from watchContinue). The coordinator implements it.
type rankEvents interface {
	rankEvent(r *ranks.Rank, ev string)
	rankContinued(r *ranks.Rank)
}

// Event passes a rank's unasked line to the coordinator (rankEvents).
func (r *registry) Event(rk *ranks.Rank, ev string) { r.events.rankEvent(rk, ev) }

// jobDir is the cgroup of job's ranks on this node.
func (r *registry) jobDir(id string) string {
	if r.fixed != "" {
		return r.fixed
	}
	return filepath.Join(r.parent, id)
}

// newJobLocked makes the record of job name of uid, coordinated by coord.
func (r *registry) newJobLocked(uid uint32, name, coord string) (*job, error) {
	if uid != 0 {
		n := 0
		for _, o := range r.jobs {
			if o.owner == uid {
				n++
			}
		}
		if n >= maxJobsPerUser {
			return nil, fmt.Errorf("uid %d has %d jobs on %s, the most one user may have: let some end first", uid, n, r.node)
		}
	}
	key := jobid.Key(uid, name)
	// j.dir is made only for a rank placed in it (PlaceCreated): where a
	// manager placed the ranks it is never needed, and under systemd, whose
	// hierarchy root is read-only to mpid's unit, it could not be made.
	j := &job{id: key, name: name, dir: r.jobDir(key), owner: uid, coordinator: coord, state: ctl.StateRunning, since: time.Now()}
	if coord == r.node {
		j.remotes = map[string]bool{}
		r.noteTreeLocked()
	}
	r.jobs[key] = j
	return j, nil
}

// create makes job name of uid, coordinated by this node, for the
// `mpipause run` of pid, and answers with its job key. An id in use by
// one of the caller's jobs here is refused: two launches under one id
// would be one job to mpid.
func (r *registry) create(name string, uid uint32, pid int) ctl.Reply {
	r.mu.Lock()
	defer r.mu.Unlock()
	key := jobid.Key(uid, name)
	if r.jobs[key] != nil {
		return ctl.Reply{Err: ctl.Errorf(ctl.CodeState, "job id %s is in use by a job of yours on %s: choose another (--jobid), or let it end", name, r.node), Final: true}
	}
	j, err := r.newJobLocked(uid, name, r.node)
	if err != nil {
		return ctl.Reply{Err: ctl.Errorf(ctl.CodeUnavailable, "%v", err), Final: true}
	}
	// os.FindProcess holds a pidfd: a later pid of the same number is
	// never taken for the creator.
	if p, err := os.FindProcess(pid); err == nil {
		j.creator = p
	}
	r.log.Info("job created", "job", key, "pid", pid)
	v := ctl.Job{ID: name, Owner: uid, State: j.state, Node: r.node, Coordinator: r.node, Nodes: []string{r.node}, Since: j.since}
	return ctl.Reply{Job: &v, Token: JobToken(r.key.Current(), uid, name, r.node), Final: true}
}

// lookup finds the job a caller of uid means by name: their own job of
// that id; for root, "UID:ID" or the one job of that id, whoever owns it.
// A job of someone else's is unknown to a stranger, owner and all.
func (r *registry) lookup(name string, uid uint32) (string, error) {
	if uid != 0 {
		return jobid.Key(uid, name), nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.jobs[name] != nil {
		return name, nil
	}
	var keys []string
	for k, j := range r.jobs {
		if j.name == name {
			keys = append(keys, k)
		}
	}
	switch len(keys) {
	case 0:
		return jobid.Key(0, name), nil
	case 1:
		return keys[0], nil
	}
	slices.Sort(keys)
	return "", ctl.Errorf(ctl.CodeBadRequest, "%d users have a job %s on %s: name one as UID:ID (%s)", len(keys), name, r.node, strings.Join(keys, ", "))
}

// openObserver attaches the kernel observer to the job's cgroup. Loading
// BPF programs takes tens of milliseconds: it holds the job's own lock, not
// r.mu, which every pause and resume of every job takes.
func (r *registry) openObserver(j *job) error {
	j.obsMu.Lock()
	defer j.obsMu.Unlock()
	r.mu.Lock()
	obs, dirs := j.obs, placesLocked(j)
	r.mu.Unlock()
	if obs != nil {
		return r.watchLocked(j, obs, dirs)
	}
	obs, err := r.observers.Open(j.id, dirs)
	if err != nil {
		return fmt.Errorf("observe job %s: %w", j.id, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.jobs[j.id] != j {
		// The job ended meanwhile; its successor of the same key (if
		// any) opens its own.
		obs.Close()
		return fmt.Errorf("job %s ended", j.id)
	}
	j.obs = obs
	j.watched = map[string]bool{}
	for _, dir := range dirs {
		j.watched[dir] = true
	}
	return nil
}

// watchLocked adds to obs the places of j it does not watch yet (a rank
// that joined into a cgroup of its own). Called with j.obsMu held.
func (r *registry) watchLocked(j *job, obs loader.Observer, dirs []string) error {
	w, ok := obs.(loader.Watcher)
	for _, dir := range dirs {
		if j.watched[dir] {
			continue
		}
		if !ok {
			return fmt.Errorf("observe job %s: its %s observer watches one cgroup, and the job's ranks here are in several", j.id, obs.Kind())
		}
		if err := w.Watch(dir); err != nil {
			return fmt.Errorf("observe job %s: %w", j.id, err)
		}
		j.watched[dir] = true
	}
	return nil
}

// Observer is the node role's access to a job's observer.
func (r *registry) Observer(id string) (loader.Observer, error) {
	r.mu.Lock()
	j := r.jobs[id]
	r.mu.Unlock()
	if j == nil {
		return nil, fmt.Errorf("job %s is not known on %s", id, r.node)
	}
	if err := r.openObserver(j); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return j.obs, nil
}

// Cgroups is the node role's access to a job's cgroups: the ones to
// freeze.
func (r *registry) Cgroups(id string) ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if j := r.jobs[id]; j != nil {
		if len(j.places) == 0 {
			// No rank placed yet (an adopted job's ranks register only
			// once thawed): the cgroup it was found in, if any.
			if _, err := r.cgroups.Populated(j.dir); errors.Is(err, os.ErrNotExist) {
				return nil, nil
			}
			return []string{j.dir}, nil
		}
		return placesLocked(j), nil
	}
	return nil, fmt.Errorf("job %s is not known on %s", id, r.node)
}

// The coordinator's and the node steps' access to a job: each method holds
// r.mu for what it reads and writes, and nothing outside this file touches
// r.mu or r.jobs.

// count is the number of jobs this node knows.
func (r *registry) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.jobs)
}

// visible returns, sorted, the keys of the jobs a caller of uid may see:
// all for root, their own otherwise.
func (r *registry) visible(uid uint32) []string {
	r.mu.Lock()
	ids := make([]string, 0, len(r.jobs))
	for id, j := range r.jobs {
		if uid == 0 || uid == j.owner {
			ids = append(ids, id)
		}
	}
	r.mu.Unlock()
	slices.Sort(ids)
	return ids
}

// jobView is what one look at a job under r.mu gives the coordinator's
// view: v is the job's last figures with its name, owner, since, why it
// cannot be paused and its nodes as this node knows them (itself, then, on
// its coordinator, every node that registered ranks of it); the rest is
// what the job's record says, for the coordinator to complete v with.
type jobView struct {
	v                  ctl.Job
	state, coordinator string
	coordinated        bool // this node is the job's coordinator
	adopted            bool
	nodes              []string
	size               int
	localRanks         []int
}

// view takes a jobView of job id; false if the job is not known here.
func (r *registry) view(id string) (jobView, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[id]
	if j == nil {
		return jobView{}, false
	}
	v := j.last
	v.ID, v.Owner, v.Since, v.Unpausable = j.name, j.owner, j.since, j.unwatched
	if v.Unpausable == "" {
		v.Unpausable = r.missingLocked(j)
	}
	v.Cgroups = r.placedLocked(j)
	jv := jobView{state: j.state, coordinator: j.coordinator, coordinated: j.coordinator == r.node,
		adopted: j.adopted, nodes: j.nodes, size: j.size, localRanks: j.localRanks}
	v.Nodes = []string{r.node}
	if jv.coordinated {
		v.Nodes = r.nodesLocked(j)
		for _, n := range v.Nodes[1:] {
			v.Cgroups = append(v.Cgroups, j.remotePlaces[n]...)
		}
	}
	jv.v = v
	return jv, true
}

// WithJob calls fn, under r.mu, with job id's owner and coordinator (0 and
// "" if the job is not known here): the node's record of a committed pause
// is read and written there, never across the coordinator's (save).
func (r *registry) WithJob(id string, fn func(owner uint32, coordinator string) error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if j := r.jobs[id]; j != nil {
		return fn(j.owner, j.coordinator)
	}
	return fn(0, "")
}

// Changed hears of a rank that registers or goes, and of a refused one:
// a job may end with its last rank, and a refusal is logged (bounded).
func (r *registry) Changed(rk *ranks.Rank, gone bool, err error) {
	switch {
	case err != nil && !gone:
		if ok, held := r.refusals.allow(err.Error()); ok {
			r.log.Warn("rank refused", "error", err, "repeats_not_logged", held)
		}
	case gone:
		if err == nil {
			r.log.Info("rank gone", "job", rk.Job, "rank", rk.Rank, "pid", rk.Pid)
		} else if ok, held := r.refusals.allow(fmt.Sprintf("cut off: uid %d", rk.UID)); ok {
			// One line per user and interval, whatever the pids.
			r.log.Warn("rank cut off", "error", err, "repeats_not_logged", held)
		}
		r.mu.Lock()
		if j := r.jobs[rk.JobKey()]; j != nil {
			r.pruneLocked(j)
			r.maybeEndLocked(j)
		}
		r.mu.Unlock()
		r.unwatchSignals(rk)
	default:
		// Its shim's control thread is raised only for a pause step
		// (node.Role.Prepare), never for registering.
		r.log.Info("rank registered", "job", rk.Job, "rank", rk.Rank, "size", rk.Size, "pid", rk.Pid, "host", rk.Host)
		r.watchSignals(rk)
	}
}

// maybeEndLocked forgets a job once no process of it is left on this node
// and no pause of it is under way here. A pause whose ranks here all died
// mid-way must still find the job: its next step then names the ranks that
// exited (not "never prepared here", as a forgotten job did), and its
// rollback finds the cgroup to thaw; sweep ends the job after that.
func (r *registry) maybeEndLocked(j *job) {
	if j.busy || len(r.ranks.Ranks(j.id)) > 0 || r.agent.Pausing(j.id) || len(j.remotes) > 0 {
		return
	}
	if j.creator != nil {
		if !errors.Is(j.creator.Signal(syscall.Signal(0)), os.ErrProcessDone) {
			return // `mpipause run` is still launching or running it
		}
		j.creator.Release()
		j.creator = nil
	}
	if !r.emptyLocked(j) {
		return
	}
	if j.coordinator != "" && j.coordinator != r.node && j.token != "" {
		go r.unregister(j.id, j.coordinator, j.token, j.owner)
	}
	r.log.Info("job ended", "job", j.id)
	r.closeJobLocked(j, true)
	delete(r.jobs, j.id)
	r.store.drop(j.id)
	r.agent.Forget(j.id)
	r.ranks.Forget(j.id)
}

func (r *registry) closeJobLocked(j *job, unpin bool) {
	if j.obs != nil {
		j.obs.Close()
		j.obs = nil
		if unpin {
			if err := r.observers.Unpin(j.id); err != nil {
				r.log.Warn("unpin", "job", j.id, "error", err)
			}
		}
	}
	if unpin && r.fixed == "" {
		for _, dir := range append(placesLocked(j), j.dir) {
			if mode := j.places[dir]; mode == PlaceOwn || mode == PlaceFixed {
				continue // its manager's
			}
			if busy, err := r.cgroups.Populated(dir); err == nil && !busy {
				if err := r.cgroups.Remove(dir); err != nil {
					r.log.Warn("remove job cgroup", "job", j.id, "cgroup", dir, "error", err)
				}
			}
		}
	}
}

// close closes the observers; their pinned state stays unless unpin.
func (r *registry) close(unpin bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, j := range r.jobs {
		r.closeJobLocked(j, unpin)
	}
}

// sweep ends jobs whose processes all left without a rank's goodbye (a JOIN
// whose rank died before MPI_Init registered it), and repeats this node's
// registrations.
func (r *registry) sweep(ctx context.Context) error {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		r.mu.Lock()
		for _, j := range r.jobs {
			r.pruneLocked(j)
			r.maybeEndLocked(j)
			if r.jobs[j.id] == j && j.coordinator != "" && j.coordinator != r.node && j.token != "" {
				// Again and again: a restarted coordinator learns its
				// nodes back this way.
				go r.register(j.id, j.coordinator, j.token, j.owner)
			}
		}
		r.mu.Unlock()
	}
}
