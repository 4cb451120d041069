package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"golang.org/x/sys/unix"
)

// shimThreads is, per rank of the job (by pid), its shim control thread's
// scheduling: policy and niceness. Threads are found by the name the shim
// gives them, which is also what a user could give any thread (docs/security.md,
// H4).
func shimThreads(t *testing.T, id string) map[int]unix.SchedAttr {
	t.Helper()
	out := map[int]unix.SchedAttr{}
	for _, cg := range nodeJobCgroups(t, id) {
		pids, _ := cgroupv2.Procs(cg)
		for _, pid := range pids {
			for _, tid := range shimCtlTids(pid) {
				if a, err := unix.SchedGetAttr(tid, 0); err == nil {
					out[pid] = *a
				}
			}
		}
	}
	return out
}

// TestShimThreadNeverRaised: mpid gives no thread of a rank real-time
// policy or a lower niceness, at registration, inside a pause step (held
// at node0's first DRAIN, when every node has prepared and the drain needs
// the shim's control thread most), once paused, or after the resume: a
// rank's process is its user's, and whatever root grants one of its
// threads the user can keep (a fork, an exec) (docs/security.md,
// "Scheduling").
func TestShimThreadNeverRaised(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { shimThreadNeverRaised(t, lib) })
	}
}

func shimThreadNeverRaised(t *testing.T, lib mpiLib) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	hold := t.TempDir()
	id := fmt.Sprintf("boost-%s-%d", lib.name, os.Getpid())
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	args := []string{"-m", "a2a", "-n", "4", "-s", "64K"}
	job := runJob(ctx, t, lib, id, app, append(args, "-w", hold)...)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	atHold(t, hold, 6, job)
	normal := func(when string) {
		t.Helper()
		th := shimThreads(t, id)
		if len(th) != 6 {
			t.Fatalf("%s: %d shim control threads found, want 6", when, len(th))
		}
		for pid, a := range th {
			if a.Policy != unix.SCHED_NORMAL || a.Nice != 0 {
				t.Errorf("%s: rank %d's control thread has policy %d, nice %d; want SCHED_NORMAL, nice 0", when, pid, a.Policy, a.Nice)
			}
		}
	}
	normal("registered")

	// Hold node0's mpid before its first DRAIN: every node has prepared.
	fp := armFailpoint(t, "node0", "DRAIN", "before")
	defer os.Remove(fp)
	pause := pauseToFailpoint(ctx, t, id, fp, "node0's mpid at DRAIN")
	normal("inside the pause step (node0 at DRAIN)")
	os.Remove(fp)
	select {
	case <-pause.done:
	case <-ctx.Done():
		t.Fatal("the pause did not end")
	}
	if j, err := pauseResult(pause); err != nil || j.State != ctl.StatePaused {
		t.Fatalf("pause: %+v %v\n%s", j, err, pause.out.String())
	}
	normal("paused (committed)")
	if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("resume: exit %d, state %q: %s", r.code, j.State, r.stderr)
	}
	normal("resumed")
	release(t, hold)
	job.finish(ctx, t, id, serial(t, app, 6, args...))
}
