package mpid

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
)

// Cgroups is what mpid does to the cgroups of jobs: make and remove them,
// move ranks in, freeze and thaw them. mpid runs on the kernel's
// (KernelCgroups); in-process tests give a daemon one of their own, so that
// it creates jobs, registers ranks and runs pauses without privilege.
type Cgroups interface {
	// Root is the cgroup v2 hierarchy's root directory as mpid sees it.
	Root() (string, error)
	// Of is the cgroup of process pid.
	Of(pid int) (string, error)
	Create(dir string) error
	// Remove removes dir if no process is left in it, and never moves one
	// out: a process is only ever where its launcher or mpid put it.
	Remove(dir string) error
	// Procs are the processes of dir, not of cgroups below it. A user
	// chooses how many live in a cgroup of theirs: the kernel's reads at
	// most MaxProcs and fails past them.
	Procs(dir string) ([]int, error)
	// Descendants counts the cgroups below dir, none of them walked.
	Descendants(dir string) (int, error)
	// Populated says whether any process lives in dir or below, none of
	// the cgroups below walked.
	Populated(dir string) (bool, error)
	// Members are the processes of dir and of every cgroup below it, for
	// a restarted mpid that finds its jobs (adopt) and never under load:
	// the kernel's walks at most MaxWalk cgroups and fails past them.
	Members(dir string) ([]int, error)
	// Holds says (nil) whether pid lives in dir or below.
	Holds(dir string, pid int) error
	// Move moves p into dir, through its pidfd (ranks.Proc.MoveTo).
	Move(p *ranks.Proc, dir string) error
	Freeze(ctx context.Context, dir string) error
	Thaw(ctx context.Context, dir string) error
	Frozen(dir string) (bool, error)
}

// Observers opens the kernel observer of a job's cgroups (more may be
// watched later, through loader.Watcher), and unpins what an observer left
// pinned for the next mpid once the job ends.
type Observers interface {
	Open(job string, dirs []string) (loader.Observer, error)
	Unpin(job string) error
}

// KernelCgroups is Cgroups on cgroup v2.
type KernelCgroups struct {
	// The node's steps freeze through cgroupv2 itself.
	cgroupv2.Freezer
}

func (KernelCgroups) Root() (string, error)               { return cgroupv2.Root() }
func (KernelCgroups) Of(pid int) (string, error)          { return cgroupv2.Of(pid) }
func (KernelCgroups) Create(dir string) error             { return cgroupv2.Create(dir) }
func (KernelCgroups) Remove(dir string) error             { return cgroupv2.RemoveEmpty(dir) }
func (KernelCgroups) Procs(dir string) ([]int, error)     { return cgroupv2.ProcsMax(dir, MaxProcs) }
func (KernelCgroups) Descendants(dir string) (int, error) { return cgroupv2.Descendants(dir) }
func (KernelCgroups) Populated(dir string) (bool, error)  { return cgroupv2.Populated(dir) }
func (KernelCgroups) Members(dir string) ([]int, error)   { return cgroupv2.MembersMax(dir, MaxWalk) }

func (KernelCgroups) Move(p *ranks.Proc, dir string) error { return p.MoveTo(dir) }
func (KernelCgroups) Frozen(dir string) (bool, error)      { return cgroupv2.Frozen(dir) }

// MaxProcs bounds the processes mpid reads of one cgroup (a rank's, when
// it decides where the rank is watched): a job's ranks on a node are at
// most ranks.MaxRanksPerUID, and their cgroup holds them and a few more.
const MaxProcs = 16384

// MaxWalk bounds the cgroups of one tree mpid walks: the cgroups of a job
// are the one it was placed in and mpid's own inside it; a deeper tree is
// a user's own making.
const MaxWalk = 64

// Holds reads /proc/PID/cgroup.
func (KernelCgroups) Holds(dir string, pid int) error {
	p, err := cgroupv2.Of(pid)
	if err != nil {
		return fmt.Errorf("pid %d: %w", pid, err)
	}
	if p == dir || strings.HasPrefix(p, dir+"/") {
		return nil
	}
	return fmt.Errorf("pid %d is in %s, not in the job's cgroup %s", pid, p, dir)
}

// BPFObservers is Observers on the BPF observer (loader), pinned so that
// a restarted mpid finds what the job's connections did meanwhile.
type BPFObservers struct {
	// Warn reports state of another build that was replaced.
	Warn func(msg string, args ...any)
}

func (o BPFObservers) Open(job string, dirs []string) (loader.Observer, error) {
	cfg := loader.Config{Job: job, Cgroups: dirs, FollowJob: true, Pin: true, Require: loader.KindBPF}
	obs, err := loader.Open(context.Background(), cfg)
	if errors.Is(err, loader.ErrStalePin) {
		// Pinned by an mpid of another build: the job ran, or is paused,
		// across an upgrade. Those maps do not fit this build's programs;
		// fresh ones adopt the job's open connections, history included
		// (loader's TestBPFPinStale), so the old state goes.
		if o.Warn != nil {
			o.Warn("replacing the job's BPF state pinned by another mpid build", "job", job, "err", err)
		}
		if uerr := loader.Unpin(loader.Config{Job: job}); uerr != nil {
			return nil, fmt.Errorf("%w (and unpinning it failed: %v)", err, uerr)
		}
		obs, err = loader.Open(context.Background(), cfg)
	}
	return obs, err
}

func (BPFObservers) Unpin(job string) error { return loader.Unpin(loader.Config{Job: job}) }
