package kerneltests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/mpid"
	"github.com/mpipause/mpipause/kernel-tests/internal/rig"
)

// TestCoordinatorDiesMidPause: the coordinator's mpid (node0) is killed
// while a pause drains a job whose rank 5 does not read (its shim's drain
// off: startUndrainedJob). The other nodes
// hear no further step; once the step's deadline and the lease's grace have
// passed, each rolls the pause back on its own (their mpids say so), nothing
// is left frozen, and the job, whose node0 ranks reopen their gates when
// their mpid goes, finishes with the output of an unpaused run (G3,
// docs/guarantees.md).
func TestCoordinatorDiesMidPause(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	repairRigOnCleanup(t)
	id := fmt.Sprintf("coorddies-%d", os.Getpid())
	job := startUndrainedJob(ctx, t, mpiLibs[0], id)

	logs := map[string]string{}
	var coord int
	for i, n := range statusOf(t, jobRig).Nodes {
		logs[n.Name] = filepath.Join(rigDir(jobRig), "mpid-"+n.Name+".log")
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
	checkFrozen(t, id, false, "after the rollback")
	job.end(ctx, t, "the job after its coordinator died mid-pause")
}

// TestMpidRestartWhilePaused (G5, docs/guarantees.md): the mpids of the
// coordinator (node0) and of node2 are killed while a job is paused and
// started again. The job stays frozen throughout; the new mpids find it
// (paused, with its nodes on the coordinator, from the record written at
// COMMIT); a second pause is refused as such; `mpipause resume` resumes it
// on every node; its output is that of an unpaused run.
func TestMpidRestartWhilePaused(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	repairRigOnCleanup(t)
	obs, _ := rigReaders(ctx, t)
	lib := mpiLibs[0]
	id := fmt.Sprintf("restart-%d", os.Getpid())
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	args := []string{"-m", "a2a", "-n", "1500", "-s", "256K"}
	job := runJob(ctx, t, lib, id, app, args...)
	// Each stage goes on from where the one before left the job: after a
	// failed one, the rest would only report its consequences.
	for _, stage := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"paused", func(t *testing.T) {
			waitProgress(ctx, t, obs, job.done, sentBytes(ctx, obs), 8<<20)
			if j, r := jobJSON(ctx, t, "pause", id); r.code != 0 || j.State != ctl.StatePaused {
				t.Fatalf("pause: exit %d, state %q\n%s", r.code, j.State, r.stderr)
			}
		}},
		{"frozen while node0's and node2's mpids die and restart", func(t *testing.T) {
			st := statusOf(t, jobRig)
			for _, i := range []int{0, 2} {
				pid := st.Nodes[i].MPIDPid
				if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
					t.Fatalf("kill %s's mpid: %v", st.Nodes[i].Name, err)
				}
				waitFor(t, st.Nodes[i].Name+"'s mpid to be gone", time.Minute, nil, func() bool {
					return syscall.Kill(pid, 0) != nil || procState(pid) == "Z"
				})
			}
			checkFrozen(t, id, true, "with two mpids down")
			mustRig(t, jobRig, "up", fmt.Sprint(jobNodes))
			checkFrozen(t, id, true, "after the mpids restarted")
		}},
		{"the new mpids find it paused", func(t *testing.T) {
			j, r := jobJSON(ctx, t, "status", id)
			if r.code != 0 || j.State != ctl.StatePaused || j.Coordinator != "node0" || len(j.Nodes) != 3 || j.Ranks != 6 {
				t.Errorf("status on the restarted coordinator: exit %d, %+v", r.code, j)
			}
			r2 := cli(ctx, t, "node2", nil, "status", "--json", id)
			var j2 ctl.Job
			if err := json.Unmarshal([]byte(r2.stdout), &j2); err != nil || j2.State != ctl.StatePaused {
				t.Errorf("status on restarted node2: %v, %s%s", err, r2.stdout, r2.stderr)
			}
			if _, r := jobJSON(ctx, t, "pause", id); r.code != 5 {
				t.Errorf("a second pause after the restart: exit %d, want 5 (already paused)\n%s", r.code, r.stderr)
			}
		}},
		{"resumed on every node", func(t *testing.T) {
			if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
				t.Fatalf("resume after the restart: exit %d, %+v\n%s", r.code, j, r.stderr)
			}
			checkFrozen(t, id, false, "after the resume")
			b, _ := os.ReadFile(filepath.Join(rigDir(jobRig), "mpid-node0.log"))
			if !strings.Contains(string(b), "adopted a job left by the previous mpid") {
				t.Error("node0's new mpid did not say it adopted the job")
			}
		}},
		// Running again, the ranks register with the new mpids (their shims
		// retry), and the job can be paused again, cleanly.
		{"paused again once its ranks registered again", func(t *testing.T) {
			waitRegisteredAgain(ctx, t, id, job.done)
			j, r := jobJSON(ctx, t, "pause", id)
			if r.code != 0 {
				t.Fatalf("pause after the ranks registered again: exit %d\n%s", r.code, r.stderr)
			}
			checkPaused(ctx, t, "the pause after the restart", j, nodeJobCgroups(t, id), obs)
			if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
				t.Fatalf("second resume: exit %d, %+v\n%s", r.code, j, r.stderr)
			}
		}},
		{"the job ends as if unpaused", func(t *testing.T) {
			job.finish(ctx, t, "the job paused across an mpid restart", serial(t, app, 6, args...))
		}},
	} {
		if !t.Run(stage.name, stage.run) {
			return
		}
	}
}

