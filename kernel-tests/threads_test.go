package kerneltests

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
	"github.com/mpipause/mpipause/loader"
)

// withMCA is lib (Open MPI's mpirun) with one MCA parameter set on its
// command line, under a name of its own.
func withMCA(lib mpiLib, name, param, value string) mpiLib {
	return withArgs(lib, name, "--mca", param, value)
}

// binName is the app suffix of a library variant ("openmpi-progress-thread"
// runs mt.openmpi).
func binName(lib mpiLib) string {
	name, _, _ := strings.Cut(lib.name, "-")
	return name
}

// rankThreads is, for every process of the job's cgroups, its pid and its
// number of threads: what the test saw of the ranks' threads, for the log.
func rankThreads(cgs []string) string {
	var out []string
	for _, cg := range cgs {
		pids, _ := cgroupv2.Procs(cg)
		for _, p := range pids {
			ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", p))
			comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", p))
			out = append(out, fmt.Sprintf("%s/%d:%s=%d", filepath.Base(filepath.Dir(cg)), p, strings.TrimSpace(string(comm)), len(ents)))
		}
	}
	return strings.Join(out, " ")
}

// pauseFailed says all the test can see of a pause that failed: the
// report, mpid's view of the job, the connections with bytes queued and
// the job's output so far; then fails the test.
func pauseFailed(ctx context.Context, t testing.TB, what string, r cliResult, id string, job *proc, obs loader.Observer) {
	t.Helper()
	st := cli(ctx, t, "node0", nil, "status", id)
	var queued string
	if cs, err := obs.Snapshot(ctx); err == nil {
		queued = fmt.Sprint(nonEmpty(cs))
	}
	t.Fatalf("%s: exit %d\nreport:\n%s%s\nstatus (exit %d):\n%s%s\nconnections with bytes queued now: %s\njob output:\n%s",
		what, r.code, r.stdout, r.stderr, st.code, st.stdout, st.stderr, queued, job.out.String())
}

// pauseCycle pauses job id with `mpipause pause --json`, checks the cut
// with the test's own kernel readers (checkPaused) and resumes it; it
// returns the pause's total time and the bytes in flight when its drain
// began.
func pauseCycle(ctx context.Context, t testing.TB, n int, id string, job *proc, cgs []string, obs, check loader.Observer) (ms, inflight float64) {
	t.Helper()
	what := fmt.Sprintf("pause %d", n)
	retrans := retransmits(ctx, obs)
	j, r := jobJSON(ctx, t, "pause", id)
	if r.code != 0 {
		pauseFailed(ctx, t, what, r, id, job, obs)
	}
	checkPaused(ctx, t, what, j, cgs, obs, check)
	if j.TotalMs > 100 {
		var ph []string
		for _, p := range j.Phases {
			ph = append(ph, fmt.Sprintf("%s %d rounds %.1f ms", p.Name, p.Rounds, p.Ms))
		}
		t.Logf("%s took %.1f ms (%d B in flight at the drain; %d TCP retransmissions during it): %s",
			what, j.TotalMs, j.DrainedBytes, retransmits(ctx, obs)-retrans, strings.Join(ph, ", "))
	}
	j2, r := jobJSON(ctx, t, "resume", id)
	if r.code != 0 || j2.State != ctl.StateRunning {
		t.Fatalf("resume %d: exit %d, state %q: %s\n%s", n, r.code, j2.State, r.stderr, job.out.String())
	}
	return j.TotalMs, float64(j.DrainedBytes)
}

// TestPauseThreadMultiple pauses and resumes, MPIPAUSE_MT_CYCLES (50) times
// at random moments, a 3 x 2 job of mt (kernel-tests/apps/mt.c): every rank
// runs MPI_THREAD_MULTIPLE with MPIPAUSE_MT_THREADS (4) threads that
// exchange irregular messages at once (rank r's threads 0 and 1 send to
// r+1 on one connection, thread 2 to r-1, against the direction of r-1's
// threads 0 and 1 on theirs, thread 3 to r+2; Isend/Irecv/Waitall and
// Sendrecv in turn), plus a Bcast per thread and iteration on
// communicators of their own. Open MPI runs twice: as is (its
// TCP BTL progressed by whichever application thread is in MPI) and with
// its TCP progress thread (btl_tcp_progress_thread=1, the one MCA switch of
// Open MPI 4.1.4 that starts a thread of its own reading and writing the
// rank's sockets; ompi_info says "OMPI progress: no" otherwise; with it each
// rank has 9 threads instead of 8, as the log line of the ranks shows); MPICH
// (ch4:ucx, built with thread support) grants MPI_THREAD_MULTIPLE as is.
// Every pause must commit and pass checkPaused; after each resume the job
// must send again before the next pause; then the job is told to stop and
// must print the checksum of the serial computation for as many iterations.
func TestPauseThreadMultiple(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { testPauseThreads(t, lib) })
		if lib.name == "openmpi" {
			pt := withMCA(lib, "openmpi-progress-thread", "btl_tcp_progress_thread", "1")
			t.Run(pt.name, func(t *testing.T) { testPauseThreads(t, pt) })
		}
	}
}

