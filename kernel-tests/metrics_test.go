package kerneltests

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/kernel-tests/internal/rig"
	"github.com/mpipause/mpipause/quiesce"
)

// rigMetricsAddr is where every mpid of the tests' rig serves its metrics,
// inside its node (each node has its own loopback).
const rigMetricsAddr = "127.0.0.1:9717"

// The shared rig's mpids serve metrics and log each operation's timeline,
// whichever test brings the rig up first (`rig up` reads this from its
// environment). Set before TestMain.
func init() {
	if os.Getenv(rig.MPIDArgsEnv) == "" {
		os.Setenv(rig.MPIDArgsEnv, "--metrics-listen "+rigMetricsAddr+" --log-timeline")
	}
}

// scrapeNode fetches /metrics from the mpid of rig node k, as a Prometheus
// inside the node would: the connection is made on a thread in the node's
// network namespace (a socket keeps the namespace it was made in). The
// tests' polling loops scrape faster than mpid answers (metrics.ScrapeRate):
// a scrape refused for the rate is made again a rate's interval later.
func scrapeNode(t testing.TB, k int) metrics.Samples {
	t.Helper()
	for range 100 {
		if s, ok := scrapeNodeOnce(t, k); ok {
			return s
		}
		time.Sleep(time.Duration(float64(time.Second) / float64(metrics.ScrapeRate)))
	}
	t.Fatalf("node%d: GET %s refused for its rate 100 times", k, metrics.Path)
	return nil
}

// scrapeNodeOnce is one scrape; false if mpid refused it for its rate.
func scrapeNodeOnce(t testing.TB, k int) (metrics.Samples, bool) {
	t.Helper()
	c, err := dialInNode(t, k, rigMetricsAddr)
	if err != nil {
		t.Fatalf("node%d: %v (does the rig's mpid run with %s=%q? `rig down` a rig left up without it)", k, err, rig.MPIDArgsEnv, os.Getenv(rig.MPIDArgsEnv))
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", metrics.Path, rigMetricsAddr)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("node%d: GET %s: %v", k, metrics.Path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusTooManyRequests {
		return nil, false
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("node%d: GET %s: %s", k, metrics.Path, resp.Status)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Errorf("node%d: Content-Type %q, want the text format", k, ct)
	}
	s, err := metrics.Parse(resp.Body)
	if err != nil {
		t.Fatalf("node%d: %v", k, err)
	}
	return s, true
}

func dialInNode(t testing.TB, k int, addr string) (c net.Conn, err error) {
	err = nodeNetns(t, k).Do(func() error {
		c, err = net.DialTimeout("tcp", addr, 5*time.Second)
		return err
	})
	return c, err
}

// moved is how much series moved between two scrapes.
func moved(before, after metrics.Samples, series string) float64 {
	return after[series] - before[series]
}

