package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
)

// TestPauseLateSend: a send that reaches the kernel after node0's last
// drain answer and before its freeze, on a socket for which the shim holds
// nothing, is what a send call that read its gate open just before it
// closed makes when its thread is preempted past the whole drain (an Open
// MPI progress thread among busy ranks). Its bytes are in order; the pause
// must drain them and commit, not roll back on them. The send is made on
// cue while node0's mpid holds before its FREEZE step (a failpoint), with
// a raw write(2) from rank 0 on a loopback connection of its own (xchg
// -L); rank 0 then reads the 40 bytes back whole.
func TestPauseLateSend(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { pauseLateSend(t, lib) })
	}
}

var lateRuns atomic.Int32

// lateCue is a pause held at node0's FREEZE step while rank 0's thread of
// xchg -L or -O (flag) makes its sends on the test's cue.
type lateCue struct {
	ctx        context.Context
	job, pause *proc
	id, app    string
	args       []string
	stop, cue  string
}

func (c *lateCue) exists(name string) bool {
	_, err := os.Stat(filepath.Join(c.cue, name))
	return err == nil
}

// pauseAtLateCue starts the job, pauses it up to node0's freeze, gives
// rank 0 its cue, and returns once the sends are made and the pause has
// ended. The job is resumed when the test ends.
func pauseAtLateCue(t *testing.T, lib mpiLib, name, flag string) *lateCue {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	c := &lateCue{ctx: ctx, args: []string{"-m", "a2a", "-s", "64K"}, stop: t.TempDir(), cue: t.TempDir()}
	// Unique per run, so that -count repeats it.
	c.id = fmt.Sprintf("%s-%s-%d-%d", name, lib.name, os.Getpid(), lateRuns.Add(1))
	c.app = filepath.Join(bin, "apps", "xchg."+lib.name)
	c.job = runJob(ctx, t, lib, c.id, c.app, append(slices.Clone(c.args), "-n", "100000000", "-E", c.stop, flag, c.cue)...)
	t.Cleanup(func() { cli(context.Background(), t, "node0", nil, "resume", c.id) })
	waitFor(t, "rank 0's sender", time.Minute, c.job.done, func() bool { return c.exists("late-ready") })

	fp := armFailpoint(t, "node0", "FREEZE", "before")
	defer os.Remove(fp)
	c.pause = pauseToFailpoint(ctx, t, c.id, fp, "node0's mpid before its freeze")
	if err := os.WriteFile(filepath.Join(c.cue, "late-send"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "rank 0's sends", time.Minute, c.job.done, func() bool { return c.exists("late-sent") })
	os.Remove(fp)
	select {
	case <-c.pause.done:
	case <-ctx.Done():
		t.Fatal("the pause did not end")
	}
	return c
}

func pauseLateSend(t *testing.T, lib mpiLib) {
	c := pauseAtLateCue(t, lib, "late", "-L")
	j, err := pauseResult(c.pause)
	if err != nil || j.State != ctl.StatePaused {
		t.Fatalf("pause after a late send: state %q, error %v\n%s", j.State, err, c.pause.out.String())
	}
	var names []string
	for _, p := range j.Phases {
		names = append(names, p.Name)
	}
	// The check after node0's freeze saw the 40 bytes: the job was thawed
	// and drained again, then paused.
	if got := strings.Join(names, " "); !strings.Contains(got, "THAW") {
		t.Errorf("phases %s: want a THAW and a second drain after the late bytes", got)
	}
	if j, r := jobJSON(c.ctx, t, "resume", c.id); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("resume: exit %d, state %q: %s", r.code, j.State, r.stderr)
	}
	waitFor(t, "rank 0 reading its 40 bytes back", time.Minute, c.job.done, func() bool { return c.exists("late-read") })
	c.job.stopAndCheck(c.ctx, t, "the job with a late send", c.stop, c.app, 6, c.args...)
}

// TestPauseOvertake: a send past the shim that overtakes bytes the shim
// holds fails the pause (G4: the stream would no longer be in the order
// of the rank's calls, and mpipause must not claim it is). On the same cue
// as TestPauseLateSend, rank 0 writes 40 bytes through the shim, held
// behind the closed gate, then 40 bytes with a raw write(2) (xchg -O),
// which the kernel takes first. The pause must roll back naming the bytes
// sent through closed gates, the job run on, and its checksum be the
// unpaused run's; the loopback reader sees the raw bytes first (the
// program's own doing, which no pause can undo).
func TestPauseOvertake(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { pauseOvertake(t, lib) })
	}
}

func pauseOvertake(t *testing.T, lib mpiLib) {
	c := pauseAtLateCue(t, lib, "overtake", "-O")
	j, err := pauseResult(c.pause)
	if err != nil || j.State != ctl.StateRunning || j.Failure == nil || j.Failure.Violations == 0 ||
		!strings.Contains(j.Failure.Reason, "sent through closed gates") {
		t.Fatalf("pause with held bytes overtaken: %s; want it rolled back for bytes sent through closed gates\n%s", pauseSummary(c.pause, j, err), c.pause.out.String())
	}
	t.Logf("pause: %s (violations %d)", pauseSummary(c.pause, j, err), j.Failure.Violations)
	waitFor(t, "rank 0 reading its 80 bytes back", time.Minute, c.job.done, func() bool { return c.exists("late-read") })
	order, err := os.ReadFile(filepath.Join(c.cue, "late-read"))
	if err != nil || string(order) != "LH" {
		t.Errorf("the loopback reader got the runs in order %q (%v), want the raw bytes first, LH", order, err)
	}
	c.job.stopAndCheck(c.ctx, t, "the job with an overtaking send", c.stop, c.app, 6, c.args...)
}