func testPauseThreads(t *testing.T, lib mpiLib) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	obs, check := rigReaders(ctx, t)

	id := fmt.Sprintf("mt-%s-%d", lib.name, os.Getpid())
	app := filepath.Join(bin, "apps", "mt."+binName(lib))
	stop := t.TempDir()
	args := []string{"-T", strconv.Itoa(envCount("MPIPAUSE_MT_THREADS", 4)), "-s", "64K"}
	job := runJob(ctx, t, lib, id, app, append(slices.Clone(args), "-n", "100000000", "-E", stop)...)
	cgs := nodeJobCgroups(t, id)
	// Whatever happens, the job must not stay frozen past the test.
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitFor(t, "mt to start its threads", 2*time.Minute, job.done, func() bool {
		return strings.Contains(job.out.String(), "mt: rank 0 runs")
	})
	waitProgress(ctx, t, obs, job.done, 0, 4<<20)
	t.Logf("ranks (node/pid:name=threads): %s", rankThreads(cgs))

	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 2))
	t.Logf("random moments from seed %d", seed)
	cycles := envCount("MPIPAUSE_MT_CYCLES", 50)
	var pauseMs, drainedKiB []float64
	for c := 1; c <= cycles; c++ {
		// A random moment of the exchange: 0 to 200 ms.
		time.Sleep(time.Duration(rng.IntN(200)) * time.Millisecond)
		ms, b := pauseCycle(ctx, t, c, id, job, cgs, obs, check)
		pauseMs, drainedKiB = append(pauseMs, ms), append(drainedKiB, b/1024)
		// The threads must exchange again: a lost or stuck byte
		// would stop a ring, and pausing a stalled job proves nothing.
		waitProgress(ctx, t, obs, job.done, sentBytes(ctx, obs), 1<<20)
	}

	iters := job.stopped(ctx, t, stop)
	job.finish(ctx, t, fmt.Sprintf("mt paused %d times", cycles), serial(t, app, 6, append(slices.Clone(args), "-n", iters)...))
	t.Logf("%s: %d pauses of %s threads per rank: pause p50 %.1f ms, max %.1f ms; in flight at the drain p50 %.0f KiB, max %.0f KiB; %s iterations; every COMMIT verified empty by BPF and sock_diag and frozen; output unchanged",
		lib.name, cycles, args[1], bench.Percentile(pauseMs, 0.5), bench.Percentile(pauseMs, 1),
		bench.Percentile(drainedKiB, 0.5), bench.Percentile(drainedKiB, 1), iters)
}

// TestPauseBlockedRecv: rank 0 blocks in MPI_Recv for a message that the
// last rank sends only after the pauses (xchg -R): the last rank waits
// outside MPI, its peers' messages of that iteration (sent once it waits)
// wait unread for it, and the other ranks wait in MPI_Waitall. The first
// pause's drain moves those bytes into the last rank's shim, where they
// stay across the later pauses and resumes until it reads them. The job is paused and resumed
// MPIPAUSE_BLOCKED_CYCLES (50) times while rank 0 stays blocked; every
// pause must commit and pass checkPaused. Then the test lets the last rank
// send, and the job must end with the output of an unpaused run.
func TestPauseBlockedRecv(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) {
			bin := binDir(t)
			sharedRig(t)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			obs, check := rigReaders(ctx, t)
			id := fmt.Sprintf("blocked-%s-%d", lib.name, os.Getpid())
			app := filepath.Join(bin, "apps", "xchg."+lib.name)
			dir := t.TempDir()
			args := []string{"-m", "a2a", "-n", "40", "-s", "256K", "-R", dir}
			job := runJob(ctx, t, lib, id, app, args...)
			cgs := nodeJobCgroups(t, id)
			defer cli(context.Background(), t, "node0", nil, "resume", id)
			waitFor(t, "rank 0 in MPI_Recv and the last rank waiting to send", 2*time.Minute, job.done, func() bool {
				out := job.out.String()
				return strings.Contains(out, "rank 0 waits in MPI_Recv") && strings.Contains(out, "sends to rank 0 once")
			})
			// The middle iteration's messages to the last rank wait
			// unread for it: without the drain no pause could commit.
			waitFor(t, "bytes waiting, unread, for the last rank", time.Minute, job.done, func() bool {
				return stuckUnread(ctx, t, obs)
			})

			seed := uint64(time.Now().UnixNano())
			rng := rand.New(rand.NewPCG(seed, 3))
			t.Logf("random moments from seed %d", seed)
			cycles := envCount("MPIPAUSE_BLOCKED_CYCLES", 50)
			var pauseMs, drained []float64
			for c := 1; c <= cycles; c++ {
				time.Sleep(time.Duration(rng.IntN(100)) * time.Millisecond)
				ms, b := pauseCycle(ctx, t, c, id, job, cgs, obs, check)
				pauseMs, drained = append(pauseMs, ms), append(drained, b)
				if out := job.out.String(); strings.Contains(out, "got the late message") {
					t.Fatalf("after pause %d rank 0 got a message that was never sent:\n%s", c, out)
				}
			}
			if err := os.WriteFile(filepath.Join(dir, "send"), nil, 0o644); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "rank 0 to get the late message", 2*time.Minute, job.done, func() bool {
				return strings.Contains(job.out.String(), "rank 0 got the late message")
			})
			job.finish(ctx, t, fmt.Sprintf("the job paused %d times with rank 0 in MPI_Recv", cycles), serial(t, app, 6, args...))
			t.Logf("%s: %d pauses with rank 0 blocked in MPI_Recv: pause p50 %.1f ms, max %.1f ms; in flight at the drain p50 %.0f B, max %.0f B; every COMMIT verified empty by BPF and sock_diag and frozen; output unchanged",
				lib.name, cycles, bench.Percentile(pauseMs, 0.5), bench.Percentile(pauseMs, 1),
				bench.Percentile(drained, 0.5), bench.Percentile(drained, 1))
		})
	}
}