// TestNodeMpidDiesMidPause: node2's mpid is killed while a pause drains (its
// rank 5 does not read, its shim's drain off) and started again. The pause rolls back on every
// node and its report names node2 and what happened there; the restarted mpid finds the job; nothing
// stays frozen or gated, and the job finishes with the output of an
// unpaused run.
func TestNodeMpidDiesMidPause(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	repairRigOnCleanup(t)
	id := fmt.Sprintf("nodedies-%d", os.Getpid())
	job := startUndrainedJob(ctx, t, mpiLibs[0], id)
	victim := statusOf(t, jobRig).Nodes[2].MPIDPid
	pause := start(ctx, t, "", []string{"MPIPAUSE_RIG=" + jobRig},
		filepath.Join(bin, "rig"), "exec", "node0", "--", "mpipause", "pause", "--json", "--timeout", "3s", id)
	waitFor(t, "the pause to start", time.Minute, pause.done, func() bool {
		j, _ := jobJSON(ctx, t, "status", id)
		return j.State == ctl.StatePausing
	})
	if err := syscall.Kill(victim, syscall.SIGKILL); err != nil {
		t.Fatalf("kill node2's mpid: %v", err)
	}
	waitFor(t, "node2's mpid to be gone", time.Minute, nil, func() bool {
		return syscall.Kill(victim, 0) != nil || procState(victim) == "Z"
	})
	mustRig(t, jobRig, "up", fmt.Sprint(jobNodes))
	<-pause.done
	var j ctl.Job
	out := pause.out.String()
	if a, b := strings.Index(out, "{"), strings.LastIndex(out, "}"); a >= 0 && b > a {
		out = out[a : b+1] // the JSON object, without what rig exec may add
	}
	if err := json.Unmarshal([]byte(out), &j); err != nil {
		t.Fatalf("pause --json: %v\n%s", err, pause.out.String())
	}
	if pause.err == nil || j.State == ctl.StatePaused || j.Failure == nil || !strings.Contains(j.Failure.Reason+j.Failure.Node, "node2") {
		t.Errorf("pause with node2's mpid killed: %v, state %q, failure %+v; want a failure naming node2", pause.err, j.State, j.Failure)
	}
	// The report says what happened on node2. Killed while PREPARE holds
	// node2's answer (its drain check waits for rank 5, which does not
	// read), the PREPARE is retransmitted to the restarted mpid, which runs
	// it afresh, and the pause fails in DRAIN on node2 for the rank that
	// does not read. Killed in a DRAIN round, the restarted mpid refuses
	// it (it never ran the PREPARE), or no mpid answers.
	why := j.Failure.Reason
	restarted := strings.Contains(why, "mpid restarted") || strings.Contains(why, "unreachable") || strings.Contains(why, "node2:")
	undrained := j.Failure.Phase == "DRAIN" && j.Failure.Node == "node2" && strings.Contains(why, "not reading")
	if !restarted && !undrained {
		t.Errorf("failure in %s on %s, %q: says neither that node2's mpid restarted nor that node2's rank did not read", j.Failure.Phase, j.Failure.Node, why)
	}
	t.Logf("failure report: phase %s, node %s: %s", j.Failure.Phase, j.Failure.Node, j.Failure.Reason)
	checkFrozen(t, id, false, "after the rollback")
	if s, r := jobJSON(ctx, t, "status", id); r.code != 0 || s.State != ctl.StateRunning {
		t.Errorf("status after the rollback: exit %d, state %q", r.code, s.State)
	}
	job.end(ctx, t, "the job after node2's mpid died mid-pause")
}