// TestMetricsScrape runs a real Open MPI job on the rig under `mpipause
// run`, scrapes the mpids of node0 (where `mpipause run` ran: the coordinator) and node1
// from inside their nodes, pauses and resumes the job, and checks that the
// metrics moved by what happened: one committed pause and one resume on the
// coordinator only, each phase's histogram once, the durations and bytes
// drained equal to what `mpipause --json` reported, every node's own steps
// and kernel snapshots, and the gates closed while paused and open again
// after. A resume of the running job is counted as refused.
func TestMetricsScrape(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	obs := jobObserver(ctx, t, rigCgroups)
	lib := mpiLibs[0]
	id := fmt.Sprintf("metrics-%d", os.Getpid())
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	job := runJob(ctx, t, lib, id, app, "-m", "a2a", "-n", "1000000", "-s", "256K")
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitProgress(ctx, t, obs, job.done, 0, 4<<20)

	nodes := []int{0, 1}
	before := map[int]metrics.Samples{}
	paused := map[int]metrics.Samples{}
	var resumed metrics.Samples
	committed := metrics.Series("mpipause_pauses_total", "outcome", metrics.Committed)
	resumedS := metrics.Series("mpipause_resumes_total", "outcome", metrics.Resumed)
	// Each stage measures from the scrapes of the one before: after a
	// failed one, the rest would only report its consequences.
	for _, stage := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"before any pause", func(t *testing.T) {
			for _, k := range nodes {
				// A rank registers (HELLO) from MPI_Init, and mpid takes it in
				// on its own time: traffic alone does not say every rank has.
				waitForWhy(t, fmt.Sprintf("node%d's 2 ranks to register", k), time.Minute, job.done, func() (bool, string) {
					before[k] = scrapeNode(t, k)
					v := before[k]["mpipause_ranks"]
					return v == 2, fmt.Sprintf("mpipause_ranks = %v", v)
				})
			}
			s := before[0]
			if v := s[metrics.Series("mpipause_jobs")]; v < 1 {
				t.Errorf("node0: mpipause_jobs = %v with a job running", v)
			}
			if v := s[metrics.Series("mpipause_closed_gates")]; v != 0 {
				t.Errorf("node0: mpipause_closed_gates = %v before any pause", v)
			}
		}},
		{"a committed pause", func(t *testing.T) {
			j, r := jobJSON(ctx, t, "pause", id)
			if r.code != 0 || j.State != ctl.StatePaused {
				t.Fatalf("pause: exit %d, state %q: %s", r.code, j.State, r.stderr)
			}
			for _, k := range nodes {
				paused[k] = scrapeNode(t, k)
			}
			b, p := before[0], paused[0]
			if d := moved(b, p, committed); d != 1 {
				t.Errorf("node0 (coordinator): pauses_total{committed} moved by %v, want 1", d)
			}
			if d := moved(before[1], paused[1], committed); d != 0 {
				t.Errorf("node1 (not the coordinator): pauses_total{committed} moved by %v, want 0: a pause counts where it is decided", d)
			}
			for _, o := range []string{metrics.RolledBack, metrics.Failed, metrics.Refused} {
				if d := moved(b, p, metrics.Series("mpipause_pauses_total", "outcome", o)); d != 0 {
					t.Errorf("node0: pauses_total{%s} moved by %v", o, d)
				}
			}
			for _, ph := range []string{"prepare", "drain", "freeze", "verify", "commit"} {
				if d := moved(b, p, metrics.Series("mpipause_pause_phase_duration_seconds_count", "phase", ph)); d != 1 {
					t.Errorf("node0: pause_phase_duration_seconds_count{phase=%q} moved by %v, want 1", ph, d)
				}
			}
			if d := moved(b, p, metrics.Series("mpipause_pause_duration_seconds_count", "outcome", metrics.Committed)); d != 1 {
				t.Errorf("node0: pause_duration_seconds_count{committed} moved by %v, want 1", d)
			}
			// The same measurement as mpipause's total_ms (rounded to µs there).
			if d := moved(b, p, metrics.Series("mpipause_pause_duration_seconds_sum", "outcome", metrics.Committed)); d*1000 < j.TotalMs-0.01 || d*1000 > j.TotalMs+0.01 {
				t.Errorf("node0: pause_duration_seconds_sum moved by %.6f s; mpipause reports total_ms %.3f", d, j.TotalMs)
			}
			if d := moved(b, p, metrics.Series("mpipause_pause_drained_bytes_count")); d != 1 {
				t.Errorf("node0: pause_drained_bytes_count moved by %v, want 1", d)
			}
			if d := moved(b, p, metrics.Series("mpipause_pause_drained_bytes_sum")); d != float64(j.DrainedBytes) {
				t.Errorf("node0: pause_drained_bytes_sum moved by %v; mpipause reports drained_bytes %d", d, j.DrainedBytes)
			}
			for _, k := range nodes {
				b, p := before[k], paused[k]
				for _, st := range []string{"prepare", "commit"} {
					if d := moved(b, p, metrics.Series("mpipause_node_step_duration_seconds_count", "step", st)); d != 1 {
						t.Errorf("node%d: node_step_duration_seconds_count{step=%q} moved by %v, want 1", k, st, d)
					}
				}
				// A VERIFY that finds bytes makes the pause drain, freeze and
				// verify again (rarely): at least once each.
				for _, st := range []string{"drain", "freeze", "verify"} {
					if d := moved(b, p, metrics.Series("mpipause_node_step_duration_seconds_count", "step", st)); d < 1 {
						t.Errorf("node%d: node_step_duration_seconds_count{step=%q} moved by %v, want at least 1", k, st, d)
					}
				}
				// A DRAIN check and VERIFY each take one.
				if d := moved(b, p, metrics.Series("mpipause_observer_snapshot_duration_seconds_count")); d < 2 {
					t.Errorf("node%d: observer_snapshot_duration_seconds_count moved by %v, want at least 2", k, d)
				}
				if v := p[metrics.Series("mpipause_closed_gates")]; v != 2 {
					t.Errorf("node%d: closed_gates = %v while paused, want its 2 ranks", k, v)
				}
				if _, ok := p[metrics.Series("mpipause_gate_violation_bytes_total")]; !ok {
					t.Errorf("node%d: no gate_violation_bytes_total", k)
				}
			}
			// --log-timeline: each node logged the pause's steps, in order.
			for _, k := range nodes {
				checkTimeline(t, k, id, "PREPARE", "COMMIT")
			}
			t.Logf("paused: %.3f ms, drained %d bytes; gated sockets node0 %v node1 %v, held bytes node0 %v node1 %v",
				j.TotalMs, j.DrainedBytes, paused[0]["mpipause_gated_sockets"], paused[1]["mpipause_gated_sockets"],
				paused[0]["mpipause_held_bytes"], paused[1]["mpipause_held_bytes"])
		}},
		{"the resume", func(t *testing.T) {
			j, r := jobJSON(ctx, t, "resume", id)
			if r.code != 0 || j.State != ctl.StateRunning {
				t.Fatalf("resume: exit %d, state %q: %s", r.code, j.State, r.stderr)
			}
			p := paused[0]
			resumed = scrapeNode(t, 0)
			if d := moved(p, resumed, resumedS); d != 1 {
				t.Errorf("node0: resumes_total{resumed} moved by %v, want 1", d)
			}
			if d := moved(p, resumed, metrics.Series("mpipause_resume_duration_seconds_count", "outcome", metrics.Resumed)); d != 1 {
				t.Errorf("node0: resume_duration_seconds_count{resumed} moved by %v, want 1", d)
			}
			if d := moved(p, resumed, metrics.Series("mpipause_resume_duration_seconds_sum", "outcome", metrics.Resumed)); d*1000 < j.TotalMs-0.01 || d*1000 > j.TotalMs+0.01 {
				t.Errorf("node0: resume_duration_seconds_sum moved by %.6f s; mpipause reports total_ms %.3f", d, j.TotalMs)
			}
			if d := moved(p, resumed, committed); d != 0 {
				t.Errorf("node0: pauses_total{committed} moved by %v on a resume", d)
			}
			// The shims flush what they held behind the reopen: the gauges reach 0
			// once they have.
			for _, k := range nodes {
				var last metrics.Samples
				waitForWhy(t, fmt.Sprintf("node%d's gates to open and flush", k), time.Minute, job.done, func() (bool, string) {
					last = scrapeNode(t, k)
					g, s, h := last["mpipause_closed_gates"], last["mpipause_gated_sockets"], last["mpipause_held_bytes"]
					return g == 0 && s == 0 && h == 0, fmt.Sprintf("closed_gates %v, gated_sockets %v, held_bytes %v", g, s, h)
				})
				if d := moved(paused[k], last, metrics.Series("mpipause_node_step_duration_seconds_count", "step", "open")); d != 1 {
					t.Errorf("node%d: node_step_duration_seconds_count{step=\"open\"} moved by %v after a resume, want 1", k, d)
				}
				checkTimeline(t, k, id, "THAW", "OPEN")
			}
		}},
		// The connections a pause's rounds take are kept warm for the
		// job's life: after longer quiet than a pooled connection may idle,
		// a pause and a resume dial none, on any node.
		{"a pause after quiet connects to nobody", func(t *testing.T) {
			quiet := quiesce.DefaultIdleTimeout + time.Second
			select {
			case <-time.After(quiet):
			case <-job.done:
				t.Fatalf("the job ended during %v of quiet", quiet)
			}
			all := []int{0, 1, 2}
			b := map[int]metrics.Samples{}
			for _, k := range all {
				b[k] = scrapeNode(t, k)
			}
			if j, r := jobJSON(ctx, t, "pause", id); r.code != 0 || j.State != ctl.StatePaused {
				t.Fatalf("pause: exit %d, state %q: %s", r.code, j.State, r.stderr)
			}
			if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
				t.Fatalf("resume: exit %d, state %q: %s", r.code, j.State, r.stderr)
			}
			for _, k := range all {
				if d := moved(b[k], scrapeNode(t, k), metrics.Series("mpipause_peer_dials_total")); d != 0 {
					t.Errorf("node%d: peer_dials_total moved by %v over a pause and a resume after %v of quiet, want 0: a round connected first", k, d, quiet)
				}
			}
			resumed = scrapeNode(t, 0)
		}},
		// Refused (exit 5), and counted so.
		{"resume of a running job", func(t *testing.T) {
			if _, r := jobJSON(ctx, t, "resume", id); r.code != 5 {
				t.Errorf("resume of a running job: exit %d, want 5: %s", r.code, r.stderr)
			}
			after := scrapeNode(t, 0)
			if d := moved(resumed, after, metrics.Series("mpipause_resumes_total", "outcome", metrics.Refused)); d != 1 {
				t.Errorf("node0: resumes_total{refused} moved by %v, want 1", d)
			}
			if d := moved(resumed, after, resumedS); d != 0 {
				t.Errorf("node0: resumes_total{resumed} moved by %v on a refused resume", d)
			}
			waitProgress(ctx, t, obs, job.done, sentBytes(ctx, obs), 4<<20)
		}},
	} {
		if !t.Run(stage.name, stage.run) {
			return
		}
	}
}

