package kerneltests

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
)

// TestConcurrentJobs (load): 20 jobs at once on the rig (one rank
// per node each: 60 ranks on two cores), half Open MPI, half MPICH, each
// paused and resumed several times from four "shells"
// working at the same time, from node0 and node1 (which forwards to the
// coordinator), with status calls on the other shells' jobs in between.
// Every pause must commit with all three of its job's cgroups frozen, every
// resume must run, and every job must finish with the output of an unpaused
// run. MPIPAUSE_LOAD_JOBS and MPIPAUSE_LOAD_ROUNDS change the 20 and 2;
// MPIPAUSE_LOAD_ROUNDS=0 runs the same jobs under the same load with no
// pause at all, the baseline that tells a failure of the load itself (MPI
// libraries on 60 spinning ranks) from one of mpipause.
func TestConcurrentJobs(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	// 10 by default: on a 2-core machine whose kernel makes every kernel
	// read walk the TCP table (loader's ScansTCP), 20 jobs' 60 spinning
	// ranks starved the daemons (resumes of 8-14 s) until the test's
	// deadline; MPIPAUSE_LOAD_JOBS=20 is the heavier run.
	njobs, rounds, shells := envCount("MPIPAUSE_LOAD_JOBS", 10), 2, 4
	if n, err := strconv.Atoi(os.Getenv("MPIPAUSE_LOAD_ROUNDS")); err == nil && n >= 0 {
		rounds = n
	}
	type loadJob struct {
		*faultJob
		hold string
	}
	jobs := make([]*loadJob, njobs)
	t0 := time.Now()
	for i := range jobs {
		lib := mpiLibs[i%len(mpiLibs)]
		f := &faultJob{id: fmt.Sprintf("load%d-%02d", os.Getpid(), i), app: filepath.Join(bin, "apps", "xchg."+lib.name), stop: t.TempDir(), ranks: 3}
		// Light on purpose, sleeping between iterations: 120 ranks share
		// two cores, and MPI libraries spin while they wait.
		f.args = []string{"-m", "ring", "-s", "32K", "-z", "20000"}
		hold := t.TempDir()
		f.proc = runJob(ctx, t, onePerNode(lib), f.id, f.app, append(f.args, "-n", "1000000", "-E", f.stop, "-w", hold)...)
		jobs[i] = &loadJob{f, hold}
	}
	for _, j := range jobs {
		atHold(t, j.hold, 3, j.proc)
	}
	for _, j := range jobs {
		release(t, j.hold)
	}
	t.Logf("%d jobs (%d ranks) running after %v", njobs, 3*njobs, time.Since(t0).Round(time.Millisecond))

	t.Run("pauses and resumes from the shells", func(t *testing.T) {
		var mu sync.Mutex
		var problems []string
		problem := func(format string, args ...any) {
			mu.Lock()
			defer mu.Unlock()
			problems = append(problems, fmt.Sprintf(format, args...))
		}
		var pauses, resumes, statuses int
		var pauseMs []float64
		var wg sync.WaitGroup
		for s := range shells {
			wg.Go(func() {
				for r := range rounds {
					for i := s; i < njobs; i += shells {
						id := jobs[i].id
						node := fmt.Sprintf("node%d", (r+i)%2) // node1 forwards
						j, code, stderr := cliJSON(ctx, bin, node, "pause", "--timeout", "30s", id)
						mu.Lock()
						pauses++
						mu.Unlock()
						if code != 0 || j.State != ctl.StatePaused {
							problem("shell %d: pause %s from %s: exit %d, state %q: %s", s, id, node, code, j.State, stderr)
							continue
						}
						mu.Lock()
						pauseMs = append(pauseMs, j.TotalMs)
						mu.Unlock()
						for _, cg := range nodeJobCgroups(t, id) {
							if f, err := cgroupv2.Frozen(cg); err != nil || !f {
								problem("shell %d: %s committed, but %s is not frozen (%v)", s, id, cg, err)
							}
						}
						other := jobs[(i+1+r)%njobs].id
						if _, code, stderr := cliJSON(ctx, bin, "node1", "status", other); code != 0 {
							problem("shell %d: status %s: exit %d: %s", s, other, code, stderr)
						}
						j, code, stderr = cliJSON(ctx, bin, node, "resume", id)
						mu.Lock()
						statuses++
						resumes++
						mu.Unlock()
						if code != 0 || j.State != ctl.StateRunning {
							problem("shell %d: resume %s from %s: exit %d, state %q: %s", s, id, node, code, j.State, stderr)
						}
					}
				}
			})
		}
		wg.Wait()
		if len(pauseMs) > 0 {
			t.Logf("%d pauses, %d resumes, %d status calls from %d shells; pause p50 %.1f ms, max %.1f ms",
				pauses, resumes, statuses, shells, bench.Percentile(pauseMs, 0.5), bench.Percentile(pauseMs, 1))
		}
		for _, p := range problems {
			t.Error(p)
		}
	})
	// Whatever the pauses did, every job is stopped and its output judged.
	t.Run("every job ends as if unpaused", func(t *testing.T) {
		// A deadline of its own: however long the pauses took, the jobs
		// get the time to stop.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		differed := 0
		for _, j := range jobs {
			if !j.finish(ctx, t) {
				differed++
			}
		}
		t.Logf("%d of %d jobs finished with the output of an unpaused run", njobs-differed, njobs)
	})
}

// cliJSON runs `mpipause OP --json ARGS` in a rig node without a testing.T,
// for tests that run the CLI from several goroutines.
func cliJSON(ctx context.Context, bin, node, op string, args ...string) (ctl.Job, int, string) {
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "rig"), append([]string{"exec", node, "--", "mpipause", op, "--json"}, args...)...)
	cmd.Env = append(os.Environ(), "MPIPAUSE_RIG="+jobRig)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		return ctl.Job{}, -1, err.Error()
	}
	var j ctl.Job
	if e := json.Unmarshal(out.Bytes(), &j); e != nil {
		return j, code, fmt.Sprintf("not JSON (%v): %s%s", e, out.String(), errb.String())
	}
	return j, code, errb.String() + out.String()
}

// onePerNode launches lib's jobs with one rank on each of the 3 nodes.
func onePerNode(lib mpiLib) mpiLib {
	hosts := "node0:1,node1:1,node2:1"
	if lib.name == "openmpi" {
		return mpiLib{name: lib.name, launch: func(app string, args ...string) []string {
			return append([]string{"mpirun.openmpi", "-np", "3", "-H", hosts, app}, args...)
		}}
	}
	return mpiLib{name: lib.name, launch: func(app string, args ...string) []string {
		return append([]string{"mpiexec.mpich", "-n", "3", "-hosts", hosts, app}, args...)
	}}
}
