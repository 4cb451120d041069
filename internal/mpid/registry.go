package mpid

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
	"golang.org/x/sys/unix"
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

// registry is mpid's record of the jobs with ranks on this node: it admits
// ranks (JOIN, HELLO) by their job key, makes each job's cgroup and opens
// its observer, registers the job with its coordinator over the peer port
// (and, on the coordinator, keeps the nodes that registered), and forgets a
// job once nothing of it is left here (sweep).
type registry struct {
	node string
	key  *quiesce.Keyring
	// parent is where job cgroups are made; fixed, if set, is the one
	// cgroup every job's ranks are in already (Config.FixedCgroup).
	parent, fixed string
	cgroups       Cgroups
	observers     Observers
	ranks         *ranks.Server
	// tr carries registrations to the jobs' coordinators.
	tr  quiesce.Transport
	log *slog.Logger
	// refusals keeps a rank that retries a refused JOIN or HELLO from
	// flooding the log.
	refusals *logLimiter
	// pausing says whether a protocol step of the job is under way on this
	// node (the agent's): its job is kept. ended is told the job is gone.
	pausing func(id string) bool
	ended   func(id string)

	// tstpPending and contPending, if set, stand for the look at a rank's
	// pending SIGTSTP and SIGCONT (tests: their ranks are not frozen
	// processes).
	tstpPending, contPending func(pid int) bool
	// continued, if set, is told of a rank of a job paused here that has a
	// SIGCONT pending (watchContinue); done closes when mpid stops.
	continued func(r *ranks.Rank)
	done      <-chan struct{}
	// treeChanged hears (without blocking, buffered by one) that a node
	// registered ranks of a job this node coordinates (keepWarm).
	treeChanged chan struct{}
	// parentOf, if set, stands for the look at a process's parent
	// (tests: their processes are made up).
	parentOf func(pid int) int

	// mu guards jobs and every job's fields but obs's opening (obsMu);
	// only this file's methods take it.
	mu   sync.Mutex
	jobs map[string]*job
}

// jobDir is the cgroup of job's ranks on this node.
func (r *registry) jobDir(id string) string {
	if r.fixed != "" {
		return r.fixed
	}
	return filepath.Join(r.parent, id)
}

// maxJobsPerUser bounds the jobs one user can make mpid keep (each is a
// cgroup and a set of BPF programs).
const maxJobsPerUser = 64