// TestMetricsRolledBack: a pause that cannot drain (a busy rank, the
// shims' receive-side drain off) rolls back after its --timeout, and the
// coordinator counts it as rolled_back, with its DRAIN and ABORT, and no
// bytes drained; every node thawed and reopened (its thaw and open steps),
// and its gates are open again.
func TestMetricsRolledBack(t *testing.T) {
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	id := fmt.Sprintf("metrics-rb-%d", os.Getpid())
	job := startUndrainedJob(ctx, t, mpiLibs[0], id)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	nodes := []int{0, 2} // the coordinator, and the busy rank's node
	before := map[int]metrics.Samples{}
	after := map[int]metrics.Samples{}
	var j ctl.Job
	if !t.Run("the pause rolls back", func(t *testing.T) {
		for _, k := range nodes {
			before[k] = scrapeNode(t, k)
		}
		var r cliResult
		j, r = jobJSON(ctx, t, "pause", id, "--timeout", "1s")
		if r.code != 1 || j.State != ctl.StateRunning {
			t.Fatalf("pause of a job with an undrained busy rank: exit %d, state %q; want exit 1, rolled back\n%s%s", r.code, j.State, r.stdout, r.stderr)
		}
		for _, k := range nodes {
			after[k] = scrapeNode(t, k)
		}
	}) {
		return
	}
	t.Run("the coordinator counts a rollback", func(t *testing.T) {
		b, a := before[0], after[0]
		for o, want := range map[string]float64{metrics.RolledBack: 1, metrics.Committed: 0, metrics.Failed: 0, metrics.Refused: 0} {
			if d := moved(b, a, metrics.Series("mpipause_pauses_total", "outcome", o)); d != want {
				t.Errorf("node0: pauses_total{%s} moved by %v, want %v", o, d, want)
			}
		}
		if d := moved(b, a, metrics.Series("mpipause_pause_duration_seconds_count", "outcome", metrics.RolledBack)); d != 1 {
			t.Errorf("node0: pause_duration_seconds_count{rolled_back} moved by %v, want 1", d)
		}
		if d := moved(b, a, metrics.Series("mpipause_pause_duration_seconds_sum", "outcome", metrics.RolledBack)); d*1000 < j.TotalMs-0.01 || d*1000 > j.TotalMs+0.01 {
			t.Errorf("node0: pause_duration_seconds_sum{rolled_back} moved by %.6f s; mpipause reports total_ms %.3f", d, j.TotalMs)
		}
		for ph, want := range map[string]float64{"prepare": 1, "drain": 1, "abort": 1, "freeze": 0, "verify": 0, "commit": 0} {
			if d := moved(b, a, metrics.Series("mpipause_pause_phase_duration_seconds_count", "phase", ph)); d != want {
				t.Errorf("node0: pause_phase_duration_seconds_count{phase=%q} moved by %v, want %v", ph, d, want)
			}
		}
		if d := moved(b, a, metrics.Series("mpipause_pause_drained_bytes_count")); d != 0 {
			t.Errorf("node0: pause_drained_bytes_count moved by %v for a pause that did not commit", d)
		}
	})
	t.Run("each node's steps, no freeze", func(t *testing.T) {
		for _, k := range nodes {
			for _, st := range []string{"prepare", "thaw", "open"} {
				if d := moved(before[k], after[k], metrics.Series("mpipause_node_step_duration_seconds_count", "step", st)); d < 1 {
					t.Errorf("node%d: node_step_duration_seconds_count{step=%q} moved by %v, want at least 1", k, st, d)
				}
			}
			if d := moved(before[k], after[k], metrics.Series("mpipause_node_step_duration_seconds_count", "step", "freeze")); d != 0 {
				t.Errorf("node%d: a freeze step counted for a pause that never froze (moved by %v)", k, d)
			}
		}
	})
	t.Run("the gates open and the job runs on", func(t *testing.T) {
		for _, k := range nodes {
			waitForWhy(t, fmt.Sprintf("node%d's gates to open", k), time.Minute, job.done, func() (bool, string) {
				v := scrapeNode(t, k)["mpipause_closed_gates"]
				return v == 0, fmt.Sprintf("closed_gates %v", v)
			})
		}
		job.end(ctx, t, "the job after a rolled-back pause")
	})
}

