package kerneltests

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
)

// mpiLib is how one MPI library launches xchg with 2 ranks on each of the 3
// nodes.
type mpiLib struct {
	name   string
	launch func(app string, args ...string) []string
}

var mpiLibs = []mpiLib{
	{name: "openmpi", launch: func(app string, args ...string) []string {
		return append([]string{"mpirun.openmpi", "-np", "6", "-H", "node0:2,node1:2,node2:2", app}, args...)
	}},
	// With UCX_TLS=tcp,self (the rig's) UCX connects ranks of one node
	// over TCP too, and each rank to itself.
	{name: "mpich", launch: func(app string, args ...string) []string {
		return append([]string{"mpiexec.mpich", "-n", "6", "-hosts", "node0:2,node1:2,node2:2", app}, args...)
	}},
}

// TestMPIJobConnections runs a real 3 nodes x 2 ranks job of each library on
// the rig, holds it once every connection is up, and checks that both
// observers report every rank-to-rank connection that `ss` sees in the
// nodes, and nothing outside the job; then lets the job finish and checks
// its result and that the closed connections are gone.
func TestMPIJobConnections(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { testJob(t, lib) })
	}
}

func testJob(t *testing.T, lib mpiLib) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	cg := testutil.NewCgroup(t)

	// Observers first, so the BPF one sees every connection from its start.
	bpfObs, err := loader.Open(ctx, loader.Config{Cgroup: cg, FollowJob: true, Require: loader.KindBPF})
	if err != nil {
		t.Fatalf("BPF observer: %v", err)
	}
	defer bpfObs.Close()
	diagObs, err := loader.Open(ctx, loader.Config{Cgroup: cg, FollowJob: true, Require: loader.KindSockDiag})
	if err != nil {
		t.Fatalf("sock_diag observer: %v", err)
	}
	defer diagObs.Close()

	hold := t.TempDir()
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	args := []string{"-m", "a2a", "-n", "30", "-s", "256K", "-w", hold}
	// The launcher starts inside the job cgroup; its ranks on every node
	// descend from it and inherit it.
	job := startJob(ctx, t, lib, cg, app, nil, args...)
	atHold(t, hold, 6, job)

	truth := ssJob(t, cg)
	for _, obs := range []loader.Observer{bpfObs, diagObs} {
		conns, err := obs.Snapshot(ctx)
		if err != nil {
			t.Fatalf("%s snapshot: %v", obs.Kind(), err)
		}
		checkSnapshot(t, obs.Kind(), truth, conns)
	}

	release(t, hold)
	job.finish(ctx, t, "the job", serial(t, app, 6, args[:6]...))

	// Every process of the job is gone, so is every established connection.
	for _, obs := range []loader.Observer{bpfObs, diagObs} {
		conns, err := obs.Snapshot(ctx)
		if err != nil {
			t.Fatalf("%s snapshot after the job: %v", obs.Kind(), err)
		}
		for _, c := range conns {
			if c.State == loader.StateEstablished {
				t.Errorf("%s: %v->%v still established after the job ended", obs.Kind(), c.Local, c.Remote)
			}
		}
	}
}

var checksumRE = regexp.MustCompile(`checksum=[0-9a-f]+`)

func checksum(s string) string { return checksumRE.FindString(s) }

// sock is one established TCP socket that ss saw in a node.
type sock struct {
	node          int
	local, remote netip.AddrPort
	pids          []int
	rank          bool // owned by an xchg process
	job           bool // owned by a process of the job cgroup
}

var ssPid = regexp.MustCompile(`pid=(\d+)`)

