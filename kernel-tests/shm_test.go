package kerneltests

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
)

// TestPauseSharedMemory: Open MPI with its shared-memory transport (vader)
// between the two ranks of each node and TCP between nodes, paused and
// resumed MPIPAUSE_SHM_CYCLES (20) times at random moments of an
// all-to-all exchange. What a pause guarantees for the bytes that do not
// cross TCP: a message between ranks of one node is in the ranks' shared
// segment, which the freeze keeps with the processes, so it is delivered
// after the resume, once and in order. The test first shows that no two
// ranks of one node are connected over TCP (their traffic is the segment's),
// while ranks of different nodes are; then the job must end with the
// output of an unpaused run.
func TestPauseSharedMemory(t *testing.T) {
	lib := withMCA(mpiLibs[0], "openmpi-vader", "btl", "vader,tcp,self")
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	obs, check := rigReaders(ctx, t)

	id := fmt.Sprintf("shm-%d", os.Getpid())
	app := filepath.Join(bin, "apps", "xchg.openmpi")
	stop := t.TempDir()
	args := []string{"-m", "a2a", "-s", "64K"}
	job := runJob(ctx, t, lib, id, app, append(slices.Clone(args), "-n", "100000000", "-E", stop)...)
	cgs := nodeJobCgroups(t, id)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitProgress(ctx, t, obs, job.done, 0, 4<<20)

	same, across := rankLinks(t, "xchg.openmpi")
	if same > 0 || across == 0 {
		t.Fatalf("TCP connections between ranks: %d within a node, %d across nodes; want none within a node (shared memory) and some across", same, across)
	}

	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 5))
	t.Logf("random moments from seed %d", seed)
	cycles := envCount("MPIPAUSE_SHM_CYCLES", 20)
	var pauseMs []float64
	for c := 1; c <= cycles; c++ {
		time.Sleep(time.Duration(rng.IntN(100)) * time.Millisecond)
		ms, _ := pauseCycle(ctx, t, c, id, job, cgs, obs, check)
		pauseMs = append(pauseMs, ms)
		waitProgress(ctx, t, obs, job.done, sentBytes(ctx, obs), 1<<20)
	}
	iters := job.stopped(ctx, t, stop)
	job.finish(ctx, t, fmt.Sprintf("the job paused %d times", cycles), serial(t, app, 6, append(slices.Clone(args), "-n", iters)...))
	t.Logf("%d pauses with ranks of one node over shared memory: pause p50 %.1f ms, max %.1f ms; %s iterations; every COMMIT verified empty and frozen; output unchanged",
		cycles, bench.Percentile(pauseMs, 0.5), bench.Percentile(pauseMs, 1), iters)
}

// rankLinks counts the rig's established TCP connections between two
// processes named comm: those whose ends are on one node, and those across
// nodes (each connection once).
func rankLinks(t *testing.T, comm string) (same, across int) {
	t.Helper()
	type end struct {
		node int
		ap   netip.AddrPort
	}
	owned := map[netip.AddrPort]int{} // a rank's local end -> its node
	var conns [][2]end
	for i := 0; i < jobNodes; i++ {
		out := mustRig(t, jobRig, "exec", fmt.Sprintf("node%d", i), "--", "ss", "-tnpH", "state", "established")
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(l)
			if len(f) < 5 || !strings.Contains(l, `"`+comm+`"`) {
				continue
			}
			local, err1 := netip.ParseAddrPort(f[2])
			remote, err2 := netip.ParseAddrPort(f[3])
			if err1 != nil || err2 != nil {
				t.Fatalf("ss line %q: %v %v", l, err1, err2)
			}
			local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
			remote = netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port())
			owned[local] = i
			conns = append(conns, [2]end{{i, local}, {-1, remote}})
		}
	}
	for _, c := range conns {
		n, ok := owned[c[1].ap]
		if !ok || c[0].ap.String() > c[1].ap.String() {
			continue // not to a rank, or counted from its other end
		}
		if n == c[0].node {
			same++
		} else {
			across++
		}
	}
	return same, across
}
