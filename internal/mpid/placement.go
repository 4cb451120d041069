package mpid

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
)

// Where a rank is watched and frozen on its node (docs/mpid.md,
// "Cgroups"). A resource manager (Slurm's task/cgroup, a systemd scope, a
// container) enforces its limits, accounting, signals and kills through the
// cgroup it put a process in, and Slurm's proctrack/cgroup finds a step's
// processes by reading its task cgroups' cgroup.procs, not their
// descendants'. So mpid never takes a rank out of the cgroup it was
// launched in, and moves it at most one level down, into a cgroup of its
// own inside that one, only when the rank shares its cgroup with processes
// that are not the job's.
const (
	// PlaceOwn: the rank's cgroup holds the rank and nothing else (a Slurm
	// task cgroup, a per-rank scope): mpid watches and freezes it where it
	// is and moves nothing.
	PlaceOwn = "own"
	// PlaceInner: the rank's cgroup holds other processes too (mpirun, a
	// shell, `mpipause run` in a systemd scope), or has cgroups below it
	// (a user's delegated subtree: whatever lives there would be frozen
	// with it): mpid makes a cgroup inside it (innerName) and moves the
	// rank there; every limit and count of the manager's cgroup still
	// covers it.
	PlaceInner = "inner"
	// PlaceCreated: the rank is in the hierarchy's root, where nobody
	// placed it: mpid makes the job a cgroup of its own under its
	// --cgroup-parent and moves the rank there.
	PlaceCreated = "created"
	// PlaceFixed: mpid was told the one cgroup every rank is in (--cgroup).
	PlaceFixed = "fixed"
)

// validPlace says whether mode is one of the Place* modes.
func validPlace(mode string) bool {
	switch mode {
	case PlaceOwn, PlaceInner, PlaceCreated, PlaceFixed:
		return true
	}
	return false
}

// placement is where one rank is watched and frozen.
type placement struct {
	Dir  string // the cgroup watched and frozen
	Mode string // Place*
	// Move: the rank must be moved into Dir (made first); otherwise it
	// is in Dir already.
	Move bool
}

// placeInput is what placement is decided from, read by the registry
// around the rank's pidfd (a recycled pid would have read another's).
type placeInput struct {
	Job  string // the job key
	Pid  int
	Cg   string // the rank's cgroup now (cgroupv2.Of)
	Root string // the cgroup v2 hierarchy's root as mpid sees it
	// Members are the processes of Cg itself; Below counts the cgroups
	// below it (none of them read: a user may have made any number); Own
	// are the job's ranks already watched in Cg where they are (PlaceOwn).
	Members []int
	Below   int
	Own     map[int]bool
	// Parent is mpid's --cgroup-parent (absolute), Fixed its --cgroup.
	Parent, Fixed string
}

// innerPrefix starts the name of every cgroup mpid makes inside a rank's.
const innerPrefix = "mpipause-"

// innerName is the cgroup mpid makes for job inside a rank's cgroup. A job
// key is a valid cgroup name (ranks.SplitJobKey: printable, no '/'), and
// the prefix keeps it apart from the kernel's interface files.
func innerName(job string) string { return innerPrefix + job }

// place decides where a rank is watched and frozen.
func place(in placeInput) (placement, error) {
	if pl, ok, err := placeByPath(in); ok || err != nil {
		return pl, err
	}
	if in.Below == 0 && onlyJob(in) {
		return placement{Dir: filepath.Clean(in.Cg), Mode: PlaceOwn}, nil
	}
	return placement{Dir: filepath.Join(filepath.Clean(in.Cg), innerName(in.Job)), Mode: PlaceInner, Move: true}, nil
}

// placeByPath decides what the rank's cgroup's path decides alone (ok);
// otherwise what lives in that cgroup decides (in.Members, in.Below). The hierarchy's
// root is never read for members: its walk would cross every cgroup of the
// node, threaded ones (libvirt's) that refuse cgroup.procs among them.
func placeByPath(in placeInput) (pl placement, ok bool, err error) {
	if in.Fixed != "" {
		return placement{Dir: in.Fixed, Mode: PlaceFixed}, true, nil
	}
	cg := filepath.Clean(in.Cg)
	root := filepath.Clean(in.Root)
	if cg != root && !strings.HasPrefix(cg, root+"/") {
		return placement{}, false, fmt.Errorf("pid %d is in cgroup %s, outside the cgroup v2 hierarchy at %s", in.Pid, cg, root)
	}
	switch {
	case filepath.Base(cg) == innerName(in.Job):
		// Moved in by this mpid (or its predecessor, before a restart),
		// or a child of a rank that was.
		return placement{Dir: cg, Mode: PlaceInner}, true, nil
	case cg == filepath.Clean(filepath.Join(in.Parent, in.Job)):
		return placement{Dir: cg, Mode: PlaceCreated}, true, nil
	case cg == root:
		return placement{Dir: filepath.Join(in.Parent, in.Job), Mode: PlaceCreated, Move: true}, true, nil
	}
	return placement{}, false, nil
}

// onlyJob says whether the rank's cgroup holds nothing but the rank and
// ranks of its job already watched there. A cgroup shared with anything
// else (the launcher, a shell) would be frozen with it. Cgroups below it
// are not looked into (placeLocked): any makes it shared.
func onlyJob(in placeInput) bool {
	self := false
	for _, pid := range in.Members {
		switch {
		case pid == in.Pid:
			self = true
		case !in.Own[pid]:
			return false
		}
	}
	return self
}