// authorizeLocked returns the job a process of uid asks to join as job
// name with job key token, making its record (and cgroup) if it is new
// here: the key must be this job's (authority.go). The job then names its
// coordinator; a new job on another node than the coordinator registers
// there (register).
func (r *registry) authorizeLocked(uid uint32, name, token string) (*job, error) {
	if err := ctl.ValidJobID(name); err != nil {
		return nil, err
	}
	coord, err := checkToken(r.key, uid, name, token)
	if err != nil {
		return nil, err
	}
	key := ranks.JobKey(uid, name)
	j := r.jobs[key]
	switch {
	case j == nil:
		if j, err = r.newJobLocked(uid, name, coord); err != nil {
			return nil, err
		}
	case j.coordinator == "":
		// Adopted without a record that names it.
		j.coordinator = coord
	case j.coordinator != coord:
		return nil, fmt.Errorf("job %s of uid %d is coordinated by %s, and this rank's job key names %s: two launches under one job id? give each its own", name, uid, j.coordinator, coord)
	}
	if coord != r.node && j.token == "" {
		j.token = token
		go r.register(j.id, coord, token, uid)
	}
	return j, nil
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
	key := ranks.JobKey(uid, name)
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
	key := ranks.JobKey(uid, name)
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
		return ranks.JobKey(uid, name), nil
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
		return ranks.JobKey(0, name), nil
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

// observer is the node role's access to a job's observer.
func (r *registry) observer(id string) (loader.Observer, error) {
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

// cgroupsOf is the node role's access to a job's cgroups: the ones to
// freeze.
func (r *registry) cgroupsOf(id string) ([]string, error) {
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

// nodesLocked is the node list of a pause or resume of j, which this node
// coordinates: this node first, then the nodes that registered ranks of
// it, sorted. The rounds' tree is a function of it (quiesce.Subtree).
func (r *registry) nodesLocked(j *job) []string {
	nodes := make([]string, 0, 1+len(j.remotes))
	nodes = append(nodes, r.node)
	for n := range j.remotes {
		nodes = append(nodes, n)
	}
	slices.Sort(nodes[1:])
	return nodes
}

// noteTreeLocked tells keepWarm that a job this node coordinates has a new
// edge in its tree, whose connection is best made now rather than in the
// job's first pause.
func (r *registry) noteTreeLocked() {
	select {
	case r.treeChanged <- struct{}{}:
	default:
	}
}

// warmable lists, once per node list, the jobs this node coordinates that
// no pause or resume is busy with, with their node lists: the trees whose
// connections keepWarm keeps ready.
func (r *registry) warmable() map[string][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string][]string{}
	seen := map[string]bool{}
	for id, j := range r.jobs {
		if j.coordinator != r.node || j.busy {
			continue
		}
		nodes := r.nodesLocked(j)
		k := strings.Join(nodes, "\x00")
		if !seen[k] {
			seen[k] = true
			out[id] = nodes
		}
	}
	return out
}

// begin marks the job busy for op if its state allows op.
func (r *registry) begin(id, op string) (*job, error) {
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
	return j, nil
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

// unbegin undoes begin for an operation refused before it touched
// anything: the job is as begin found it.
func (r *registry) unbegin(j *job) {
	r.mu.Lock()
	defer r.mu.Unlock()
	idleLocked(j)
	if j.state == ctl.StatePausing {
		j.pauseBegan = j.prevPauseBegan
	}
	j.state = j.before
	r.maybeEndLocked(j)
}

// claimFailed marks job id busy if it is known, not busy and failed (a
// rollback some node did not confirm), and returns it with its last
// figures; false leaves it alone.
func (r *registry) claimFailed(id string) (*job, ctl.Job, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[id]
	if j == nil || j.busy || j.state != ctl.StateFailed {
		return nil, ctl.Job{}, false
	}
	busyLocked(j)
	return j, j.last, true
}

// end records the outcome of an operation begun (begin, claimFailed) and
// returns fig as of now.
func (r *registry) end(j *job, state string, fig ctl.Job) ctl.Job {
	r.mu.Lock()
	defer r.mu.Unlock()
	idleLocked(j)
	j.state = state
	j.since = time.Now()
	fig.State, fig.Since = state, j.since
	j.last = fig
	r.maybeEndLocked(j)
	return fig
}

// save writes st's record of j, as the coordinator sees it (v: its nodes,
// coordinator and ranks): its pause under way (state pausing, written
// before the first step; endRecorded writes the paused one). Under r.mu, as
// every record of a pause is (withJob).
func (r *registry) save(j *job, v ctl.Job, st *store) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec := record{Version: recordVersion, Job: j.id, Owner: j.owner, State: j.state, Since: j.since,
		Nodes: v.Nodes, Coordinator: v.Coordinator, Ranks: v.Ranks, LocalRanks: v.LocalRanks, Last: j.last, Cgroups: placesLocked(j)}
	return st.write(rec)
}

// endRecorded is end for an outcome that counts only once recorded (a
// pause that holds): the record of j in that state is written first, and
// if it cannot be, j stays as it was, still busy, and the error says why.
// Under r.mu throughout, so no other operation on j starts in between.
func (r *registry) endRecorded(j *job, state string, fig ctl.Job, v ctl.Job, st *store) (ctl.Job, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	fig.State, fig.Since = state, now
	rec := record{Version: recordVersion, Job: j.id, Owner: j.owner, State: state, Since: now,
		Nodes: v.Nodes, Coordinator: v.Coordinator, Ranks: v.Ranks, LocalRanks: v.LocalRanks, Last: fig, Cgroups: placesLocked(j)}
	if err := st.write(rec); err != nil {
		return fig, err
	}
	idleLocked(j)
	j.state, j.since, j.last = state, now, fig
	r.maybeEndLocked(j)
	return fig, nil
}

// withJob calls fn, under r.mu, with job id's owner and coordinator (0 and
// "" if the job is not known here): the node's record of a committed pause
// is read and written there, never across the coordinator's (save).
func (r *registry) withJob(id string, fn func(owner uint32, coordinator string) error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if j := r.jobs[id]; j != nil {
		return fn(j.owner, j.coordinator)
	}
	return fn(0, "")
}

// join places a rank of a job (placement.go) before it opens any socket:
// the kernel files a socket under its creator's cgroup at creation, for
// good, and the job's observer watches the rank's place from then on.
func (r *registry) join(req ranks.JoinRequest) error {
	j, pl, err := r.joinLocked(req)
	if err != nil || j == nil {
		return err
	}
	if err := r.openObserver(j); err != nil {
		return err
	}
	r.log.Info("rank joined", "job", j.id, "pid", req.Proc.Pid, "uid", req.Proc.UID, "cgroup", pl.Dir, "placed", pl.Mode)
	return nil
}

func (r *registry) joinLocked(req ranks.JoinRequest) (*job, placement, error) {
	p := req.Proc
	r.mu.Lock()
	defer r.mu.Unlock()
	j, err := r.authorizeLocked(p.UID, req.Job, req.Key)
	if err != nil {
		return nil, placement{}, err
	}
	if r.fixed != "" {
		if err := r.cgroups.Holds(r.fixed, p.Pid); err != nil {
			return nil, placement{}, err
		}
		// Alive after the read: what it read was the process's.
		return nil, placement{}, r.settleLocked(j, p, placement{Dir: r.fixed, Mode: PlaceFixed})
	}
	pl, err := r.placeLocked(j, p.Pid)
	if err != nil {
		return nil, placement{}, err
	}
	if err := r.settleLocked(j, p, pl); err != nil {
		return nil, placement{}, err
	}
	j.joined++
	return j, pl, nil
}

// admit accepts a rank's HELLO. A rank that did not JOIN first may have
// sockets the kernel files under another cgroup: it is admitted (it can be
// frozen) but the job is marked unpausable, because no kernel check could
// vouch for those sockets.
func (r *registry) admit(rk *ranks.Rank) error {
	j, err := r.admitLocked(rk)
	if err != nil {
		return err
	}
	return r.openObserver(j)
}

func (r *registry) admitLocked(rk *ranks.Rank) (*job, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	j, err := r.authorizeLocked(rk.UID, rk.Job, rk.Key)
	if err != nil {
		return nil, fmt.Errorf("rank %d (pid %d, uid %d) of job %s: %w", rk.Rank, rk.Pid, rk.UID, rk.Job, err)
	}
	if rk.Size > j.size {
		j.size = rk.Size
	}
	if r.fixed != "" {
		if err := r.cgroups.Holds(r.fixed, rk.Pid); err != nil {
			return nil, err
		}
		if err := r.settleLocked(j, rk.Proc(), placement{Dir: r.fixed, Mode: PlaceFixed}); err != nil {
			return nil, err
		}
	} else if !r.inPlaceLocked(j, rk.Pid) {
		pl, err := r.placeLocked(j, rk.Pid)
		if err != nil {
			return nil, err
		}
		if err := r.settleLocked(j, rk.Proc(), pl); err != nil {
			return nil, err
		}
		// Where it is, every socket it made is its cgroup's, which is
		// watched now; a move leaves those it made before behind.
		if pl.Move && j.unwatched == "" {
			j.unwatched = fmt.Sprintf("rank %d (pid %d on %s) registered without joining its job cgroup at start, so the kernel cannot check its connections; launch the job with `mpipause run`", rk.Rank, rk.Pid, r.node)
		}
	}
	if j.adopted && j.missing[rk.Pid] {
		delete(j.missing, rk.Pid)
		if r.missingLocked(j) == "" {
			r.log.Info("every rank of the adopted job registered again; it can be paused", "job", j.id)
			j.adopted = false
		}
	}
	return j, nil
}

// missingLocked says why an adopted job cannot be paused yet: some of the
// ranks the previous mpid had registered have not registered with this one
// (a shim does so as soon as it runs: a paused job's after its resume).
// Ranks that have exited meanwhile are not waited for.
func (r *registry) missingLocked(j *job) string {
	if !j.adopted {
		return ""
	}
	var pids []int
	for pid := range j.missing {
		// Only ESRCH means gone: under the unit mpid has no CAP_KILL, and
		// kill(pid, 0) on another user's live rank fails with EPERM.
		if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			delete(j.missing, pid)
			continue
		}
		pids = append(pids, pid)
	}
	if len(pids) == 0 {
		return ""
	}
	slices.Sort(pids)
	return fmt.Sprintf("mpid on %s restarted since its ranks registered, and %s (pid %s) not registered again yet; "+
		"a rank does as soon as it runs (resume the job first if it is paused)",
		r.node, plural(len(pids), "rank"), joinInts(pids))
}

// unready is the node role's question: why the job cannot be gated yet,
// or why its kernel check here could not vouch for it. The coordinator
// knows only its own node's reasons (begin): every node asks its own at
// PREPARE, so a pause is refused wherever one holds.
func (r *registry) unready(id string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if j := r.jobs[id]; j != nil {
		if j.unwatched != "" {
			return "cannot be paused cleanly: " + j.unwatched
		}
		return r.missingLocked(j)
	}
	return ""
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

func (r *registry) rankChanged(rk *ranks.Rank, gone bool, err error) {
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
	default:
		// Its shim's control thread is raised only for a pause step
		// (node.Role.Prepare), never for registering.
		r.log.Info("rank registered", "job", rk.Job, "rank", rk.Rank, "size", rk.Size, "pid", rk.Pid, "host", rk.Host)
	}
}

// maybeEndLocked forgets a job once no process of it is left on this node
// and no pause of it is under way here. A pause whose ranks here all died
// mid-way must still find the job: its next step then names the ranks that
// exited (not "never prepared here", as a forgotten job did), and its
// rollback finds the cgroup to thaw; sweep ends the job after that.
func (r *registry) maybeEndLocked(j *job) {
	if j.busy || len(r.ranks.Ranks(j.id)) > 0 || r.pausing(j.id) || len(j.remotes) > 0 {
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
	r.ended(j.id)
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

// Registration: the coordinator of a job learns its nodes from the nodes
// themselves, over the authenticated peer port, each presenting the job key
// one of its ranks presented; never from what rank 0 says (docs/security.md).
// The coordinator's side is peer.registered.
const (
	opRegister   = "register"
	opUnregister = "unregister"
)

// registerTimeout bounds one registration call; sweep repeats it.
const registerTimeout = 5 * time.Second

// register tells job key's coordinator that this node has ranks of it, and
// where it placed them.
func (r *registry) register(key, coord, token string, uid uint32) {
	size := 0
	for _, rk := range r.ranks.Ranks(key) {
		size = max(size, rk.Size)
	}
	var places []ctl.Cgroup
	r.mu.Lock()
	if j := r.jobs[key]; j != nil {
		places = r.placedLocked(j)
	}
	r.mu.Unlock()
	if len(places) > maxRemoteCgroups {
		places = places[:maxRemoteCgroups]
	}
	err := r.registration(key, coord, &peerControl{Op: opRegister, UID: uid, Token: token, Node: r.node, Size: size, Cgroups: places})
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[key]
	if j == nil {
		return
	}
	if err != nil {
		if ok, held := r.refusals.allow("register " + key); ok {
			r.log.Warn("the job's coordinator did not confirm this node yet; retried", "job", key, "coordinator", coord, "error", err, "repeats_not_logged", held)
		}
		return
	}
	if !j.registered {
		r.log.Info("registered with the job's coordinator", "job", key, "coordinator", coord)
	}
	j.registered = true
	j.token = token
}

// unregister tells the coordinator that the job ended on this node.
func (r *registry) unregister(key, coord, token string, uid uint32) {
	if err := r.registration(key, coord, &peerControl{Op: opUnregister, UID: uid, Token: token, Node: r.node}); err != nil {
		r.log.Info("the job's coordinator was not told that the job ended here", "job", key, "coordinator", coord, "error", err)
	}
}

func (r *registry) registration(key, coord string, c *peerControl) error {
	ctx, cancel := context.WithTimeout(context.Background(), registerTimeout)
	defer cancel()
	m := c.message(key, coord)
	m.Coordinator = coord
	rep, err := r.tr.Call(ctx, coord, m)
	if err == nil && rep.Err != "" {
		err = errors.New(rep.Err)
	}
	if err == nil && rep.Payload != nil {
		// An answer without a payload was taken as done, as before.
		var ans *peerControl
		if ans, err = decodeControl(rep); err == nil && ans.Code != "" {
			err = errors.New(ans.Message)
		}
	}
	return err
}

// remote records (add) or forgets a node's registration of job key on its
// coordinator, making the job here if it is new (a node may register
// before the coordinator's own ranks, or `mpipause run`, made it). The
// key was checked by the caller (peer.registered).
func (r *registry) remote(key string, uid uint32, name, node string, size int, places []ctl.Cgroup, add bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[key]
	if !add {
		if j != nil && j.remotes[node] {
			delete(j.remotes, node)
			delete(j.remotePlaces, node)
			r.log.Info("job ended on a node", "job", key, "node", node)
			r.maybeEndLocked(j)
		}
		return nil
	}
	if j == nil {
		var err error
		if j, err = r.newJobLocked(uid, name, r.node); err != nil {
			return err
		}
	}
	if j.remotes == nil {
		j.remotes = map[string]bool{}
	}
	if !j.remotes[node] {
		r.log.Info("node registered ranks of the job", "job", key, "node", node)
		r.noteTreeLocked()
	}
	j.remotes[node] = true
	if j.remotePlaces == nil {
		j.remotePlaces = map[string][]ctl.Cgroup{}
	}
	j.remotePlaces[node] = places
	if size > j.size {
		j.size = size
	}
	return nil
}

// coordinatorOf is the coordinator this node knows for job key ("" if the
// job is unknown here, or adopted without a record that names it).
func (r *registry) coordinatorOf(key string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if j := r.jobs[key]; j != nil {
		return j.coordinator
	}
	return ""
}

// adopt brings back, at start, the jobs whose cgroups outlived the previous
// mpid: paused if the cgroup is frozen and a committed pause is recorded,
// thawed if it is frozen without one (the pause never committed), running
// otherwise; a pause the previous mpid was coordinating is rolled back on
// every node (the returned records, to roll back once mpid serves:
// coordinator.confirmRollback). Their ranks registered with the old mpid;
// the job can be paused again once all of them have registered with this
// one. The records of jobs gone meanwhile are dropped.
func (r *registry) adopt(st *store) (interrupted []record) {
	if r.fixed != "" {
		return nil
	}
	recs := st.load()
	// Where each job's ranks may be: mpid's own cgroups under its parent
	// (found by name), and the cgroups a record of a pause names (found
	// wherever the ranks' launcher had put them).
	found := map[string]map[string]string{}
	add := func(id, dir, mode string) {
		if found[id] == nil {
			found[id] = map[string]string{}
		}
		found[id][dir] = mode
	}
	entries, _ := os.ReadDir(r.parent)
	for _, e := range entries {
		if e.IsDir() {
			add(e.Name(), filepath.Join(r.parent, e.Name()), PlaceCreated)
		}
	}
	for id, rec := range recs {
		for _, dir := range rec.Cgroups {
			if filepath.Base(dir) == innerName(id) {
				add(id, dir, PlaceInner)
			} else if dir != filepath.Join(r.parent, id) {
				add(id, dir, PlaceOwn)
			}
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, dirs := range found {
		if r.jobs[id] != nil {
			continue
		}
		owner, name, ok := ranks.SplitJobKey(id)
		if !ok {
			// Not a job of this release's layout (<uid>:<id>): left alone.
			continue
		}
		var procs []int
		var past []string
		frozen, alive := false, false
		for dir := range dirs {
			ps, err := r.cgroups.Members(dir)
			if errors.Is(err, cgroupv2.ErrTooMany) {
				// Its owner made more cgroups below it than mpid walks.
				// Dropping it would split the job (a paused one left
				// frozen there for good, the rest resumed), so it stays
				// a place of the job, which can be resumed but not
				// paused again: its ranks are looked for in it alone,
				// and the kernel check would not read the tree either.
				past = append(past, err.Error())
				ps, _ = r.cgroups.Procs(dir)
				if busy, _ := r.cgroups.Populated(dir); !busy {
					delete(dirs, dir)
					continue
				}
				alive = true
			} else if err != nil || len(ps) == 0 {
				delete(dirs, dir)
				continue
			}
			procs, alive = append(procs, ps...), true
			if f, _ := r.cgroups.Frozen(dir); f {
				frozen = true
			}
		}
		if !alive {
			continue
		}
		cg := strings.Join(slices.Sorted(maps.Keys(dirs)), ",")
		if _, committed := recs[id]; frozen && !committed {
			// Frozen, but no pause committed here: the previous mpid died
			// inside a pause (after FREEZE, before COMMIT), which the
			// coordinator has rolled back, or will, on the other nodes.
			// The ranks' gates reopen as their shims lose the old mpid.
			var errs []error
			for dir := range dirs {
				errs = append(errs, r.cgroups.Thaw(context.Background(), dir))
			}
			if err := errors.Join(errs...); err != nil {
				r.log.Error("job frozen by a pause that never committed here; thaw failed", "job", id, "error", err)
			} else {
				frozen = false
				r.log.Warn("job frozen by a pause that never committed here (mpid died inside it): thawed", "job", id)
			}
		}
		j := &job{id: id, name: name, owner: owner, dir: filepath.Join(r.parent, id), places: dirs, own: map[int]string{},
			state: ctl.StateRunning, since: time.Now(), adopted: true, missing: map[int]bool{}}
		for _, pid := range procs {
			// A registered rank runs the shim's control thread; the
			// launcher's daemons and the ranks' own children do not.
			if ranks.CtlThread(pid) != 0 {
				j.missing[pid] = true
			}
		}
		if frozen {
			j.state = ctl.StatePaused
		}
		if len(past) > 0 {
			slices.Sort(past)
			j.unwatched = "mpid on " + r.node + " restarted and could not read the job's cgroups whole (" + strings.Join(past, "; ") +
				"); it can be resumed, not paused again"
			r.log.Warn("adopted a job with a cgroup past the walk's bound: it can be resumed, not paused again", "job", id, "error", strings.Join(past, "; "))
		}
		if rec, ok := recs[id]; ok && rec.Owner == owner {
			j.since, j.last = rec.Since, rec.Last
			j.nodes, j.coordinator, j.size, j.localRanks = rec.Nodes, rec.Coordinator, rec.Ranks, rec.LocalRanks
			if rec.Coordinator == r.node {
				// The nodes the record names had registered ranks of the
				// job here; they will again (sweep), but the job's pauses
				// and resumes need them from now on.
				j.remotes = map[string]bool{}
				for _, n := range rec.Nodes {
					if n != r.node {
						j.remotes[n] = true
					}
				}
			}
			delete(recs, id)
			if rec.State == ctl.StatePausing {
				// This node coordinated a pause and died inside it: some
				// nodes may hold it (COMMIT reached them), others not.
				// Nobody was told it held, so it is rolled back everywhere.
				j.state = ctl.StateFailed
				interrupted = append(interrupted, rec)
				r.log.Warn("found a pause this node was coordinating when its mpid died: rolling it back on every node", "job", id, "nodes", strings.Join(rec.Nodes, ","))
			}
		}
		r.jobs[id] = j
		r.log.Warn("adopted a job left by the previous mpid", "job", id, "state", j.state, "cgroup", cg, "ranks", len(j.missing),
			"coordinator", j.coordinator, "nodes", strings.Join(j.nodes, ","))
	}
	for id := range recs {
		// Its ranks are gone: the job ended while mpid was down.
		r.log.Info("the recorded job ended while mpid was down", "job", id)
		st.drop(id)
	}
	return interrupted
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

// noteResumed records that this node begins to thaw job id (a resume, or
// the rollback of a pause), and noteCommitted that a pause of it commits.
func (r *registry) noteResumed(id string) {
	// The time first: a handler stamped before it took its signal off the
	// pending set before the look below, which then sees a later one.
	t := monotonic()
	var held map[int]bool
	if r.ranks != nil {
		pending := r.tstpPending
		if pending == nil {
			pending = tstpPending
		}
		for _, rk := range r.ranks.Ranks(id) {
			if pending(rk.Pid) {
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

func (r *registry) noteCommitted(id string) {
	t := monotonic()
	r.mu.Lock()
	j := r.jobs[id]
	if j != nil {
		// A pause since: a SIGTSTP held at the last thaw is answered by it.
		j.committed, j.tstpHeld = t, nil
	}
	r.mu.Unlock()
	if j != nil && r.continued != nil && r.ranks != nil {
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
	pending := r.contPending
	if pending == nil {
		pending = func(pid int) bool { return signalPending(pid, syscall.SIGCONT) }
	}
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
			if pending(rk.Pid) && (rk.Proc() == nil || rk.Proc().Alive() == nil) {
				r.continued(rk)
				return
			}
		}
	}
}

// answered says whether a rank's request of job id, stamped by its signal
// handler, has been answered since: a pause signalled before the job's last
// resume here (the rank was frozen by the pause another rank asked for,
// and its own request comes after the resume: pausing again would undo
// the user's resume), or a resume signalled before the last pause began
// here. A rank that had SIGTSTP pending while frozen, at the
// thaw, stamps it after the resume: its first pause request stamped since
// (or unstamped) is that signal's. Otherwise an unstamped request (a shim
// of an older release) is taken as it comes.
func (r *registry) answered(id string, pid int, q ranks.Request) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[id]
	if j == nil {
		return false
	}
	if q.Op != "pause" {
		// Against the pause's beginning, not its commit: a SIGCONT handled
		// while the pause drained came after the request that began it.
		return q.At > 0 && q.At < j.pauseBegan
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

// tstpPending says whether process pid has a SIGTSTP pending: one sent to
// a frozen rank waits there for the thaw.
func tstpPending(pid int) bool { return signalPending(pid, syscall.SIGTSTP) }

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

// placedLocked is where j's ranks here are watched and frozen, and why.
func (r *registry) placedLocked(j *job) []ctl.Cgroup {
	var out []ctl.Cgroup
	for _, dir := range placesLocked(j) {
		out = append(out, ctl.Cgroup{Node: r.node, Dir: dir, Placed: j.places[dir]})
	}
	return out
}
