package kerneltests

import (
	"bufio"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
)

// slurmCluster is a real Slurm (Debian's slurm-wlm 22.05) on the shared
// rig: munged on the host (its socket is a path, which every node sees),
// slurmctld on node0 and a slurmd on every node, all with a configuration
// and state of the test's own in a temporary directory, and all in one
// cgroup of the test's (each slurmd in one of its own inside it), killed
// whole when the test ends.
type slurmCluster struct {
	dir, conf string
	env       []string // SLURM_CONF for the clients
	// cgroup holds every daemon of the cluster; nodes[k] is node k's
	// slurmd's, as a real node's slurmd has a cgroup of its own. Slurm's
	// tasks start in it and mpid places them inside it.
	cgroup string
	nodes  []string
	// progress reads the bytes sent by everything in cgroup, attached
	// before any job starts: the ranks' and Slurm's own.
	progress loader.Observer
}

// slurmTools are what the cluster runs; scripts/deps.sh installs them.
var slurmTools = []string{"munged", "munge", "slurmctld", "slurmd", "slurmstepd", "srun", "scontrol", "sinfo", "squeue"}

// startSlurm brings the cluster up with plugstack (the lines of
// plugstack.conf) and returns once every node is idle in sinfo.
func startSlurm(ctx context.Context, t *testing.T, plugstack string) *slurmCluster {
	t.Helper()
	for _, tool := range slurmTools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s: %v (Slurm and munge are installed by scripts/deps.sh: make deps)", tool, err)
		}
	}
	dir := t.TempDir()
	c := &slurmCluster{dir: dir, conf: filepath.Join(dir, "slurm.conf")}
	c.env = []string{"SLURM_CONF=" + c.conf, "MPIPAUSE_RIG=" + jobRig}
	for _, d := range []string{"munge", "state", "log"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for k := 0; k < jobNodes; k++ {
		if err := os.MkdirAll(filepath.Join(dir, "spool", fmt.Sprintf("node%d", k)), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	key := make([]byte, 1024)
	rand.Read(key)
	write := func(name, text string, mode os.FileMode) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), mode); err != nil {
			t.Fatal(err)
		}
	}
	write("munge/munge.key", string(key), 0o400)
	write("plugstack.conf", plugstack, 0o644)
	write("cgroup.conf", cgroupConf, 0o644)
	conf := c.config(t)
	write("slurm.conf", conf, 0o644)
	// Each slurmd reads its configuration from a directory of its own,
	// the same slurm.conf but an mpi.conf of its own: the PMIx plugin
	// makes a directory per step for the ranks under PMIxCliTmpDirBase
	// (default /tmp), and the rig's nodes share one /tmp.
	for k := 0; k < jobNodes; k++ {
		n := fmt.Sprintf("node%d", k)
		if err := os.MkdirAll(filepath.Join(dir, n, "tmp"), 0o755); err != nil {
			t.Fatal(err)
		}
		write(filepath.Join(n, "slurm.conf"), conf, 0o644)
		write(filepath.Join(n, "cgroup.conf"), cgroupConf, 0o644)
		write(filepath.Join(n, "mpi.conf"), "PMIxCliTmpDirBase="+filepath.Join(dir, n, "tmp")+"\n", 0o644)
	}

	cg := testutil.NewCgroup(t)
	c.cgroup = cg
	sock := filepath.Join(dir, "munge", "munge.socket")
	start(context.Background(), t, cg, nil, "munged", "-F", "-f", "--socket="+sock,
		"--key-file="+filepath.Join(dir, "munge", "munge.key"), "--pid-file="+filepath.Join(dir, "munge", "munged.pid"),
		"--seed-file="+filepath.Join(dir, "munge", "munged.seed"), "--log-file="+filepath.Join(dir, "log", "munged.log"))
	waitFor(t, "munged's socket", 30*time.Second, nil, func() bool {
		return exec.Command("munge", "-S", sock, "-n").Run() == nil
	})
	rig := filepath.Join(binDir(t), "rig")
	start(context.Background(), t, cg, c.env, rig, "exec", "node0", "--", "slurmctld", "-D", "-f", c.conf)
	for k := 0; k < jobNodes; k++ {
		n := fmt.Sprintf("node%d", k)
		ncg := filepath.Join(cg, n)
		if err := cgroupv2.Create(ncg); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { removeCgroupTree(t, ncg) })
		c.nodes = append(c.nodes, ncg)
		start(context.Background(), t, ncg, c.env, rig, "exec", n, "--", "slurmd", "-D", "-N", n, "-f", filepath.Join(dir, n, "slurm.conf"))
	}
	waitForWhy(t, "every slurmd to be idle in sinfo", time.Minute, nil, func() (bool, string) {
		out, err := c.run(ctx, "sinfo", "-h", "-N", "-o", "%N %t")
		if err != nil {
			return false, out
		}
		idle := strings.Count(out, " idle\n")
		return idle == jobNodes, strings.TrimSpace(out)
	})
	c.progress = jobObserver(ctx, t, cg)
	return c
}

