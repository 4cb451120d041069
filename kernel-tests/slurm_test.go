package kerneltests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/loader"
)

// TestSlurmSuspendResume is mpipause under a real Slurm: slurmctld on node0
// and a slurmd on every rig node, the SPANK plugin (slurm/) enabled by one
// line of plugstack.conf, and a 3 x 2 job of each library launched by srun
// (MPICH with --mpi=pmi2, Open MPI with --mpi=pmix) with nothing of
// mpipause on its command line. The plugin names the step's job JOBID.0 and
// gives its ranks the shim (subtest plugin: the environment, --mpipause=no,
// bad arguments). `scontrol suspend` (SIGTSTP to every process of the step,
// then 2 s later SIGSTOP) must pause the job consistently before the
// SIGSTOP: the pause commits after slurmstepd's first SIGTSTP and before
// its first SIGSTOP (their log lines), and the test's own kernel readers
// (BPF and sock_diag) find every job connection on every node empty and
// every node's job cgroup frozen, also once the SIGSTOP has come. `scontrol
// resume` (SIGCONT) resumes it: the plugin's watcher asks mpid. `mpipause
// pause JOBID` and `resume JOBID` with the bare Slurm job id pause and
// resume it too. The job then ends with the output of an unpaused run of as
// many iterations. Last, scancel of a suspended job ends it (subtest
// cancel). Subtest rootpeer: the plugin takes a step's job key only from a
// control socket root serves.
func TestSlurmSuspendResume(t *testing.T) {
	bin := binDir(t)
	plugin := filepath.Join(bin, "mpipause_spank.so")
	if _, err := os.Stat(plugin); err != nil {
		t.Fatalf("%v (make build builds it where spank.h is installed: make deps installs libslurm-dev)", err)
	}
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	shim := filepath.Join(bin, "libmpipause.so")
	plugstack := fmt.Sprintf("required %s shim=%s\n", plugin, shim)
	slurm := startSlurm(ctx, t, plugstack)
	t.Run("plugin", func(t *testing.T) { testSlurmPlugin(ctx, t, slurm, plugin, shim, plugstack) })
	t.Run("rootpeer", func(t *testing.T) { testSlurmPluginRootPeer(ctx, t, slurm, plugin, shim, plugstack) })
	for _, lib := range []struct{ name, mpi string }{{"mpich", "pmi2"}, {"openmpi", "pmix"}} {
		t.Run(lib.name, func(t *testing.T) { testSlurmSuspendResume(ctx, t, slurm, lib.name, lib.mpi) })
	}
	t.Run("cancel", func(t *testing.T) { testSlurmCancel(ctx, t, slurm) })
	t.Run("sbatch-mpirun", func(t *testing.T) { testSlurmSbatchMpirun(ctx, t, slurm) })
}

