package mpid

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/ranks"
)

// Admission: a process joins a job (JOIN: moved into the job's cgroup) and
// a rank says hello (HELLO: its gate and its connections) only with the job
// key of that job (authority.go), within the per-user bounds; where it is
// placed is placement.go's.

// maxJobsPerUser bounds the jobs one user can make mpid keep (each is a
// cgroup and a set of BPF programs).
const maxJobsPerUser = 64

// authorizeLocked returns the job a process of uid asks to join as job
// name with job key token, making its record (and cgroup) if it is new
// here: the key must be this job's (authority.go). The job then names its
// coordinator; a new job on another node than the coordinator registers
// there (register).
func (r *registry) authorizeLocked(uid uint32, name, token string) (*job, error) {
	// The rank channel's parsers took only valid ids; this is the rule's
	// own check where a job is made from a rank's word.
	if !jobid.Valid(name) {
		return nil, fmt.Errorf("job id %q: %s", name, jobid.Rule)
	}
	coord, err := checkToken(r.key, uid, name, token)
	if err != nil {
		return nil, err
	}
	key := jobid.Key(uid, name)
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

// Join places a rank of a job (placement.go) before it opens any socket:
// the kernel files a socket under its creator's cgroup at creation, for
// good, and the job's observer watches the rank's place from then on.
func (r *registry) Join(req ranks.JoinRequest) error {
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

// Admit accepts a rank's HELLO. A rank that did not JOIN first may have
// sockets the kernel files under another cgroup: it is admitted (it can be
// frozen) but the job is marked unpausable, because no kernel check could
// vouch for those sockets.
func (r *registry) Admit(rk *ranks.Rank) error {
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

// Unready is the node role's question: why the job cannot be gated yet,
// or why its kernel check here could not vouch for it. The coordinator
// knows only its own node's reasons (begin): every node asks its own at
// PREPARE, so a pause is refused wherever one holds.
func (r *registry) Unready(id string) string {
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

// placedLocked is where j's ranks here are watched and frozen, and why.
func (r *registry) placedLocked(j *job) []ctl.Cgroup {
	var out []ctl.Cgroup
	for _, dir := range placesLocked(j) {
		out = append(out, ctl.Cgroup{Node: r.node, Dir: dir, Placed: j.places[dir]})
	}
	return out
}
