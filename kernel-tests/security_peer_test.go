package kerneltests

// The security table's rows for the peer port (TCP 7170, mpid to mpid):
// the attacks from the network by someone without the cluster key
// (H2, L3), and a node's name resolving to another member of the cluster
// (H5). Like the other rows, each is judged on node0's mpid and on the
// job, never on the attacker's error text, and has a positive control.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/mpid"
	"github.com/mpipause/mpipause/kernel-tests/internal/rig"
	"github.com/mpipause/mpipause/loader"
)

// node0Peer is node0's peer port as the other nodes dial it.
var node0Peer = fmt.Sprintf("addr=node0:%d", mpid.DefaultPeerPort)

// peerJob is a 3 x 2 MPICH job of root's on node0..node2, coordinated by
// node0 (the other nodes register with it through its peer port, and its
// pauses reach them through theirs), running until killed, with a kernel
// reader of the test's own that counts what the job sends.
type peerJob struct {
	*faultJob
	obs loader.Observer
	cgs []string
}

func startPeerJob(ctx context.Context, t *testing.T, id string) *peerJob {
	t.Helper()
	var lib mpiLib
	for _, l := range mpiLibs {
		if l.name == "mpich" {
			lib = l
		}
	}
	f := &faultJob{id: id, app: filepath.Join(binDir(t), "apps", "xchg."+lib.name), stop: t.TempDir()}
	f.args = []string{"-m", "a2a", "-s", "128K", "-t", "2000"}
	f.proc = runJob(ctx, t, lib, id, f.app, append(f.args, "-n", "1000000", "-E", f.stop)...)
	t.Cleanup(func() { f.kill(t) })
	obs, _ := rigReaders(ctx, t)
	waitProgress(ctx, t, obs, f.done, sentBytes(ctx, obs), 4<<20)
	j := &peerJob{faultJob: f, obs: obs, cgs: nodeJobCgroups(t, id)}
	j.waitNodes(ctx, t)
	return j
}

// waitNodes waits until node0, the coordinator, lists every node of the
// job as registered (its status names the nodes that registered ranks
// with it; a restarted coordinator learns them back within 10 s) and calls
// the job pausable (a restarted mpid's ranks have registered again).
func (j *peerJob) waitNodes(ctx context.Context, t *testing.T) {
	t.Helper()
	// Pausable too: after node0's mpid restarts, the job's record says six
	// ranks at once, but its ranks there must register again first.
	waitForWhy(t, "node1 and node2 to register job "+j.id+" with node0, and its ranks on node0 with node0's mpid", time.Minute, j.done, func() (bool, string) {
		v, r := jobJSON(ctx, t, "status", j.id)
		if r.code != 0 || v.Ranks != 6 || !slices.Equal(v.Nodes, []string{"node0", "node1", "node2"}) || v.Unpausable != "" {
			return false, fmt.Sprintf("node0: exit %d, %d ranks, nodes %v, unpausable %q", r.code, v.Ranks, v.Nodes, v.Unpausable)
		}
		return true, ""
	})
}

// frozenNodes names the nodes whose job cgroup the kernel says is frozen.
func (j *peerJob) frozenNodes() []string {
	var out []string
	for k, cg := range j.cgs {
		if f, err := cgroupv2.Frozen(cg); err == nil && f {
			out = append(out, fmt.Sprintf("node%d", k))
		}
	}
	return out
}

// thaw thaws what a pause that should not have committed left frozen.
func (j *peerJob) thaw() {
	for _, cg := range j.cgs {
		os.WriteFile(filepath.Join(cg, "cgroup.freeze"), []byte("0"), 0)
	}
}

// pauseResume is the positive control: root's pause from node0 commits with
// every node's job cgroup frozen, and the resume succeeds.
func (j *peerJob) pauseResume(ctx context.Context, t *testing.T) (bool, string) {
	t.Helper()
	start := time.Now()
	r := cli(ctx, t, "node0", nil, "pause", j.id)
	took := time.Since(start)
	fr := j.frozenNodes()
	rr := cli(ctx, t, "node0", nil, "resume", j.id)
	ok := r.code == 0 && len(fr) == len(j.cgs) && rr.code == 0
	msg := fmt.Sprintf("a 3-node job's pause exit %d in %v, frozen %v, resume exit %d", r.code, took.Round(time.Millisecond), fr, rr.code)
	if !ok {
		msg += ": " + oneLineOf(r.stderr+" "+rr.stderr)
	}
	return ok, msg
}

// restartMPID stops node k's mpid and starts a new one.
func restartMPID(t *testing.T, k int) {
	t.Helper()
	stopRigMPIDs(t, k)
	if _, err := startRigMPIDs(t); err != nil {
		t.Fatal(err)
	}
}

// peerGroup is one "group" line of the peerflood stand-in.
type peerGroup struct{ dialled, closed, maxMs int }

func (g peerGroup) String() string {
	if g.closed == 0 {
		return fmt.Sprintf("0/%d", g.dialled)
	}
	return fmt.Sprintf("%d/%d (longest open %.1f s)", g.closed, g.dialled, float64(g.maxMs)/1000)
}