// listening returns the TCP ports that listen in pid's network namespace,
// with their local addresses (/proc/PID/net/tcp{,6}, state 0A).
func listening(t testing.TB, pid int) []string {
	t.Helper()
	var out []string
	for _, f := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, f))
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(l)
			if len(fs) < 4 || fs[3] != "0A" {
				continue
			}
			out = append(out, f+" "+fs[1])
		}
	}
	slices.Sort(out)
	return out
}

// TestMetricsOffByDefault starts mpid alone in a fresh network namespace:
// without --metrics-listen nothing but the peer port listens; with a
// loopback address the metrics listen there only, and 0.0.0.0 must be
// written to get every interface. A bare ":PORT" is refused with one line
// and exit 2, before anything starts.
func TestMetricsOffByDefault(t *testing.T) {
	bin := binDir(t)
	mpidBin := filepath.Join(bin, "mpid")
	t.Run("a bare :PORT refused", func(t *testing.T) {
		out, err := exec.Command(mpidBin, "--metrics-listen", ":9717").CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || strings.Count(strings.TrimSpace(string(out)), "\n") != 0 ||
			!strings.Contains(string(out), "no host; write 127.0.0.1:9717 for this node only, or 0.0.0.0:9717") {
			t.Errorf("mpid --metrics-listen :9717: %v, output %q; want exit 2 and one line saying to write the host", err, out)
		}
	})

	root, err := cgroupv2.Root()
	if err != nil {
		t.Fatal(err)
	}
	// --cgroup-parent is relative to the v2 mount.
	parent, err := filepath.Rel(root, testutil.NewCgroup(t))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	key := filepath.Join(dir, "cluster.key")
	if out, err := exec.Command(mpidBin, "keygen", key).CombinedOutput(); err != nil {
		t.Fatalf("mpid keygen: %v %s", err, out)
	}
	// Port 7170 is 00001C02 in /proc/net/tcp; 9717 is 25F5.
	for _, tc := range []struct {
		name  string
		extra []string
		want  []string
	}{
		{"default", nil, []string{"tcp6 00000000000000000000000000000000:1C02"}},
		{"loopback", []string{"--metrics-listen", "127.0.0.1:9717"}, []string{"tcp 0100007F:25F5", "tcp6 00000000000000000000000000000000:1C02"}},
		// Go listens on 0.0.0.0 as on [::], dual-stack: every interface.
		{"every interface", []string{"--metrics-listen", "0.0.0.0:9717"}, []string{"tcp6 00000000000000000000000000000000:1C02", "tcp6 00000000000000000000000000000000:25F5"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ready := filepath.Join(dir, "ready")
			args := append([]string{"-n", mpidBin, "--node", "solo", "--cgroup-parent", parent, "--cluster-key", key,
				"--state-dir", filepath.Join(dir, "state"), "--ready-file", ready}, tc.extra...)
			cmd := exec.Command("unshare", args...)
			var log testutil.Buffer
			cmd.Stdout, cmd.Stderr = &log, &log
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			defer func() {
				cmd.Process.Signal(syscall.SIGTERM)
				select {
				case <-done:
				case <-time.After(10 * time.Second):
					cmd.Process.Kill()
					<-done
				}
			}()
			waitFor(t, "mpid's ready file", 30*time.Second, done, func() bool { _, err := os.Stat(ready); return err == nil })
			if got := listening(t, cmd.Process.Pid); !slices.Equal(got, tc.want) {
				t.Errorf("listening in mpid's netns: %v, want %v\n%s", got, tc.want, log.String())
			}
		})
	}
}

