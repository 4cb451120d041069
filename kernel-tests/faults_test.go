package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
)

// TestCoordinatorDiesMidPause: the coordinator's mpid (node0) is killed
// while a pause drains a job whose rank 5 does not read. The other nodes
// hear no further step; once the step's deadline and the lease's grace have
// passed, each rolls the pause back on its own (their mpids say so), nothing
// is left frozen, and the job, whose node0 ranks reopen their gates when
// their mpid goes, finishes with the output of an unpaused run (G3).
func TestCoordinatorDiesMidPause(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// The rig's other tests need node0's mpid back, whatever happens here.
	t.Cleanup(func() {
		if out, err := rigCommand(context.Background(), jobRig, "up", fmt.Sprint(jobNodes)); err != nil {
			t.Errorf("rig up to restart node0's mpid: %v\n%s", err, out)
		}
	})
	obs, _ := rigReaders(ctx, t)
	lib := mpiLibs[0]
	id := fmt.Sprintf("coorddies-%d", os.Getpid())
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	busy := t.TempDir()
	args := []string{"-m", "a2a", "-n", "40", "-s", "256K", "-B", busy}
	job := runJob(ctx, t, lib, id, app, args...)
	waitFor(t, "the last rank's compute phase", 2*time.Minute, job.done, func() bool {
		return strings.Contains(job.out.String(), "computes until")
	})
	waitFor(t, "bytes waiting, unread, for the busy rank", time.Minute, job.done, func() bool {
		return stuckUnread(ctx, t, obs)
	})

	logs := map[string]string{}
	var coord int
	for i, n := range statusOf(t, jobRig).Nodes {
		logs[n.Name] = filepath.Join("/run/mpipause/rig", jobRig, "mpid-"+n.Name+".log")
		if i == 0 {
			coord = n.MPIDPid
		}
	}
	pause := start(ctx, t, "", []string{"MPIPAUSE_RIG=" + jobRig},
		filepath.Join(bin, "rig"), "exec", "node0", "--", "mpipause", "pause", "--timeout", "3s", id)
	waitFor(t, "the pause to be draining", time.Minute, pause.done, func() bool {
		return strings.Contains(pause.out.String(), "PREPARE")
	})
	if err := syscall.Kill(coord, syscall.SIGKILL); err != nil {
		t.Fatalf("kill node0's mpid (pid %d): %v", coord, err)
	}
	<-pause.done
	if pause.err == nil {
		t.Errorf("the pause succeeded without its coordinator:\n%s", pause.out.String())
	}
	for _, node := range []string{"node1", "node2"} {
		waitFor(t, node+"'s mpid to roll the pause back on its own", time.Minute, job.done, func() bool {
			b, _ := os.ReadFile(logs[node])
			return strings.Contains(string(b), "pause abandoned by its coordinator (no step in time); rolled back here")
		})
	}
	for _, cg := range nodeJobCgroups(t, id) {
		if fr, err := cgroupv2.Frozen(cg); err != nil || fr {
			t.Errorf("%s frozen after the rollback (%v)", cg, err)
		}
	}
	if err := os.WriteFile(filepath.Join(busy, "done"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	job.finish(ctx, t, "the job after its coordinator died mid-pause", serial(t, app, 6, args...))
}