// placeLocked decides where rank p of job j is watched and frozen, reading
// its cgroup and what else lives there; the caller checks p alive after
// (ranks.Proc.Alive, or the move through its pidfd) so that what was read
// was p's. It runs under the registry's lock, which every pause, resume
// and status takes: it reads two files of the rank's cgroup, bounded,
// and never walks the tree below it, which a user with a delegated
// cgroup makes as large as they like.
func (r *registry) placeLocked(j *job, pid int) (placement, error) {
	root, err := r.cgroups.Root()
	if err != nil {
		return placement{}, err
	}
	cg, err := r.cgroups.Of(pid)
	if err != nil {
		return placement{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	in := placeInput{Job: j.id, Pid: pid, Cg: cg, Root: root, Parent: r.parent, Fixed: r.fixed}
	if pl, ok, err := placeByPath(in); ok || err != nil {
		return pl, err
	}
	below, err := r.cgroups.Descendants(cg)
	if err != nil {
		return placement{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	members, err := r.cgroups.Procs(cg)
	if err != nil {
		return placement{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	own := map[int]bool{}
	for p, dir := range j.own {
		if dir == cg {
			own[p] = true
		}
	}
	// The rank's own children are the job's too: Slurm's SPANK plugin
	// leaves a watcher, a child of the task, in the task's cgroup.
	procs := r.procsOr()
	for _, m := range members {
		if m != pid && descends(m, pid, procs.parent) {
			own[m] = true
		}
	}
	in.Members, in.Below, in.Own = members, below, own
	return place(in)
}

// descends says whether process m is a descendant of pid, following at
// most 8 parents.
func descends(m, pid int, parent func(int) int) bool {
	for range 8 {
		if m = parent(m); m == pid {
			return true
		} else if m <= 1 {
			return false
		}
	}
	return false
}

// ppid is process pid's parent, from /proc/PID/stat (0 if it is gone).
func ppid(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The command name, in parentheses, may hold anything: fields count
	// from the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0
	}
	n, _ := strconv.Atoi(f[1])
	return n
}

// settleLocked makes and enters pl for rank p (when pl.Move) and records
// it among j's places.
func (r *registry) settleLocked(j *job, p *ranks.Proc, pl placement) error {
	if pl.Move {
		if err := r.cgroups.Create(pl.Dir); err != nil {
			return placeError(pl, err)
		}
		if err := r.cgroups.Move(p, pl.Dir); err != nil {
			return err
		}
	} else if err := p.Alive(); err != nil {
		return err // what was read may have been another process's
	}
	if j.places == nil {
		j.places, j.own = map[string]string{}, map[int]string{}
	}
	if _, known := j.places[pl.Dir]; !known && j.coordinator != "" && j.coordinator != r.node && j.token != "" {
		// The coordinator's status shows every node's places: tell it now,
		// not at the next sweep.
		go r.register(j.id, j.coordinator, j.token, j.owner)
	}
	j.places[pl.Dir] = pl.Mode
	if pl.Mode == PlaceOwn {
		j.own[p.Pid] = pl.Dir
	}
	return nil
}

// inPlaceLocked says whether pid lives in one of j's places (or below).
func (r *registry) inPlaceLocked(j *job, pid int) bool {
	for dir := range j.places {
		if r.cgroups.Holds(dir, pid) == nil {
			return true
		}
	}
	return false
}

// placesLocked lists j's places, sorted: where its ranks here are watched
// and frozen.
func placesLocked(j *job) []string {
	dirs := make([]string, 0, len(j.places))
	for dir := range j.places {
		dirs = append(dirs, dir)
	}
	slices.Sort(dirs)
	return dirs
}

// emptyLocked says whether no process of j is left in any of its places
// (the kernel's count: no tree is walked).
func (r *registry) emptyLocked(j *job) bool {
	for _, dir := range append(placesLocked(j), j.dir) {
		busy, err := r.cgroups.Populated(dir)
		if (err != nil && !errors.Is(err, os.ErrNotExist)) || busy {
			return false
		}
	}
	return true
}

// pruneLocked lets go of the places of j that no process is left in: they
// are no longer watched, and a cgroup mpid made inside a manager's goes at
// once, so that the manager can remove its own (Slurm removes a task's
// cgroup when the task ends, and rmdir fails while one is left inside).
func (r *registry) pruneLocked(j *job) {
	for dir, mode := range j.places {
		if mode != PlaceOwn && mode != PlaceInner {
			continue
		}
		busy, err := r.cgroups.Populated(dir)
		if (err != nil && !errors.Is(err, os.ErrNotExist)) || busy {
			continue
		}
		delete(j.places, dir)
		for pid, d := range j.own {
			if d == dir {
				delete(j.own, pid)
			}
		}
		if w, ok := j.obs.(loader.Watcher); ok {
			if err := w.Unwatch(dir); err != nil {
				r.log.Warn("unwatch a cgroup the job left", "job", j.id, "cgroup", dir, "error", err)
			}
		}
		if mode == PlaceInner {
			if err := r.cgroups.Remove(dir); err != nil {
				r.log.Warn("remove the job's cgroup inside its ranks' own", "job", j.id, "cgroup", dir, "error", err)
			}
		}
	}
}

// placeError says what to do when mpid may not make its cgroup inside the
// one the ranks share with something else because the ranks' manager gave
// that cgroup to the job's user: Slurm's cgroup/v2 task cgroups are the
// user's (mode 755), and mpid's unit drops CAP_DAC_OVERRIDE.
func placeError(pl placement, err error) error {
	if pl.Mode != PlaceInner || !errors.Is(err, fs.ErrPermission) {
		return err
	}
	return fmt.Errorf("%w: %s is not root's to write and mpid's unit has no CAP_DAC_OVERRIDE, which it needs where ranks share a cgroup of their user's with their launcher (mpirun inside sbatch: docs/slurm.md, \"Launching MPI under Slurm\")",
		err, filepath.Dir(pl.Dir))
}