// checkTimeline: node k's mpid logged, as its last step timeline of job id,
// one that starts with step first and ends with step last, every event
// WHAT@MS[+MS][ NOTE] (node.Timelines).
func checkTimeline(t *testing.T, k int, id, first, last string) {
	t.Helper()
	var line string
	for _, l := range strings.Split(lastRunLog(t, k), "\n") {
		if strings.Contains(l, `msg="step timeline"`) && strings.Contains(l, ":"+id+" ") {
			line = l
		}
	}
	ev := regexp.MustCompile(`events="([^"]*)"`).FindStringSubmatch(line)
	if ev == nil {
		t.Errorf("node%d: no step timeline of job %s in mpid's log (does the rig's mpid run with %s=%q? `rig down` a rig left up without it)", k, id, rig.MPIDArgsEnv, os.Getenv(rig.MPIDArgsEnv))
		return
	}
	events := strings.Split(ev[1], "; ")
	step := regexp.MustCompile(`^([A-Z]+|answer)@[0-9.]+(\+[0-9.]+)?( .*)?$`)
	for _, e := range events {
		if !step.MatchString(e) {
			t.Errorf("node%d: timeline event %q is not WHAT@MS[+MS][ NOTE]: %s", k, e, line)
		}
	}
	if !strings.HasPrefix(events[0], first+"@") || !strings.HasPrefix(events[len(events)-1], last+"@") {
		t.Errorf("node%d: the timeline of job %s runs from %q to %q, want %s to %s: %s", k, id, events[0], events[len(events)-1], first, last, line)
	}
}