// testSlurmSbatchMpirun: Open MPI's mpirun inside an sbatch script, as most
// Open MPI users run: mpirun starts orted on the other nodes with srun and
// the ranks of its own node itself. Every rank, on every node, registers
// as one job, JOBID.batch; scontrol suspend pauses it with every connection
// empty (orted's SIGSTOP of its ranks made a SIGTSTP by the shim in it),
// scontrol resume resumes it, and it ends with an unpaused run's output.
func testSlurmSbatchMpirun(ctx context.Context, t *testing.T, slurm *slurmCluster) {
	bin := binDir(t)
	app := filepath.Join(bin, "apps", "xchg.openmpi")
	stop := t.TempDir()
	args := []string{"-m", "a2a", "-s", "256K"}
	script, out := filepath.Join(stop, "job.sh"), filepath.Join(stop, "job.out")
	text := fmt.Sprintf("#!/bin/sh\nexec mpirun.openmpi -np %d --map-by ppr:2:node %s %s -n 1000000 -E %s\n",
		2*jobNodes, app, strings.Join(args, " "), stop)
	if err := os.WriteFile(script, []byte(text), 0o755); err != nil {
		t.Fatal(err)
	}
	jobID := strings.TrimSpace(slurm.must(ctx, t, "sbatch", "--parsable", "-N", fmt.Sprint(jobNodes),
		"-n", fmt.Sprint(2*jobNodes), "-O", "-o", out, script))
	id := jobID + ".batch"
	t.Cleanup(func() { slurm.run(context.Background(), "scancel", jobID) })
	killJobOnCleanup(t, id)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	jobOut := func() string { b, _ := os.ReadFile(out); return string(b) }
	waitForWhy(t, "every rank of "+id+" to register with mpid", 2*time.Minute, nil, func() (bool, string) {
		ok, why := allRegistered(ctx, t, id)
		return ok, why + "\n" + jobOut()
	})
	j, _ := jobJSON(ctx, t, "status", id)
	var cgs []string
	for _, c := range j.Cgroups {
		cgs = append(cgs, c.Dir)
	}
	var readers []loader.Observer
	for _, kind := range []string{loader.KindBPF, loader.KindSockDiag} {
		o, err := loader.Open(ctx, loader.Config{Cgroups: cgs, FollowJob: true, Require: kind, Unbounded: true})
		if err != nil {
			t.Fatalf("the test's %s reader of %v: %v", kind, cgs, err)
		}
		t.Cleanup(func() { o.Close() })
		readers = append(readers, o)
	}
	waitProgress(ctx, t, readers[0], nil, 0, 8<<20)

	slurm.must(ctx, t, "scontrol", "suspend", jobID)
	waitForWhy(t, "scontrol suspend to pause "+id, time.Minute, nil, func() (bool, string) {
		j, _ = jobJSON(ctx, t, "status", id)
		return j.State == ctl.StatePaused, fmt.Sprintf("%s %+v", j.State, j.Failure)
	})
	checkPaused(ctx, t, "scontrol suspend of the batch job", j, cgs, readers...)
	before := sentBytes(ctx, readers[0])
	slurm.must(ctx, t, "scontrol", "resume", jobID)
	waitForWhy(t, "scontrol resume to resume "+id, time.Minute, nil, func() (bool, string) {
		j, _ = jobJSON(ctx, t, "status", id)
		return j.State == ctl.StateRunning, j.State
	})
	waitProgress(ctx, t, readers[0], nil, before, 4<<20)

	if err := os.WriteFile(filepath.Join(stop, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	waitForWhy(t, "the batch job to end", 2*time.Minute, nil, func() (bool, string) {
		q, _ := slurm.run(ctx, "squeue", "-h", "-j", jobID)
		return strings.TrimSpace(q) == "", q
	})
	m := itersRE.FindStringSubmatch(jobOut())
	if m == nil {
		t.Fatalf("the batch job printed no result:\n%s", jobOut())
	}
	want := serial(t, app, 2*jobNodes, append(args, "-n", m[1])...)
	if got, w := checksum(jobOut()), checksum(want); got == "" || got != w {
		t.Fatalf("the batch job printed %q after %s iterations; an unpaused run %q\n%s", got, m[1], w, jobOut())
	}
	t.Logf("batch job %s (%s iterations) suspended and resumed by Slurm: paused with every connection empty, output unchanged", id, m[1])
}

func testSlurmSuspendResume(ctx context.Context, t *testing.T, slurm *slurmCluster, lib, mpi string) {
	bin := binDir(t)
	app := filepath.Join(bin, "apps", "xchg."+lib)
	stop := t.TempDir()
	args := []string{"-m", "a2a", "-s", "256K"}
	s := slurmJob(ctx, t, slurm, lib, mpi, append(args, "-n", "1000000", "-E", stop)...)
	job, jobID, step, cgs, readers := s.job, s.jobID, s.step, s.cgs, s.readers
	// Whatever happens, the job must not stay frozen past the test.
	defer cli(context.Background(), t, "node0", nil, "resume", step)

	// scontrol suspend: the pause must commit inside Slurm's window.
	slurm.must(ctx, t, "scontrol", "suspend", jobID)
	var j ctl.Job
	waitForWhy(t, "scontrol suspend to pause the job", time.Minute, job.done, func() (bool, string) {
		j, _ = jobJSON(ctx, t, "status", step)
		return j.State == ctl.StatePaused, j.State
	})
	checkPaused(ctx, t, "scontrol suspend", j, cgs, readers...)
	var tstp, stop2 []time.Time
	waitFor(t, "every slurmstepd to log its SIGSTOP", time.Minute, job.done, func() bool {
		tstp = slurm.stepLogTimes(t, step, "_handle_suspend")
		stop2 = slurm.stepLogTimes(t, step, "Suspended StepId="+step)
		return len(stop2) >= jobNodes && len(tstp) >= jobNodes
	})
	// The first SIGTSTP starts the pause (its ranks ask mpid); the first
	// SIGSTOP ends the window.
	tstp0, stop0 := slices.MinFunc(tstp, time.Time.Compare), slices.MinFunc(stop2, time.Time.Compare)
	if !j.Since.After(tstp0) || !j.Since.Before(stop0) {
		t.Fatalf("the pause committed at %s, outside Slurm's window: SIGTSTP at %v, SIGSTOP at %v",
			j.Since.Format(time.StampMilli), tstp, stop2)
	}
	t.Logf("scontrol suspend: the pause committed %.0f ms after the first slurmstepd's SIGTSTP, %.0f ms before the first SIGSTOP (pause %.1f ms, %d connections empty)",
		float64(j.Since.Sub(tstp0).Microseconds())/1000, float64(stop0.Sub(j.Since).Microseconds())/1000, j.TotalMs, j.Connections)
	// Slurm's SIGSTOP reached the frozen ranks: still paused, still empty.
	j, _ = jobJSON(ctx, t, "status", step)
	checkPaused(ctx, t, "after Slurm's SIGSTOP", j, cgs, readers...)
	if out := slurm.must(ctx, t, "squeue", "-h", "-j", jobID, "-o", "%T"); strings.TrimSpace(out) != "SUSPENDED" {
		t.Fatalf("squeue says the job is %q, not SUSPENDED", strings.TrimSpace(out))
	}

	// scontrol resume: the watchers see the SIGCONT and resume the job.
	before := sentBytes(ctx, slurm.progress)
	slurm.must(ctx, t, "scontrol", "resume", jobID)
	waitForWhy(t, "scontrol resume to resume the job", time.Minute, job.done, func() (bool, string) {
		j, _ = jobJSON(ctx, t, "status", step)
		return j.State == ctl.StateRunning, j.State
	})
	waitProgress(ctx, t, slurm.progress, job.done, before, 4<<20)

	// The bare Slurm job id names the step's job.
	j, r := jobJSON(ctx, t, "pause", jobID)
	if r.code != 0 || j.ID != step {
		t.Fatalf("mpipause pause %s: exit %d, job %q: %s", jobID, r.code, j.ID, r.stderr)
	}
	checkPaused(ctx, t, "mpipause pause "+jobID, j, cgs, readers...)
	if j, r := jobJSON(ctx, t, "resume", jobID); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("mpipause resume %s: exit %d, state %q: %s", jobID, r.code, j.State, r.stderr)
	}

	// The job ends with an unpaused run's output.
	if err := os.WriteFile(filepath.Join(stop, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-job.done:
	case <-ctx.Done():
		t.Fatalf("the job did not stop: %v\n%s", ctx.Err(), job.out.String())
	}
	m := itersRE.FindStringSubmatch(job.out.String())
	if job.err != nil || m == nil {
		t.Fatalf("srun: %v\n%s", job.err, job.out.String())
	}
	want := serial(t, app, 2*jobNodes, append(args, "-n", m[1])...)
	if got, w := checksum(job.out.String()), checksum(want); got == "" || got != w {
		t.Fatalf("the job printed %q after %s iterations; an unpaused run %q\n%s", got, m[1], w, job.out.String())
	}
	t.Logf("job %s (%s iterations) suspended and resumed by Slurm, paused and resumed by its Slurm id: output unchanged", step, m[1])
}

// slurmJob starts app with args as a 3 x 2 job of lib under srun (--mpi=mpi)
// and returns once every rank has registered with mpid and the job has sent
// 8 MiB: the srun process, the Slurm job id, the step's mpipause job id and
// its job cgroups on the nodes.
func slurmJob(ctx context.Context, t *testing.T, slurm *slurmCluster, lib, mpi string, args ...string) *slurmStep {
	t.Helper()
	app := filepath.Join(binDir(t), "apps", "xchg."+lib)
	sent0 := sentBytes(ctx, slurm.progress)
	name := fmt.Sprintf("mpipause-e2e-%s-%d", lib, os.Getpid())
	s := &slurmStep{}
	s.job = slurm.srun(ctx, t, append([]string{"--mpi=" + mpi, "-J", name, "-N", fmt.Sprint(jobNodes), "-n", fmt.Sprint(2 * jobNodes),
		"--ntasks-per-node=2", "-O", app}, args...)...)
	waitForWhy(t, "squeue to show the job", time.Minute, s.job.done, func() (bool, string) {
		out, _ := slurm.run(ctx, "squeue", "-h", "-n", name, "-o", "%i")
		s.jobID = strings.TrimSpace(out)
		return s.jobID != "", s.job.out.String()
	})
	s.step = s.jobID + ".0"
	killJobOnCleanup(t, s.step)
	// A step that ends first says why in its own output (srun's, the
	// ranks' MPI_Init errors): the failure shows it.
	waitForWhy(t, "every rank of step "+s.step+" to register with mpid", time.Minute, s.job.done, func() (bool, string) {
		j, r := jobJSON(ctx, t, "status", s.step)
		if j.State != ctl.StateRunning || len(j.Nodes) != jobNodes {
			return false, fmt.Sprintf("%+v %s; the step's output:\n%s", j, r.stderr, s.job.out.String())
		}
		ok, why := allRegistered(ctx, t, s.step)
		return ok, why + "; the step's output:\n" + s.job.out.String()
	})
	// Each node's mpid says where it placed the step's ranks: inside the
	// cgroup their slurmd started them in, never out of it.
	for k := range jobNodes {
		node := fmt.Sprintf("node%d", k)
		r := cli(ctx, t, node, nil, "status", "--json", s.step)
		var j ctl.Job
		if err := json.Unmarshal([]byte(r.stdout), &j); err != nil || r.code != 0 {
			t.Fatalf("mpipause status --json %s on %s: exit %d, %v: %s", s.step, node, r.code, err, r.stderr)
		}
		var here []ctl.Cgroup // the coordinator (node0) lists every node's
		for _, c := range j.Cgroups {
			if c.Node == node {
				here = append(here, c)
			}
		}
		if len(here) != 1 || here[0].Placed != "inner" || filepath.Dir(here[0].Dir) != slurm.nodes[k] {
			t.Fatalf("%s's mpid placed step %s in %+v; want one cgroup, inner, inside slurmd's %s", node, s.step, j.Cgroups, slurm.nodes[k])
		}
		s.cgs = append(s.cgs, here[0].Dir)
	}
	// The kernel checks read the ranks' cgroups alone: Slurm's daemons talk
	// on while the job is paused.
	for _, kind := range []string{loader.KindBPF, loader.KindSockDiag} {
		o, err := loader.Open(ctx, loader.Config{Cgroups: s.cgs, FollowJob: true, Require: kind})
		if err != nil {
			t.Fatalf("the test's %s reader of %v: %v", kind, s.cgs, err)
		}
		t.Cleanup(func() { o.Close() })
		s.readers = append(s.readers, o)
	}
	waitProgress(ctx, t, slurm.progress, s.job.done, sent0, 8<<20)
	return s
}

// slurmStep is a running step of slurmJob's: srun, the Slurm job id, the
// step's mpipause job id, its ranks' cgroups on the nodes and the test's
// kernel readers of them (BPF, sock_diag).
type slurmStep struct {
	job         *proc
	jobID, step string
	cgs         []string
	readers     []loader.Observer
}

// testSlurmCancel: scancel of a job that scontrol suspend paused ends it
// (slurmstepd terminates a suspended step with SIGKILL at once, which kills
// frozen processes too), and mpid forgets it.
func testSlurmCancel(ctx context.Context, t *testing.T, slurm *slurmCluster) {
	s := slurmJob(ctx, t, slurm, "mpich", "pmi2", "-m", "a2a", "-s", "256K", "-n", "1000000")
	job, jobID, step, cgs := s.job, s.jobID, s.step, s.cgs
	defer cli(context.Background(), t, "node0", nil, "resume", step)
	slurm.must(ctx, t, "scontrol", "suspend", jobID)
	waitForWhy(t, "scontrol suspend to pause the job", time.Minute, job.done, func() (bool, string) {
		j, _ := jobJSON(ctx, t, "status", step)
		return j.State == ctl.StatePaused, j.State
	})
	t0 := time.Now()
	slurm.must(ctx, t, "scancel", jobID)
	select {
	case <-job.done:
	case <-time.After(time.Minute):
		t.Fatalf("srun did not end within a minute of scancel of the paused job\n%s", job.out.String())
	}
	t.Logf("scancel of the paused job %s: srun ended %v later", jobID, time.Since(t0).Round(time.Millisecond))
	waitFor(t, "the job's cgroups to go", time.Minute, nil, func() bool {
		for _, cg := range cgs {
			if _, err := os.Stat(cg); err == nil {
				return false
			}
		}
		return true
	})
}

// testSlurmPlugin: what the plugin gives a step (and what srun --mpipause=no
// and a wrong plugstack.conf argument do), read from a task's environment.
func testSlurmPlugin(ctx context.Context, t *testing.T, slurm *slurmCluster, plugin, shim, plugstack string) {
	env := func(args ...string) (string, error) {
		return slurm.run(ctx, append(append([]string{"srun", "-N1", "-n1"}, args...),
			"sh", "-c", `echo "id=$MPIPAUSE_JOBID step=$SLURM_JOB_ID.$SLURM_STEP_ID preload=$LD_PRELOAD"`)...)
	}
	out, err := env()
	if err != nil {
		t.Fatal(err)
	}
	var id, step, preload string
	fmt.Sscanf(strings.ReplaceAll(strings.TrimSpace(out), "=", " "), "id %s step %s preload %s", &id, &step, &preload)
	if id == "" || id != step || !strings.HasSuffix(preload, ":"+shim) && preload != shim {
		t.Errorf("a step's task has MPIPAUSE_JOBID %q (want %q) and LD_PRELOAD %q (want the shim last): %s", id, step, preload, out)
	}
	// A step of a user who is not root: slurmstepd runs the plugin's
	// user_init with that user's privileges, and mpid gives another user's
	// job key to root alone (the plugin asks in init_post_opt, as root).
	// srun reads slurm.conf and reaches munge as that user.
	for _, d := range []string{filepath.Dir(slurm.dir), slurm.dir, filepath.Join(slurm.dir, "munge")} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	out, err = slurm.run(ctx, "setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
		"srun", "-N1", "-n1", "--chdir=/tmp", "sh", "-c", `echo "uid=$(id -u) key=$MPIPAUSE_JOBKEY preload=$LD_PRELOAD"`)
	if err != nil || !strings.Contains(out, "uid=65534 key=") || strings.Contains(out, "key= ") || !strings.Contains(out, shim) {
		t.Errorf("a step of nobody's: want the job key and the shim in its task's environment, got (%v): %s", err, out)
	}
	if out, err := env("--mpipause=no"); err != nil || !strings.Contains(out, "id= ") || strings.Contains(out, shim) {
		t.Errorf("srun --mpipause=no: the task still has mpipause's environment (%v): %s", err, out)
	}
	if out, err := env("--mpipause=maybe"); err == nil || !strings.Contains(out, "--mpipause=maybe: want yes or no") {
		t.Errorf("srun --mpipause=maybe: want one error line saying what is wrong, got (%v): %s", err, out)
	}
	// plugstack.conf is read by every srun: a wrong argument is one line.
	conf := filepath.Join(slurm.dir, "plugstack.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf("required %s shim=lib.so\n", plugin)), 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.WriteFile(conf, []byte(plugstack), 0o644)
	if out, err := env(); err == nil || !strings.Contains(out, "mpipause: plugstack.conf argument shim=lib.so: want shim=/ABSOLUTE/PATH") {
		t.Errorf("a wrong plugstack.conf argument: want srun to fail with one line saying what is wrong, got (%v): %s", err, out)
	}
}

// testSlurmPluginRootPeer (docs/security.md, M3): slurmstepd's plugin asks
// mpid, as root, for each step's job key and hands it to the tasks, so it
// must believe only a control socket that root serves. With plugstack.conf
// naming an abstract control socket (which any user can bind while mpid is
// down), a server there that answers every request with a forged key is
// believed when root runs it (the control: the plugin does ask there and
// hands on what it hears) and refused when uid 1001 runs it: the step's
// task then has neither that key nor the shim, and the step's stderr
// (which srun shows) says who served the socket.
func testSlurmPluginRootPeer(ctx context.Context, t *testing.T, slurm *slurmCluster, plugin, shim, plugstack string) {
	addr := fmt.Sprintf("@mpipause-kt-spank-%d", os.Getpid())
	conf := filepath.Join(slurm.dir, "plugstack.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf("required %s shim=%s ctl=%s\n", plugin, shim, addr)), 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.WriteFile(conf, []byte(plugstack), 0o644)
	bin := squatter(t)
	for _, c := range []struct {
		uid     int
		trusted bool
	}{{0, true}, {attackerUID, false}} {
		// Abstract names are per network namespace: the server, and the
		// step's slurmstepd, in node0's.
		p, bound := startSquat(ctx, t, bin, c.uid, "node0", addr)
		if !bound {
			t.Fatalf("uid %d could not bind %s on node0: %s", c.uid, addr, p.out.String())
		}
		out, err := slurm.run(ctx, "srun", "-N1", "-n1", "-w", "node0", "sh", "-c", `echo "key=$MPIPAUSE_JOBKEY preload=$LD_PRELOAD"`)
		p.cmd.Process.Kill()
		<-p.done
		if err != nil {
			t.Fatalf("srun with uid %d serving %s: %v", c.uid, addr, err)
		}
		var task string
		for _, l := range strings.Split(out, "\n") {
			if strings.HasPrefix(l, "key=") {
				task = l
			}
		}
		forged, shimmed := strings.HasPrefix(task, "key="+forgedMarker+" "), strings.Contains(task, shim)
		refusal := fmt.Sprintf("%s is served by uid %d, not by root", addr, c.uid)
		switch {
		case task == "":
			t.Fatalf("uid %d serving %s: the task printed nothing: %s", c.uid, addr, out)
		case c.trusted && (!forged || !shimmed):
			t.Errorf("control: root serving %s: the task has %q; want the key root's server gave (%s) and the shim", addr, task, forgedMarker)
		case !c.trusted && (forged || shimmed):
			t.Errorf("uid %d serving %s: the plugin BELIEVED it: the task has %q", c.uid, addr, task)
		case !c.trusted && !strings.Contains(out, refusal):
			t.Errorf("uid %d serving %s: the step's stderr does not say %q: %s", c.uid, addr, refusal, out)
		default:
			t.Logf("uid %d serving %s: the task has %q", c.uid, addr, task)
		}
	}
}
