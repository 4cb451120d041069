package mpid

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/ranks"
)

// Adoption: a restarted mpid takes back the jobs whose cgroups outlived
// its predecessor, by their records (state.go) and their cgroups.

// adopt brings back, at start, the jobs whose cgroups outlived the previous
// mpid: paused if the cgroup is frozen and a committed pause is recorded,
// thawed if it is frozen without one (the pause never committed), running
// otherwise; a pause the previous mpid was coordinating is rolled back on
// every node (the returned records, to roll back once mpid serves:
// coordinator.confirmRollback). Their ranks registered with the old mpid;
// the job can be paused again once all of them have registered with this
// one. The records of jobs gone meanwhile are dropped.
func (r *registry) adopt() (interrupted []record) {
	if r.fixed != "" {
		return nil
	}
	recs := r.store.load()
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
		owner, name, ok := jobid.SplitKey(id)
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
			if ranks.ShimThread(pid) != 0 {
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
		r.store.drop(id)
	}
	return interrupted
}