// H2: strangers on the network make node0's mpid buffer what they announce
// before any proof of the key, and hold connections that prove nothing.
func secH2(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	const (
		big, silent, hellos = 20, 10, 10
		frameMiB, sendMiB   = 64, 60
		// A connection is watched this long from its connect: past the
		// ~10 s a handshake may take, short of today's 2 min idle wait.
		watch = 15
	)
	pid := statusOf(t, jobRig).Nodes[0].MPIDPid
	rss0 := statusKB(pid, "VmRSS")
	peak := rss0
	stop, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			peak = max(peak, statusKB(pid, "VmRSS"))
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	s := e.attacker(ctx, t, "node1", "peerflood", node0Peer, fmt.Sprintf("big=%d", big), fmt.Sprintf("frame=%d", frameMiB),
		fmt.Sprintf("mib=%d", sendMiB), fmt.Sprintf("silent=%d", silent), fmt.Sprintf("hellos=%d", hellos), fmt.Sprintf("wait=%d", watch))
	s.wait(t, "flooded", 2*time.Minute)
	close(stop)
	<-sampled
	g := map[string]peerGroup{}
	for _, l := range strings.Split(s.out.String(), "\n") {
		var name string
		var pg peerGroup
		if n, _ := fmt.Sscanf(l, "group %s dialled=%d closed=%d max_ms=%d", &name, &pg.dialled, &pg.closed, &pg.maxMs); n == 4 {
			g[name] = pg
		}
	}
	var sent int64
	fmt.Sscanf(s.wait(t, "sent ", time.Second), "sent %d", &sent)
	// Refused: mpid's memory does not follow what strangers announce, it
	// drops a stream of garbage at once (5 s: time to notice, not to
	// take 60 MiB) and a silent or unproven peer within the ~10 s a
	// handshake may take.
	closedWithin := func(pg peerGroup, n int, ms int) bool { return pg.dialled == n && pg.closed == n && pg.maxMs <= ms }
	grew := (peak - rss0) / 1024
	row.refused = grew < 64 && closedWithin(g["big"], big, 5000) &&
		closedWithin(g["silent"], silent, 12000) && closedWithin(g["hellos"], hellos, 12000)
	row.outcome = fmt.Sprintf("node0's mpid RSS %d -> %d MiB at the peak (+%d) with %d MiB of the frames sent; closed by mpid within %d s: frames %v, silent %v, after a plain hello %v",
		rss0/1024, peak/1024, grew, sent>>20, watch, g["big"], g["silent"], g["hellos"])
	if grew >= 64 {
		// Later rows measure this mpid's memory: give them one of
		// ordinary size.
		restartMPID(t, 0)
	}
	// Control: the attack reached the port, and the port still serves the
	// cluster: node1 and node2 register a new job through it, and a pause
	// of that job commits.
	j := startPeerJob(ctx, t, name("h2"))
	ok, msg := j.pauseResume(ctx, t)
	reached := g["big"].dialled == big && g["silent"].dialled == silent && g["hellos"].dialled == hellos
	row.controlOK = ok && reached
	row.control = fmt.Sprintf("all %d connections reached node0's peer port: %v; %s", big+silent+hellos, reached, msg)
}

// H5: node0's name for node1 resolves to node2's address, as DNS or ARP
// spoofing would make it. A pause of a job on node0..node2 must fail,
// naming node1, and leave nothing frozen or gated.
func secH5(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	hosts := runInNode(ctx, t, "node0", nil, "cat", "/etc/hosts")
	if hosts.code != 0 {
		t.Fatalf("node0's /etc/hosts: %s", hosts.stderr)
	}
	addr := map[string]string{}
	for _, l := range strings.Split(hosts.stdout, "\n") {
		if f := strings.Fields(l); len(f) >= 2 && !strings.HasPrefix(f[0], "#") {
			for _, n := range f[1:] {
				addr[n] = f[0]
			}
		}
	}
	if addr["node1"] == "" || addr["node2"] == "" {
		t.Fatalf("node0's /etc/hosts names no node1 or node2:\n%s", hosts.stdout)
	}
	var b strings.Builder
	for _, l := range strings.SplitAfter(hosts.stdout, "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == addr["node1"] {
			l = strings.Replace(l, addr["node1"], addr["node2"], 1)
		}
		b.WriteString(l)
	}
	// mpid is restarted after each change: Go's resolver caches
	// /etc/hosts, and a pooled connection would outlive the change.
	restored := false
	restore := func() {
		writeInNode(ctx, t, "node0", "/etc/hosts", hosts.stdout)
		restartMPID(t, 0)
		restored = true
	}
	t.Cleanup(func() {
		if !restored {
			restore()
		}
	})
	writeInNode(ctx, t, "node0", "/etc/hosts", b.String())
	if r := runInNode(ctx, t, "node0", nil, "getent", "hosts", "node1"); !strings.HasPrefix(r.stdout, addr["node2"]+" ") {
		t.Fatalf("node0 resolves node1 to %q after the change, want node2's %s", r.stdout, addr["node2"])
	}
	restartMPID(t, 0)
	j := startPeerJob(ctx, t, name("h5"))

	start := time.Now()
	r := cli(ctx, t, "node0", nil, "pause", j.id)
	took := time.Since(start)
	said := oneLineOf(r.stdout + " " + r.stderr)
	if len(said) > 300 {
		said = said[:300] + "..."
	}
	if r.code == 0 {
		fr := j.frozenNodes()
		row.outcome = fmt.Sprintf("pause COMMITTED (exit 0 in %v) with node1's name on node2's address; frozen: %v (of node0..node2): %s",
			took.Round(time.Millisecond), fr, said)
		cli(ctx, t, "node0", nil, "resume", j.id)
		j.thaw()
	} else {
		// The nodes' own rollbacks (leases) may still be under way.
		thawed := within(30*time.Second, func() bool { return len(j.frozenNodes()) == 0 })
		// Every rank sends again (an a2a exchange needs all of them): no
		// gate was left closed.
		before := sentBytes(ctx, j.obs)
		sends := within(time.Minute, func() bool { return sentBytes(ctx, j.obs) >= before+4<<20 })
		named := strings.Contains(said, "node1") && strings.Contains(said, "node2")
		row.refused = thawed && sends && named
		row.outcome = fmt.Sprintf("pause exit %d in %v, names node1 and node2: %v, all thawed: %v (frozen %v), job sends again: %v: %s",
			r.code, took.Round(time.Millisecond), named, thawed, j.frozenNodes(), sends, said)
	}

	// Control: with node0's hosts file as the rig wrote it, the same
	// pause commits.
	restore()
	j.waitNodes(ctx, t)
	row.controlOK, row.control = j.pauseResume(ctx, t)
	row.control = "node0's hosts restored: " + row.control
}