// waitRegisteredAgain waits until the job's ranks on every node have
// registered with restarted mpids: no node calls the job unpausable (each
// knows only its own ranks), and the coordinator counts all six.
func waitRegisteredAgain(ctx context.Context, t *testing.T, id string, done <-chan struct{}) {
	t.Helper()
	var last ctl.Job
	waitForWhy(t, "job "+id+"'s ranks to register again", time.Minute, done, func() (bool, string) {
		j, r := jobJSON(ctx, t, "status", id)
		last = j
		if r.code != 0 || j.Unpausable != "" || j.Ranks != 6 {
			return false, fmt.Sprintf("node0: exit %d, %d ranks, unpausable %q", r.code, j.Ranks, j.Unpausable)
		}
		for k := 1; k < jobNodes; k++ {
			r := cli(ctx, t, fmt.Sprintf("node%d", k), nil, "status", "--json", id)
			var n ctl.Job
			if r.code != 0 || json.Unmarshal([]byte(r.stdout), &n) != nil || n.Unpausable != "" {
				return false, fmt.Sprintf("node%d: exit %d, unpausable %q %s", k, r.code, n.Unpausable, r.stderr)
			}
		}
		return true, ""
	})
	t.Logf("registered again: %d ranks, state %s", last.Ranks, last.State)
}

// TestMisKeyedNodeFailsAtOnce: node2's mpid holds another cluster key (a
// key file not copied to every node, the usual slip). node2's mpid cannot
// check the job's key, so the ranks there cannot join their job (each says
// so, naming the key file) and node2 never registers with the coordinator;
// a pause is refused at once naming node2 and the key (rank 0's host list
// says the job has ranks there), nothing is frozen, and the job runs on to
// the output of an unpaused run.
func TestMisKeyedNodeFailsAtOnce(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	restartNode2 := func(t *testing.T, env ...string) {
		t.Helper()
		stopRigMPIDs(t, 2)
		if _, err := startRigMPIDs(t, env...); err != nil {
			t.Fatal(err)
		}
	}
	restored := false
	t.Cleanup(func() {
		if !restored {
			restartNode2(t)
		}
	})
	restartNode2(t, rig.MPIDArgsEnv+"="+os.Getenv(rig.MPIDArgsEnv)+" --cluster-key "+newKeyFile(t))

	lib := mpiLibs[0]
	id := fmt.Sprintf("miskeyed-%d", os.Getpid())
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	args := []string{"-m", "a2a", "-n", "600", "-s", "64K"}
	job := runJob(ctx, t, lib, id, app, args...)
	// Rank 0 registered with the coordinator (so it knows the job's hosts)
	// and node1 with it. The job's size alone says no more than that some
	// rank registered: any rank's HELLO gives it.
	if !t.Run("rank 0 and node1's ranks register", func(t *testing.T) {
		waitForWhy(t, "rank 0 and node1's ranks to register", time.Minute, job.done, func() (bool, string) {
			j, r := jobJSON(ctx, t, "status", id)
			if r.code != 0 || j.Ranks != 6 || !slices.Contains(j.LocalRanks, 0) || !slices.Contains(j.Nodes, "node1") {
				return false, fmt.Sprintf("node0: exit %d, %d ranks, here %v, nodes %v", r.code, j.Ranks, j.LocalRanks, j.Nodes)
			}
			return true, ""
		})
	}) {
		return
	}
	if !t.Run("a pause refused at once, naming node2 and the key", func(t *testing.T) {
		start := time.Now()
		r := cli(ctx, t, "node0", nil, "pause", id)
		took := time.Since(start)
		t.Logf("pause with a mis-keyed node2: exit %d in %v:\n%s", r.code, took.Round(time.Millisecond), r.stderr)
		if r.code != 7 || !strings.Contains(r.stderr, "node2") || !strings.Contains(r.stderr, "cluster's key") ||
			strings.Contains(r.stderr, "deadline") || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Fatalf("pause: exit %d, stderr %q; want one line, exit 7 (cannot be paused cleanly), naming node2 and the key", r.code, r.stderr)
		}
	}) {
		return
	}
	// node2 has no cgroup of the job: its ranks never joined one.
	t.Run("nothing frozen", func(t *testing.T) {
		for _, cg := range nodeJobCgroups(t, id)[:2] {
			if fr, err := cgroupv2.Frozen(cg); err != nil || fr {
				t.Errorf("after the refused pause: %s frozen %v (%v)", cg, fr, err)
			}
		}
	})
	t.Run("the job runs on, node2's ranks saying why they did not join", func(t *testing.T) {
		restartNode2(t)
		restored = true
		job.finish(ctx, t, "the job after a mis-keyed node", serial(t, app, 6, args...))
		if !strings.Contains(job.out.String(), "same cluster key file") {
			t.Errorf("node2's ranks did not say why they could not join their job:\n%s", job.out.String())
		}
	})
}