// cgroupConf: slurmd loads a cgroup plugin whatever the other plugins are;
// cgroup/v2 refuses a hybrid host ("Hybrid mode is not supported"), and with
// proctrack/linuxproc and task/none nothing of v1 is used.
const cgroupConf = "CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n"

// config is slurm.conf: the rig's nodes with what slurmd -C finds on this
// machine (a node described bigger than its hardware would be drained),
// process tracking by process tree (mpid places the step's ranks in a
// cgroup inside the one slurmd started them in; see docs/slurm.md), no accounting, debug logs (the test reads
// when slurmstepd suspended each step).
func (c *slurmCluster) config(t *testing.T) string {
	out, err := exec.Command("slurmd", "-C").Output()
	if err != nil {
		t.Fatalf("slurmd -C: %v", err)
	}
	var hw []string
	for _, f := range strings.Fields(strings.SplitN(string(out), "\n", 2)[0]) {
		if k, _, _ := strings.Cut(f, "="); k == "CPUs" || k == "Boards" || k == "SocketsPerBoard" || k == "CoresPerSocket" || k == "ThreadsPerCore" {
			hw = append(hw, f)
		}
	}
	d := c.dir
	var b strings.Builder
	fmt.Fprintf(&b, `# mpipause's Slurm test cluster (kernel-tests/slurm_cluster_test.go)
ClusterName=mpipause
SlurmctldHost=node0(10.77.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=%[1]s/munge/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/linear
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
StateSaveLocation=%[1]s/state
SlurmdSpoolDir=%[1]s/spool/%%n
SlurmctldPidFile=%[1]s/slurmctld.pid
SlurmdPidFile=%[1]s/slurmd-%%n.pid
SlurmctldLogFile=%[1]s/log/slurmctld.log
SlurmdLogFile=%[1]s/log/slurmd-%%n.log
SlurmctldDebug=verbose
SlurmdDebug=debug
PlugStackConfig=%[1]s/plugstack.conf
`, d)
	for k := 0; k < jobNodes; k++ {
		fmt.Fprintf(&b, "NodeName=node%d NodeAddr=10.77.0.%d %s State=UNKNOWN\n", k, k+1, strings.Join(hw, " "))
	}
	fmt.Fprintf(&b, "PartitionName=rig Nodes=node[0-%d] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n", jobNodes-1)
	return b.String()
}

// run runs a Slurm client on node0 and returns its combined output.
func (c *slurmCluster) run(ctx context.Context, argv ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(os.Getenv("MPIPAUSE_BIN"), "rig"), append([]string{"exec", "node0", "--"}, argv...)...)
	cmd.Env = append(os.Environ(), c.env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// must is run that fails the test on error.
func (c *slurmCluster) must(ctx context.Context, t *testing.T, argv ...string) string {
	t.Helper()
	out, err := c.run(ctx, argv...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// srun starts srun on node0 with args (in the test's cgroup: srun is the
// user's command, not part of the job) and returns it.
func (c *slurmCluster) srun(ctx context.Context, t *testing.T, args ...string) *proc {
	t.Helper()
	return start(ctx, t, "", c.env, append([]string{filepath.Join(binDir(t), "rig"), "exec", "node0", "--", "srun"}, args...)...)
}

// stepLogTimes are the times each slurmd's log gives a line of step
// containing what (slurmstepd's own log lines, e.g. "Suspended StepId=7.0"),
// one per node that has one.
func (c *slurmCluster) stepLogTimes(t *testing.T, step, what string) []time.Time {
	t.Helper()
	var out []time.Time
	for k := 0; k < jobNodes; k++ {
		f, err := os.Open(filepath.Join(c.dir, "log", fmt.Sprintf("slurmd-node%d.log", k)))
		if err != nil {
			continue
		}
		s := bufio.NewScanner(f)
		for s.Scan() {
			m := slurmLogRE.FindStringSubmatch(s.Text())
			if m == nil || m[2] != step || !strings.Contains(m[3], what) {
				continue
			}
			if at, err := time.ParseInLocation("2006-01-02T15:04:05.000", m[1], time.Local); err == nil {
				out = append(out, at)
			}
		}
		f.Close()
	}
	return out
}

// slurmLogRE is a slurmstepd line of a slurmd log: time, step, text.
var slurmLogRE = regexp.MustCompile(`^\[([0-9T:.-]+)\] \[([0-9.]+)\] (.*)$`)

// removeCgroupTree kills whatever is left in dir or below it (a step's
// ranks that outlived slurmd) and removes dir with the cgroups mpid placed
// them in.
func removeCgroupTree(t *testing.T, dir string) {
	testutil.KillTree(dir)
	subs, _ := filepath.Glob(filepath.Join(dir, "*", "cgroup.procs"))
	for _, s := range subs {
		if err := cgroupv2.RemoveEmpty(filepath.Dir(s)); err != nil {
			t.Error(err)
		}
	}
	if err := cgroupv2.RemoveEmpty(dir); err != nil {
		t.Error(err)
	}
}