// writeInNode writes content over path as node sees it, in place: a node's
// /etc/hosts is a bind mount of the file `rig up` first wrote, which the
// rename of a later up does not reach.
func writeInNode(ctx context.Context, t *testing.T, node, path, content string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir(t), "rig"), "exec", node, "--", "sh", "-c", `cat > "$1"`, "sh", path)
	cmd.Env = append(os.Environ(), "MPIPAUSE_RIG="+jobRig)
	cmd.Stdin = strings.NewReader(content)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("writing %s in %s: %v: %s", path, node, err, out)
	}
}

// L3: a burst of keyless connections that each fail authentication must
// not write a log line each (journald's rate limit would then drop the
// lines that matter).
func secL3(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	const n = 2000
	log := mpidLog(0)
	off := fileSize(log)
	s := e.attacker(ctx, t, "node1", "peerspam", node0Peer, fmt.Sprintf("n=%d", n), "par=32")
	res := s.wait(t, "spammed ", 2*time.Minute)
	var connected, answered, handshakes, ms int
	fmt.Sscanf(res, "spammed n=%d connected=%d answered=%d tls=%d ms=%d", new(int), &connected, &answered, &handshakes, &ms)
	// The lines of the burst, once mpid has written them: until the log
	// has not grown for half a second (5 s at most).
	size, since := fileSize(log), time.Now()
	within(5*time.Second, func() bool {
		if now := fileSize(log); now != size {
			size, since = now, time.Now()
		}
		return time.Since(since) >= 500*time.Millisecond
	})
	lines := peerLines(t, log, off)
	row.refused = len(lines) < 20
	sample := ""
	if len(lines) > 0 {
		sample = ", e.g. " + lines[0]
	}
	row.outcome = fmt.Sprintf("%d connections in %d ms (%d accepted; %d plain hellos answered, %d TLS handshakes done): %d lines about peers in node0's mpid log%s",
		n, ms, connected, answered, handshakes, len(lines), sample)
	// Control: the connections reached mpid, which noticed them: a line
	// about them within the interval a rate limit holds its count back.
	noticed := within(11*time.Second, func() bool { return len(peerLines(t, log, off)) > 0 })
	row.controlOK = connected == n && noticed
	row.control = fmt.Sprintf("%d of %d connections accepted, node0's mpid logged the refusals: %v", connected, n, noticed)
}

// peerLines are the lines of logSince about peers: those naming a peer, TLS
// or a handshake, or node1's address, where the stand-in runs (not, say,
// a previous row's job ending).
func peerLines(t *testing.T, path string, off int64) []string {
	t.Helper()
	r, err := rig.New(rig.Config{Name: jobRig})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range logSince(t, path, off) {
		low := strings.ToLower(l)
		if strings.Contains(low, "peer") || strings.Contains(low, "tls") || strings.Contains(low, "handshake") || strings.Contains(l, r.NodeAddr(1).String()) {
			out = append(out, l)
		}
	}
	return out
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// logSince is the complete lines path got past byte off.
func logSince(t *testing.T, path string, off int64) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(b)) < off {
		return nil
	}
	s := string(b[off:])
	if k := strings.LastIndexByte(s, '\n'); k >= 0 {
		return strings.Split(s[:k], "\n")
	}
	return nil
}