// TestMpidRestartPastWalkBound: node1's mpid dies while a job is paused,
// and the job's cgroup there gets more cgroups in its tree than a
// restarted mpid walks (mpid.MaxWalk; its owner may make them below a
// cgroup of its own, root does here). The new mpid adopts the job whole,
// paused, and says why it cannot be paused again (that cgroup, the
// bound); `mpipause resume` thaws it on every node; a pause after is
// refused naming it; once the cgroups are gone and mpid restarted again,
// the job pauses, and its output is an unpaused run's.
func TestMpidRestartPastWalkBound(t *testing.T) {
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	repairRigOnCleanup(t)
	lib := mpiLibs[len(mpiLibs)-1]
	id := fmt.Sprintf("walkbound-%s-%d", lib.name, os.Getpid())
	app := filepath.Join(binDir(t), "apps", "xchg."+lib.name)
	args, stop := []string{"-m", "a2a", "-s", "64K"}, t.TempDir()
	job := runJobEnv(ctx, t, lib, id, nil, app, append(slices.Clone(args), "-n", "100000000", "-E", stop)...)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitForWhy(t, "the job's ranks on every node", time.Minute, job.done, func() (bool, string) {
		if j, _ := jobJSON(ctx, t, "status", id); len(j.Cgroups) != jobNodes {
			return false, fmt.Sprintf("%+v", j)
		}
		return allRegistered(ctx, t, id)
	})
	if j, r := jobJSON(ctx, t, "pause", id); r.code != 0 || j.State != ctl.StatePaused {
		t.Fatalf("pause: exit %d, state %q\n%s", r.code, j.State, r.stderr)
	}
	cg := nodeJobCgroups(t, id)[1]
	var below []string
	removeBelow := func() {
		for _, d := range below {
			if err := cgroupv2.RemoveEmpty(d); err != nil {
				t.Error(err)
			}
		}
		below = nil
	}
	t.Cleanup(removeBelow)
	pid := statusOf(t, jobRig).Nodes[1].MPIDPid
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill node1's mpid: %v", err)
	}
	waitFor(t, "node1's mpid to be gone", time.Minute, nil, func() bool {
		return syscall.Kill(pid, 0) != nil || procState(pid) == "Z"
	})
	for i := range mpid.MaxWalk {
		d := filepath.Join(cg, fmt.Sprintf("c%d", i))
		if err := cgroupv2.Create(d); err != nil {
			t.Fatal(err)
		}
		below = append(below, d)
	}
	mustRig(t, jobRig, "up", fmt.Sprint(jobNodes))
	checkFrozen(t, id, true, "after node1's mpid restarted")

	r := cli(ctx, t, "node1", nil, "status", "--json", id)
	var j1 ctl.Job
	if err := json.Unmarshal([]byte(r.stdout), &j1); err != nil || j1.State != ctl.StatePaused ||
		!strings.Contains(j1.Unpausable, cg) || !strings.Contains(j1.Unpausable, fmt.Sprint(mpid.MaxWalk)) {
		t.Fatalf("node1's status after its restart: %v, %s%s; want paused, unpausable naming %s and %d", err, r.stdout, r.stderr, cg, mpid.MaxWalk)
	}
	t.Logf("node1 says: %s", j1.Unpausable)
	if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("resume: exit %d, %+v\n%s", r.code, j, r.stderr)
	}
	checkFrozen(t, id, false, "after the resume")
	r = cli(ctx, t, "node0", nil, "pause", id)
	t.Logf("pause after: exit %d: %s", r.code, strings.TrimSpace(r.stderr))
	if r.code == 0 || !strings.Contains(r.stderr, cg) {
		t.Errorf("pause after the resume: exit %d, %s; want it refused naming %s", r.code, r.stderr, cg)
	}
	checkFrozen(t, id, false, "after the refused pause")

	removeBelow()
	restartMPIDOf(t, 1)
	waitRegisteredAgain(ctx, t, id, job.done)
	if j, r := jobJSON(ctx, t, "pause", id); r.code != 0 || j.State != ctl.StatePaused {
		t.Fatalf("pause with the cgroups gone: exit %d, state %q\n%s", r.code, j.State, r.stderr)
	}
	if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("resume: exit %d, state %q\n%s", r.code, j.State, r.stderr)
	}
	job.stopAndCheck(ctx, t, "the job adopted past the walk's bound", stop, app, 2*jobNodes, args...)
}

// restartMPIDOf kills node k's mpid and has `rig up` start a new one.
func restartMPIDOf(t *testing.T, k int) {
	t.Helper()
	pid := statusOf(t, jobRig).Nodes[k].MPIDPid
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill node%d's mpid: %v", k, err)
	}
	waitFor(t, fmt.Sprintf("node%d's mpid to be gone", k), time.Minute, nil, func() bool {
		return syscall.Kill(pid, 0) != nil || procState(pid) == "Z"
	})
	mustRig(t, jobRig, "up", fmt.Sprint(jobNodes))
}