// ssJob is the ground truth: every established TCP socket in every node as
// `ss` reports it, with its owners.
func ssJob(t *testing.T, cg string) []sock {
	t.Helper()
	inJob := map[int]bool{}
	ids, err := cgroupv2.TreeIDs(cg)
	if err != nil || len(ids) == 0 {
		t.Fatalf("cgroup %s: %v", cg, err)
	}
	procs, err := cgroupv2.Procs(cg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		inJob[p] = true
	}
	var socks []sock
	for i := 0; i < jobNodes; i++ {
		out := mustRig(t, jobRig, "exec", fmt.Sprintf("node%d", i), "--", "ss", "-tnpH", "state", "established")
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(l)
			if len(f) < 5 {
				continue
			}
			s := sock{node: i, rank: strings.Contains(l, `"xchg.`)}
			var err1, err2 error
			s.local, err1 = netip.ParseAddrPort(f[2])
			s.remote, err2 = netip.ParseAddrPort(f[3])
			if err1 != nil || err2 != nil {
				t.Fatalf("ss line %q: %v %v", l, err1, err2)
			}
			s.local = netip.AddrPortFrom(s.local.Addr().Unmap(), s.local.Port())
			s.remote = netip.AddrPortFrom(s.remote.Addr().Unmap(), s.remote.Port())
			for _, m := range ssPid.FindAllStringSubmatch(l, -1) {
				p, _ := strconv.Atoi(m[1])
				s.pids = append(s.pids, p)
				s.job = s.job || inJob[p]
			}
			socks = append(socks, s)
		}
	}
	return socks
}

type tuple struct{ local, remote netip.AddrPort }

func checkSnapshot(t *testing.T, kind string, truth []sock, conns []loader.Conn) {
	t.Helper()
	got := map[tuple]loader.Conn{}
	for _, c := range conns {
		got[tuple{unmap(c.Local), unmap(c.Remote)}] = c
	}
	// A rank-to-rank connection: both ends are rank sockets. Loopback
	// addresses repeat across nodes, so they are matched within a node.
	type end struct {
		node int
		ap   netip.AddrPort
	}
	rankEnd := map[end]sock{}
	for _, s := range truth {
		if s.rank {
			rankEnd[end{s.node, s.local}] = s
		}
	}
	nodeOf := func(s sock) int {
		if a := s.remote.Addr(); a.IsLoopback() || a == s.local.Addr() {
			return s.node
		}
		return int(s.remote.Addr().As4()[3]) - 1 // 10.77.0.(K+1) is nodeK
	}
	pairs := map[[2]int]bool{}
	n := 0
	for _, s := range truth {
		if s.job {
			if _, ok := got[tuple{s.local, s.remote}]; !ok && s.rank {
				t.Errorf("%s: rank socket %v->%v (node%d, pids %v) missing from the snapshot", kind, s.local, s.remote, s.node, s.pids)
			}
		}
		if !s.rank {
			continue
		}
		peer, ok := rankEnd[end{nodeOf(s), s.remote}]
		if !ok {
			continue // a rank's connection to its launcher
		}
		n++
		c, ok := got[tuple{s.local, s.remote}]
		if !ok {
			continue // reported above
		}
		if c.State != loader.StateEstablished {
			t.Errorf("%s: %v->%v is %v, ss says established", kind, s.local, s.remote, c.State)
		}
		a, b := s.pids[0], peer.pids[0]
		if a > b {
			a, b = b, a
		}
		if a != b {
			pairs[[2]int{a, b}] = true
		}
	}
	// Every socket reported belongs to the job, and the job's sockets are
	// all that is reported.
	jobTuples := map[tuple]bool{}
	for _, s := range truth {
		jobTuples[tuple{s.local, s.remote}] = s.job
	}
	for tu, c := range got {
		if c.State == loader.StateEstablished && !jobTuples[tu] {
			t.Errorf("%s: reports %v->%v, which ss does not show as a socket of the job", kind, tu.local, tu.remote)
		}
	}
	// a2a over TCP only: every pair of the 6 ranks has a connection.
	if len(pairs) != 15 {
		t.Errorf("%s: %d rank pairs connected over TCP, want 15 (%d rank-to-rank sockets seen)", kind, len(pairs), n)
	}
	t.Logf("%s: %d connections reported, %d rank-to-rank sockets, %d rank pairs", kind, len(conns), n, len(pairs))
}

func unmap(a netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(a.Addr().Unmap(), a.Port()) }
