package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
)

// TestOpenMPIDaemonStopPauses: an Open MPI job whose launcher and daemons
// carry the shim and the job (as Slurm's plugin gives them to a batch
// script that runs mpirun), and a SIGTSTP to node2's orted, as a
// scheduler's suspend sends it to the daemon alone. orted hands its ranks
// a SIGSTOP of its own making, which no shim can catch; the shim in orted
// makes it a SIGTSTP, so the ranks ask for a pause and the whole job
// pauses with every connection empty. A SIGCONT to orted, which passes it
// on, resumes the job, and it ends with the output of an unpaused run.
func TestOpenMPIDaemonStopPauses(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	obs, check := rigReaders(ctx, t)
	id := fmt.Sprintf("orted-stop-%d", os.Getpid())
	// node0's mpid makes the job and its key, as `mpipause run` has it do.
	rep, err := ctl.Do(ctx, nodeHostPath(t, jobRig, 0, ctl.DefaultAddr), ctl.Request{Op: ctl.OpCreate, Job: id}, nil)
	if err != nil {
		t.Fatalf("create job %s: %v", id, err)
	}
	if rep.Token == "" {
		t.Fatalf("create job %s: no job key", id)
	}
	lib := mpiLibs[0]
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	args, stop := []string{"-m", "a2a", "-s", "256K"}, t.TempDir()
	env := []string{"LD_PRELOAD=" + filepath.Join(bin, "libmpipause.so"), "MPIPAUSE_JOBID=" + id, ctl.TokenEnv + "=" + rep.Token}
	// No cgroup of the test's: `rig exec` puts the launcher in its node's,
	// where mpid places the ranks of a job of that node.
	job := startJob(ctx, t, lib, "", app, env, append(slices.Clone(args), "-n", "100000000", "-E", stop)...)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the job's output:\n%s", job.out.String())
		}
	})
	waitForWhy(t, "every rank registered", 2*time.Minute, job.done, func() (bool, string) { return allRegistered(ctx, t, id) })
	cgs := nodeJobCgroups(t, id)
	waitProgress(ctx, t, obs, job.done, 0, 8<<20)

	orted := daemonOf(t, cgs[2])
	before := sentBytes(ctx, obs)
	if err := syscall.Kill(orted, syscall.SIGTSTP); err != nil {
		t.Fatal(err)
	}
	var j ctl.Job
	waitForWhy(t, "the SIGTSTP to node2's orted to pause the job", time.Minute, job.done, func() (bool, string) {
		j, _ = jobJSON(ctx, t, "status", id)
		if j.State == ctl.StatePaused {
			return true, ""
		}
		procs, _ := cgroupv2.Procs(cgs[2])
		var st []string
		for _, p := range procs {
			st = append(st, fmt.Sprintf("%d:%s", p, procState(p)))
		}
		return false, fmt.Sprintf("job %s, node2's ranks %v", j.State, st)
	})
	checkPaused(ctx, t, "SIGTSTP to orted", j, cgs, obs, check)
	if err := syscall.Kill(orted, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the SIGCONT to node2's orted to resume the job", time.Minute, job.done, func() bool {
		j, _ := jobJSON(ctx, t, "status", id)
		return j.State == ctl.StateRunning
	})
	waitProgress(ctx, t, obs, job.done, before, 4<<20)
	job.stopAndCheck(ctx, t, "the job paused by its daemon's SIGTSTP", stop, app, 6, args...)
}

// daemonOf is the parent of the ranks in cgroup cg: the launcher's daemon
// that started them.
func daemonOf(t *testing.T, cg string) int {
	t.Helper()
	procs, err := cgroupv2.Procs(cg)
	if err != nil || len(procs) == 0 {
		t.Fatalf("ranks in %s: %v %v", cg, procs, err)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", procs[0]))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	ppid, _ := strconv.Atoi(f[1])
	comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", ppid))
	if !strings.HasPrefix(string(comm), "orted") {
		t.Fatalf("the parent of rank %d is %d (%q), not orted", procs[0], ppid, strings.TrimSpace(string(comm)))
	}
	return ppid
}
