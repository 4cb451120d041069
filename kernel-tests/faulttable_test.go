package kerneltests

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/loader"
)

// failpointRoot is where the shared rig's mpids, the test build
// bin/test/mpid, look for failpoints (internal/node/failpoints.go): TestMain
// puts it in the environment `rig up` hands them. Not under /run/mpipause,
// which each node has of its own.
var failpointRoot = "/run/mpipause-failpoints-" + jobRig

// armFailpoint makes node's mpid hold at its next step (before or after
// it, as where says) and returns the failpoint's file: mpid writes
// file+".reached" when it holds there, and goes on once the file is gone
// (the caller's to remove, on every path).
func armFailpoint(t testing.TB, node, step, where string) string {
	t.Helper()
	dir := filepath.Join(failpointRoot, node)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	fp := filepath.Join(dir, step)
	os.Remove(fp + ".reached")
	if err := os.WriteFile(fp, []byte(where), 0o644); err != nil {
		t.Fatal(err)
	}
	return fp
}

// pauseToFailpoint starts `mpipause pause --json id` on node0 and waits
// until an mpid holds at the failpoint fp (armFailpoint), which says where.
func pauseToFailpoint(ctx context.Context, t testing.TB, id, fp, where string) *proc {
	t.Helper()
	pause := start(ctx, t, "", []string{"MPIPAUSE_RIG=" + jobRig}, filepath.Join(binDir(t), "rig"), "exec", "node0", "--",
		"mpipause", "pause", "--json", id)
	waitFor(t, where, time.Minute, pause.done, func() bool {
		_, err := os.Stat(fp + ".reached")
		return err == nil
	})
	return pause
}

// Outcomes of a fault trial.
const (
	outRolledBack = "rolled back"
	outCompleted  = "completed"
	outStuck      = "stuck"
	// outCompletedWrong: the pause holds, but not as the row requires
	// (faultRow.committed); never allowed.
	outCompletedWrong = "completed, not as it must"
	// outRolledBackWrong: rolled back with a report that does not say
	// why (faultRow.reason); never allowed.
	outRolledBackWrong = "rolled back, report not as it must"
)

// faultRow is one fault of the table: inject runs while the victim node's
// mpid holds at the failpoint (the phase, before or after its local step),
// and returns what to undo once the pause has ended. allowed are the
// outcomes that are right for it; stuck never is.
type faultRow struct {
	name    string
	node    int // where the failpoint holds
	allowed []string
	// perTrialJob: the fault ends the job (a rank killed).
	perTrialJob bool
	// waits: each trial waits out a deadline (a node's step and lease,
	// 6 to 11 s a trial where the others take 1 to 4); such a row runs a
	// quarter of the trials (cellTrials), so that a long run's time goes
	// to trials that find something and not to sleeping.
	waits bool
	// noReport: the fault takes the coordinator, and with it the report;
	// the pause command can only say that it lost its mpid.
	noReport bool
	// phases, if set, replaces PREPARE, DRAIN, FREEZE; where, if set,
	// is the one point of the failpoint (before or after the step).
	phases []string
	where  string
	// setup, if set, runs before the pause starts; it may inject the
	// fault already (tr.injected), and the pause may then end before the
	// failpoint.
	setup  func(ctx context.Context, t *testing.T, tr *trial)
	inject func(ctx context.Context, t *testing.T, tr *trial)
	// committed, if set, checks a pause that completed before it is
	// resumed: what is wrong with it, or "".
	committed func(ctx context.Context, t *testing.T, tr *trial) string
	// reason, if set, is what the report of a rolled-back pause must say.
	reason *regexp.Regexp
}

// trial is one injection: the job, the pause under way, the failpoint.
type trial struct {
	row   *faultRow
	phase string
	id    string
	job   *proc
	pause *proc
	fp    string // failpoint file
	rng   *rand.Rand
	// after runs once the pause command has returned (heal a link, ...).
	after func()
	// resumed says a committed hook resumed the job (the judge then does
	// not).
	resumed bool
	// stopped is the pid of the rank a SIGSTOP fault stopped.
	stopped int
	// victimRank is the rank a rank fault killed.
	victimRank int
	// stuck, if set by inject, is why the trial is stuck whatever the
	// pause then reports.
	stuck string
	// injected: setup injected the fault before the pause started.
	injected bool
	// cleanup runs once the trial is judged (unmount a filesystem, ...).
	cleanup func()
	// choices are the random choices the trial made, in the order drawn:
	// a replay (MPIPAUSE_FAULT_SEED) prints the same.
	choices []string
}

// intn draws from the trial's seed and notes the draw as what.
func (tr *trial) intn(n int, what string) int {
	v := tr.rng.IntN(n)
	tr.choices = append(tr.choices, fmt.Sprintf("%s %d", what, v))
	return v
}

type cell struct {
	trials, rolled, completed, stuck, wrong int
	// took is the time the cell's trials took, their jobs' starts and
	// ends included: what a longer run of the cell would cost.
	took time.Duration
}

// faultTrialBudget bounds one trial on average, job starts and stops
// included, for the test's own deadline: a trial takes a few seconds on the
// rig (docs/testing.md, "Faults and load"); the deadline is there to end a
// run that hangs, with its table, before go test's own timeout.
const faultTrialBudget = 15 * time.Second

// faultCell is one cell of the table: a fault in one phase.
type faultCell struct {
	row    *faultRow
	ri, ci int // the row's index, the cell's in the whole table
	phase  string
}

func (c faultCell) name() string { return c.row.name + " " + c.phase }

// seed is the cell's first trial's seed: trial k draws its random choices
// (before or after the step, the delay, the rank, ...) from seed+k alone,
// so that one trial can be replayed by itself. Derived from the master
// seed and the cell's name, not its place in the table, so a cell keeps its
// seeds when MPIPAUSE_FAULT_ONLY leaves the others out.
func (c faultCell) seed(master uint64) uint64 {
	h := fnv.New64a()
	h.Write([]byte(c.name()))
	return master ^ h.Sum64()
}

// TestFaultTable injects each fault at a random point of each pause phase
// (the point: before or after the victim node's own step of that phase,
// plus a random delay), many times, on real Open MPI and MPICH jobs, and
// prints the table: fault x phase x trials x outcome, and the jobs whose
// output differed from an unpaused run. Stuck and differed must be 0, and
// every outcome must be one the fault allows (G3, docs/guarantees.md: rolled
// back everywhere or completed everywhere, never split; a pause with a node
// lost rolls back).
//
// MPIPAUSE_FAULT_TRIALS sets the trials per cell (default 2; a row that
// waits out a deadline runs a quarter of them, at least 3 or all if fewer:
// cellTrials; make test-faults-long runs enough for 1,000 faults),
// MPIPAUSE_FAULT_SEED the master seed (printed; each cell's seeds derive
// from it), MPIPAUSE_FAULT_ONLY the cells to run ("fault PHASE" exactly,
// else every cell whose "fault PHASE" contains it), MPIPAUSE_FAULT_LIB the MPI
// library: openmpi or mpich (every cell), both (each cell's trials split
// between them), or unset (the cells alternate). With both
// MPIPAUSE_FAULT_SEED and MPIPAUSE_FAULT_ONLY, the seed is the cell's own:
// its first trial makes exactly the random choices of the trial that
// printed that seed. Every trial whose outcome is not allowed prints the
// command that replays it alone ("faults: replay:").
func TestFaultTable(t *testing.T) {
	bin := binDir(t)
	rows := faultRows(bin)
	trials := envCount("MPIPAUSE_FAULT_TRIALS", 2)
	only := os.Getenv("MPIPAUSE_FAULT_ONLY")
	seed := uint64(time.Now().UnixNano())
	seedGiven := false
	if s := os.Getenv("MPIPAUSE_FAULT_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("MPIPAUSE_FAULT_SEED=%q: %v", s, err)
		}
		seed, seedGiven = v, true
	}
	libOf, err := faultLibs(os.Getenv("MPIPAUSE_FAULT_LIB"))
	if err != nil {
		t.Fatal(err)
	}
	cells := selectCells(rows, only)
	if len(cells) == 0 {
		t.Fatalf("MPIPAUSE_FAULT_ONLY=%q matches no cell of the table", only)
	}
	replaying := seedGiven && only != ""
	sharedRig(t)
	repairRigOnCleanup(t)
	// The deadline grows with the trials: 1,000 of them take far more than
	// the default run's 20 minutes.
	planned := 0
	for _, fc := range cells {
		planned += cellTrials(fc.row, trials)
	}
	timeout := max(20*time.Minute, time.Duration(planned)*faultTrialBudget)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	obs, _ := rigReaders(ctx, t)
	if replaying {
		t.Logf("faults: %d trials per cell, seed %d of the cell itself (MPIPAUSE_FAULT_SEED with MPIPAUSE_FAULT_ONLY), deadline %v", trials, seed, timeout)
	} else {
		t.Logf("faults: %d trials per cell (%d in a row that waits out a deadline) in %d cells, %d in all, master seed %d (MPIPAUSE_FAULT_SEED), deadline %v",
			trials, cellTrials(&faultRow{waits: true}, trials), len(cells), planned, seed, timeout)
	}
	table := map[string]map[string]*cell{}
	for ri := range rows {
		table[rows[ri].name] = map[string]*cell{}
		for _, phase := range rows[ri].phaseList() {
			table[rows[ri].name][phase] = &cell{}
		}
	}
	differed, jobs, finished := 0, 0, 0
	var replays []string
	current := "" // the replay of the trial under way, for a test that dies in it
	start := time.Now()
	done := 0
	defer func() {
		// Also when a trial ends the test (t.Fatal): the table so far, and
		// how to replay the trial that did it.
		if current != "" {
			replays = append(replays, current+"   # the trial under way when the test ended")
		}
		printTable(t, rows, table, jobs, finished, differed)
		if done > 0 {
			t.Logf("faults | %d trials in %v, %.1f s a trial", done, time.Since(start).Round(time.Second), time.Since(start).Seconds()/float64(done))
		}
		for _, r := range replays {
			t.Logf("faults: replay: %s", r)
		}
	}()
	for _, fc := range cells {
		row, phase := fc.row, fc.phase
		c := table[row.name][phase]
		cellStart := time.Now()
		cellSeed := fc.seed(seed)
		if replaying {
			cellSeed = seed
		}
		var job *faultJob
		var jobLib mpiLib
		endJob := func() {
			if job != nil {
				finished++
				if !job.finish(ctx, t) {
					differed++
				}
				job = nil
			}
		}
		n := cellTrials(row, trials)
		for k := 0; k < n; k++ {
			lib := libOf(fc.ci, k, n)
			if job != nil && jobLib.name != lib.name {
				endJob()
			}
			if job == nil {
				jobs++
				jobLib = lib
				job = startFaultJob(ctx, t, obs, lib, fmt.Sprintf("ft%d-%d-%s-%d", os.Getpid(), fc.ri, strings.ToLower(phase), k))
			}
			trialSeed := cellSeed + uint64(k)
			replay := replayCommand(trialSeed, fc.name(), lib.name)
			current = replay
			tr := &trial{row: row, phase: phase, id: job.id, job: job.proc, rng: rand.New(rand.NewPCG(trialSeed, 1))}
			out, why := runTrial(ctx, t, obs, tr)
			current = ""
			done++
			c.trials++
			switch out {
			case outRolledBack:
				c.rolled++
			case outCompleted:
				c.completed++
			case outStuck:
				c.stuck++
			}
			if !contains(row.allowed, out) {
				if out != outStuck {
					c.wrong++
				}
				// With its reason: CI keeps only the output's tail,
				// where the trial's own line may not be.
				replays = append(replays, replay+"   # "+out+why)
			}
			t.Logf("faults: %-28s %-7s trial %d (%s, seed %d, drew %s): %s%s", row.name, phase, k+1, lib.name, trialSeed, strings.Join(tr.choices, ", "), out, why)
			if out == outStuck {
				// Nothing more can be learnt from this job.
				t.Errorf("%s in %s: stuck%s", row.name, phase, why)
				job.kill(t)
				job = nil
				continue
			}
			if row.perTrialJob {
				job.waitEnd(ctx, t)
				job = nil
			}
		}
		endJob()
		c.took = time.Since(cellStart)
	}
	for _, row := range rows {
		for _, p := range row.phaseList() {
			c := table[row.name][p]
			if c.stuck > 0 || c.wrong > 0 {
				t.Errorf("%s in %s: %d stuck, %d outcomes it does not allow (allowed: %s)", row.name, p, c.stuck, c.wrong, strings.Join(row.allowed, ", "))
			}
		}
	}
	if differed > 0 {
		t.Errorf("%d jobs finished with output that differs from an unpaused run", differed)
	}
}

// selectCells are the table's cells that MPIPAUSE_FAULT_ONLY selects: those
// named by it exactly if any (a replay names one cell, whose name may be
// part of another's), else those whose name contains it.
func selectCells(rows []faultRow, only string) []faultCell {
	var all, exact, part []faultCell
	for ri := range rows {
		for _, phase := range rows[ri].phaseList() {
			c := faultCell{row: &rows[ri], ri: ri, ci: len(all), phase: phase}
			all = append(all, c)
			if c.name() == only {
				exact = append(exact, c)
			}
			if strings.Contains(c.name(), only) {
				part = append(part, c)
			}
		}
	}
	switch {
	case only == "":
		return all
	case len(exact) > 0:
		return exact
	}
	return part
}

// cellTrials is how many trials a cell of row runs when a cell runs trials:
// all of them, or for a row that waits out a deadline a quarter (at least 3,
// and never more than trials), so that a replay (1 trial) stays one.
func cellTrials(row *faultRow, trials int) int {
	if !row.waits {
		return trials
	}
	return max(min(trials, 3), (trials+3)/4)
}

// faultLibs maps MPIPAUSE_FAULT_LIB to the library of trial k of the n of
// cell ci (a cell's trials share a job, and a job is one library).
func faultLibs(choice string) (func(ci, k, n int) mpiLib, error) {
	byName := func(name string) (mpiLib, bool) {
		for _, l := range mpiLibs {
			if l.name == name {
				return l, true
			}
		}
		return mpiLib{}, false
	}
	switch choice {
	case "":
		// Alternate by the cell's place in the whole table, so that a
		// cell run alone keeps its library.
		return func(ci, _, _ int) mpiLib { return mpiLibs[ci%len(mpiLibs)] }, nil
	case "both":
		return func(_, k, n int) mpiLib { return mpiLibs[k*len(mpiLibs)/n] }, nil
	}
	l, ok := byName(choice)
	if !ok {
		return nil, fmt.Errorf("MPIPAUSE_FAULT_LIB=%q: openmpi, mpich or both", choice)
	}
	return func(int, int, int) mpiLib { return l }, nil
}

// replayCommand is the command that runs one trial again alone, with the
// same random choices.
func replayCommand(seed uint64, cell, lib string) string {
	rig := ""
	if r := os.Getenv("MPIPAUSE_TEST_RIG"); r != "" {
		rig = "MPIPAUSE_TEST_RIG=" + r + " "
	}
	return fmt.Sprintf("%sMPIPAUSE_FAULT_SEED=%d MPIPAUSE_FAULT_ONLY='%s' MPIPAUSE_FAULT_LIB=%s MPIPAUSE_FAULT_TRIALS=1 make test-faults", rig, seed, cell, lib)
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

func (r *faultRow) phaseList() []string {
	if r.phases != nil {
		return r.phases
	}
	return []string{"PREPARE", "DRAIN", "FREEZE"}
}

func printTable(t *testing.T, rows []faultRow, table map[string]map[string]*cell, jobs, finished, differed int) {
	t.Logf("faults | %-28s | %-7s | %6s | %11s | %9s | %5s | %11s | %9s", "fault", "phase", "trials", "rolled back", "completed", "stuck", "not allowed", "s a trial")
	total := cell{}
	perTrial := func(c *cell) string {
		if c.trials == 0 {
			return "-"
		}
		return fmt.Sprintf("%.1f", c.took.Seconds()/float64(c.trials))
	}
	for _, row := range rows {
		for _, p := range row.phaseList() {
			c := table[row.name][p]
			t.Logf("faults | %-28s | %-7s | %6d | %11d | %9d | %5d | %11d | %9s", row.name, p, c.trials, c.rolled, c.completed, c.stuck, c.wrong, perTrial(c))
			total.trials += c.trials
			total.rolled += c.rolled
			total.completed += c.completed
			total.stuck += c.stuck
			total.wrong += c.wrong
			total.took += c.took
		}
	}
	t.Logf("faults | %-28s | %-7s | %6d | %11d | %9d | %5d | %11d | %9s", "all", "", total.trials, total.rolled, total.completed, total.stuck, total.wrong, perTrial(&total))
	t.Logf("faults | jobs whose output differed from an unpaused run: %d of %d finished (%d jobs in all; those with a rank killed end by design)", differed, finished, jobs)
}

// faultRows are the fault table's rows (docs/testing.md): mpid killed on a node (and started
// again at once: the pause rolls back, or completes if the new mpid and its
// re-registered ranks answered within the phase's deadline) and on the
// coordinator, a node's link cut (healed inside the deadline, or not), a
// rank killed.
func faultRows(bin string) []faultRow {
	return []faultRow{
		// In VERIFY and COMMIT too: a node that recorded its COMMIT and died
		// before acknowledging it comes back paused (its record) while the
		// coordinator rolls back the others; the coordinator's rollback,
		// repeated until every node confirms, must reach the new mpid.
		{name: "mpid SIGKILL, node2", node: 2, allowed: []string{outRolledBack, outCompleted}, inject: killMpid,
			phases: []string{"PREPARE", "DRAIN", "FREEZE", "VERIFY", "COMMIT"}},
		// In COMMIT too: the other nodes may have committed when it dies;
		// its successor finds the pause it was coordinating and rolls it
		// back everywhere (nobody was told it held).
		{name: "coordinator mpid SIGKILL", node: 0, allowed: []string{outRolledBack}, noReport: true, inject: killMpid,
			phases: []string{"PREPARE", "DRAIN", "FREEZE", "VERIFY", "COMMIT"}},
		{name: "node2 link cut, heals", node: 2, allowed: []string{outRolledBack, outCompleted}, inject: cutLink(true)},
		{name: "node2 link cut, stays cut", node: 2, allowed: []string{outRolledBack}, inject: cutLink(false), waits: true},
		{name: "rank SIGKILL on node2", node: 2, allowed: []string{outRolledBack}, perTrialJob: true, inject: killRank},
		// The lease gap: COMMIT done on node1, on its way to
		// node2 (whose link is cut), when the coordinator dies, and the
		// coordinator back only once the other nodes have settled: they
		// must agree without it (before the decider, node1 stayed paused
		// until the coordinator came back, node2 rolled back).
		{name: "coordinator dies in COMMIT", node: 1, where: "after", allowed: []string{outRolledBack}, noReport: true,
			phases: []string{"COMMIT"}, inject: killCoordinatorLate, waits: true},
		// Stopped by someone else (a debugger, a user's kill -STOP), not
		// killed: the rank neither reads nor answers until SIGCONT, which
		// comes once the pause command has returned. Either outcome is
		// right, as long as it is the same on every node and the job's
		// output is that of an unpaused run.
		{name: "rank SIGSTOP on node2", node: 2, allowed: []string{outRolledBack, outCompleted}, inject: stopRank,
			committed: continueResumes, phases: []string{"PREPARE", "DRAIN", "FREEZE", "VERIFY"}},
		// The coordinator's state directory really full (a tmpfs of its own,
		// filled up): before the pause (its pausing record cannot be
		// written), or at its COMMIT (its paused record cannot be). A pause
		// may complete only if its record says paused, what a restarted mpid
		// trusts (G5); else it must roll back and say why.
		{name: "coordinator disk full", node: 0, allowed: []string{outRolledBack, outCompleted},
			phases: []string{"PREPARE", "COMMIT"}, setup: diskFullSetup, inject: diskFullInject, committed: recordSaysPaused,
			reason: regexp.MustCompile(`no space left on device`)},
	}
}

// runTrial arms the failpoint, starts the pause, injects the fault at it
// and judges the outcome; a completed pause is resumed.
func runTrial(ctx context.Context, t *testing.T, obs loader.Observer, tr *trial) (string, string) {
	t.Helper()
	node := fmt.Sprintf("node%d", tr.row.node)
	where := []string{"before", "after"}[tr.intn(2, "after")]
	if tr.row.where != "" {
		where = tr.row.where
	}
	tr.fp = armFailpoint(t, node, tr.phase, where)
	defer os.Remove(tr.fp)
	defer func() {
		if tr.cleanup != nil {
			tr.cleanup()
		}
	}()
	if tr.row.setup != nil {
		tr.row.setup(ctx, t, tr)
	}
	before := sentBytes(ctx, obs)
	tr.pause = start(ctx, t, "", []string{"MPIPAUSE_RIG=" + jobRig}, filepath.Join(binDir(t), "rig"), "exec", "node0", "--",
		"mpipause", "pause", "--json", "--timeout", "3s", tr.id)
	reached := false
	waitFor(t, "the failpoint "+node+"/"+tr.phase+" ("+where+")", time.Minute, nil, func() bool {
		if _, err := os.Stat(tr.fp + ".reached"); err == nil {
			reached = true
			return true
		}
		select {
		case <-tr.pause.done:
			return true
		default:
			return false
		}
	})
	if !reached && tr.injected {
		where = "set up before the pause; drawn: " + where
	}
	if !reached && !tr.injected {
		t.Fatalf("%s: the pause ended before %s's mpid reached %s (%s): were the rig's mpids the test build (%s) started with %s set?\n%s",
			tr.row.name, node, tr.phase, where, testMPID, "MPIPAUSE_FAILPOINTS", tr.pause.out.String())
	}
	// A random point inside the hold: the rest of the protocol waits on it.
	// Drawn even when the pause has ended already, so that a trial's later
	// choices come from the same draws whatever the pause did.
	time.Sleep(time.Duration(tr.intn(30, "delay ms")) * time.Millisecond)
	if reached {
		tr.row.inject(ctx, t, tr)
	}
	os.Remove(tr.fp)
	select {
	case <-tr.pause.done:
	case <-time.After(2 * time.Minute):
		return outStuck, ": the pause command did not return in 2 min"
	}
	if tr.after != nil {
		tr.after()
	}
	if tr.stuck != "" {
		return outStuck, fmt.Sprintf(" (at %s %s): %s", where, tr.phase, tr.stuck)
	}
	j, jerr := pauseResult(tr.pause)
	out, why := judge(ctx, t, obs, tr, j, jerr, before)
	return out, fmt.Sprintf(" (at %s %s; pause: %s)", where, tr.phase, pauseSummary(tr.pause, j, jerr)) + why
}

// pauseResult decodes the pause command's JSON (rig exec may add lines).
func pauseResult(p *proc) (ctl.Job, error) {
	var j ctl.Job
	out := p.out.String()
	if a, b := strings.Index(out, "{"), strings.LastIndex(out, "}"); a >= 0 && b > a {
		out = out[a : b+1]
	}
	err := json.Unmarshal([]byte(out), &j)
	return j, err
}

func pauseSummary(p *proc, j ctl.Job, err error) string {
	code := 0
	if p.err != nil {
		code = -1
		if ee, ok := p.err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
	}
	if err != nil {
		return fmt.Sprintf("exit %d, no JSON", code)
	}
	if j.Failure != nil {
		// Whole: a reason cut short once read as a name left empty.
		return fmt.Sprintf("exit %d, %s, failed in %s on %s: %s", code, j.State, j.Failure.Phase, j.Failure.Node, j.Failure.Reason)
	}
	return fmt.Sprintf("exit %d, %s", code, j.State)
}

// judge waits (bounded) for the job to settle on every node and names
// the outcome: completed (the pause reported success, every node frozen,
// every connection empty as the test's own kernel readers see it; then
// resumed), rolled back (the pause reported failure, nothing frozen, the
// job sending again), or stuck (anything else: a split state, a node left
// frozen or gated).
func judge(ctx context.Context, t *testing.T, obs loader.Observer, tr *trial, j ctl.Job, jerr error, before uint64) (out, why string) {
	cgs := nodeJobCgroups(t, tr.id)
	frozen := func() (n int) {
		for _, cg := range cgs {
			if f, err := cgroupv2.Frozen(cg); err == nil && f {
				n++
			}
		}
		return n
	}
	ok := tr.pause.err == nil && jerr == nil && j.State == ctl.StatePaused
	if ok {
		if n := frozen(); n != len(cgs) {
			return outStuck, fmt.Sprintf(": the pause says paused, %d of %d nodes frozen", n, len(cgs))
		}
		conns, err := obs.Snapshot(ctx)
		if err != nil || !allEmpty(conns) {
			return outStuck, fmt.Sprintf(": committed with bytes in flight: %v %v", err, nonEmpty(conns))
		}
		var wrong string
		if tr.row.committed != nil {
			wrong = tr.row.committed(ctx, t, tr)
		}
		// A row's hook may have resumed it (and checked that it runs).
		if !tr.resumed {
			if jr, r := jobJSON(ctx, t, "resume", tr.id); r.code != 0 || jr.State != ctl.StateRunning {
				return outStuck, fmt.Sprintf(": resume exit %d: %s", r.code, r.stderr)
			}
		}
		if wrong != "" {
			return outCompletedWrong, ": " + wrong
		}
		return outCompleted, ""
	}
	if !tr.row.noReport && (jerr != nil || j.Failure == nil) {
		return outStuck, fmt.Sprintf(": the pause failed without a failure report (state %q)", j.State)
	}
	if tr.row.noReport && !strings.Contains(tr.pause.out.String(), "rolls it back on its own") {
		t.Errorf("the pause command, its mpid gone, does not say what happens next:\n%s", tr.pause.out.String())
	}
	// The nodes' own rollbacks (leases) may still be under way.
	deadline := time.Now().Add(30 * time.Second)
	for frozen() > 0 {
		if time.Now().After(deadline) {
			return outStuck, fmt.Sprintf(": %d nodes still frozen 30 s after the pause failed", frozen())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if tr.row.reason != nil && (j.Failure == nil || !tr.row.reason.MatchString(j.Failure.Reason)) {
		defer func() {
			if out == outRolledBack {
				out, why = outRolledBackWrong, fmt.Sprintf(": the report does not say %q", tr.row.reason)+why
			}
		}()
	}
	if tr.row.perTrialJob {
		// The job lost a rank: its launcher ends it; nothing of it may be
		// left frozen meanwhile (checked above), and the report must name
		// the rank ("only 5 of the job's 6 ranks" does not).
		if j.Failure == nil || !namedRank.MatchString(j.Failure.Reason) {
			return outStuck, ": the report does not name the killed rank"
		}
		return outRolledBack, ""
	}
	// Every rank sends again (an a2a exchange needs all of them): no gate
	// was left closed.
	deadline = time.Now().Add(time.Minute)
	for sentBytes(ctx, obs) < before+4<<20 {
		select {
		case <-tr.job.done:
			return outStuck, fmt.Sprintf(": the job ended during the trial (%v); its output:\n%s\nnode%d's mpid log, its end:\n%s",
				tr.job.err, tr.job.out.String(), tr.row.node, logTail(filepath.Join(rigDir(jobRig), fmt.Sprintf("mpid-node%d.log", tr.row.node)), 40))
		default:
		}
		if time.Now().After(deadline) {
			return outStuck, ": the job did not send again within 1 min of the rollback"
		}
		time.Sleep(20 * time.Millisecond)
	}
	return outRolledBack, ""
}

// namedRank is how a report names a rank that went (node.RankGoneError).
var namedRank = regexp.MustCompile(`rank \d+ \(pid \d+\)`)

// killMpid kills the victim node's mpid at the failpoint and starts it
// again once the pause has returned; the next trial first waits for the
// job's ranks to register with it again.
func killMpid(ctx context.Context, t *testing.T, tr *trial) {
	node := fmt.Sprintf("node%d", tr.row.node)
	pid := statusOf(t, jobRig).Nodes[tr.row.node].MPIDPid
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill %s's mpid: %v", node, err)
	}
	waitFor(t, node+"'s mpid to be gone", time.Minute, nil, func() bool {
		return syscall.Kill(pid, 0) != nil || procState(pid) == "Z"
	})
	// Started again at once, as systemd would: the coordinator's rollback
	// reaches the new mpid (else it retries for its whole 30 s deadline,
	// then in the background).
	os.Remove(tr.fp)
	mustRig(t, jobRig, "up", fmt.Sprint(jobNodes))
	tr.after = func() {
		// The restarted mpid finds the job and brings it to its state:
		// running (the pause never committed), its ranks registered
		// again, pausable again.
		// A rollback the dead node could not confirm is confirmed by
		// the coordinator in the background once the node is back.
		waitRegisteredAgain(ctx, t, tr.id, tr.job.done)
		waitFor(t, "the job's status to settle (running, or paused if the pause completed)", time.Minute, tr.job.done, func() bool {
			j, r := jobJSON(ctx, t, "status", tr.id)
			return r.code == 0 && (j.State == ctl.StateRunning || j.State == ctl.StatePaused)
		})
	}
}

// killCoordinatorLate holds node1 right after its COMMIT, cuts node2's link
// (the COMMIT to node2 may or may not have gone), kills the coordinator's
// mpid, heals the link and releases node1; then, the coordinator still
// dead, node1 and node2 must settle on one outcome by themselves: no
// node's cgroup frozen once their leases have run out and they have asked
// the decider (node1) what became of the pause, which never heard DECIDE.
// Only then does the coordinator's mpid start again (its record of the
// pause makes it roll the pause back on every node, its own included).
func killCoordinatorLate(ctx context.Context, t *testing.T, tr *trial) {
	link(t, "veth2", "down")
	pid := statusOf(t, jobRig).Nodes[0].MPIDPid
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill the coordinator's mpid: %v", err)
	}
	waitFor(t, "the coordinator's mpid to be gone", time.Minute, nil, func() bool {
		return syscall.Kill(pid, 0) != nil || procState(pid) == "Z"
	})
	link(t, "veth2", "up")
	os.Remove(tr.fp)
	cgs := nodeJobCgroups(t, tr.id)
	frozen := func() (out []string) {
		for i, cg := range cgs[1:] {
			if f, err := cgroupv2.Frozen(cg); err == nil && f {
				out = append(out, fmt.Sprintf("node%d", i+1))
			}
		}
		return out
	}
	// COMMIT's deadline (5 s), the lease's grace (2 s), and the answers.
	deadline := time.Now().Add(30 * time.Second)
	for len(frozen()) > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if f := frozen(); len(f) > 0 {
		tr.stuck = fmt.Sprintf("%s still frozen 30 s after the coordinator died in COMMIT (it is still dead)", strings.Join(f, ", "))
	}
	mustRig(t, jobRig, "up", fmt.Sprint(jobNodes))
	tr.after = func() {
		waitRegisteredAgain(ctx, t, tr.id, tr.job.done)
		waitFor(t, "the job's status to settle (running)", time.Minute, tr.job.done, func() bool {
			j, r := jobJSON(ctx, t, "status", tr.id)
			return r.code == 0 && j.State == ctl.StateRunning
		})
	}
}

// cutLink takes the victim node's port on the rig's bridge down; heal:
// up again after a random 50-500 ms (inside every deadline), else once
// the pause has returned (the node has rolled back on its own by then).
func cutLink(heal bool) func(ctx context.Context, t *testing.T, tr *trial) {
	return func(ctx context.Context, t *testing.T, tr *trial) {
		port := fmt.Sprintf("veth%d", tr.row.node)
		link(t, port, "down")
		if heal {
			time.Sleep(time.Duration(50+tr.intn(450, "heal ms-50")) * time.Millisecond)
			link(t, port, "up")
			return
		}
		// Released, the node runs its step but cannot answer; with no
		// next step it rolls back on its own once the step's deadline
		// and the lease's grace have passed (its mpid says so). Healed
		// then, the coordinator's ABORT reaches it and is confirmed.
		os.Remove(tr.fp)
		logf := filepath.Join(rigDir(jobRig), "mpid-node"+strconv.Itoa(tr.row.node)+".log")
		rolled := func() int {
			b, _ := os.ReadFile(logf)
			return strings.Count(string(b), "rolled back here")
		}
		n := rolled()
		waitFor(t, "the cut-off node to roll back on its own", time.Minute, nil, func() bool { return rolled() > n })
		link(t, port, "up")
	}
}

func link(t *testing.T, port, state string) {
	t.Helper()
	out, err := exec.Command("ip", "-n", "mpipause-rig-"+jobRig, "link", "set", port, state).CombinedOutput()
	if err != nil {
		t.Fatalf("ip link set %s %s: %v\n%s", port, state, err, out)
	}
}

// killRank kills one of the job's ranks on the victim node.
func killRank(ctx context.Context, t *testing.T, tr *trial) {
	cg := nodeJobCgroups(t, tr.id)[tr.row.node]
	procs, err := cgroupv2.Procs(cg)
	if err != nil || len(procs) == 0 {
		t.Fatalf("ranks in %s: %v %v", cg, procs, err)
	}
	sort.Ints(procs)
	if err := syscall.Kill(procs[tr.intn(len(procs), "rank of node")], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
}

// stopRank stops one of the job's ranks on the victim node, and continues
// it once the pause command has returned: at once if the pause failed (the
// job must run again); if it held, continueResumes does.
func stopRank(ctx context.Context, t *testing.T, tr *trial) {
	cg := nodeJobCgroups(t, tr.id)[tr.row.node]
	procs, err := cgroupv2.Procs(cg)
	if err != nil || len(procs) == 0 {
		t.Fatalf("ranks in %s: %v %v", cg, procs, err)
	}
	sort.Ints(procs)
	pid := procs[tr.intn(len(procs), "rank of node")]
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	tr.stopped = pid
	tr.after = func() {
		if j, err := pauseResult(tr.pause); err == nil && tr.pause.err == nil && j.State == ctl.StatePaused {
			return
		}
		if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
			t.Errorf("SIGCONT to rank pid %d: %v", pid, err)
		}
	}
}

// continueResumes sends the SIGCONT to the stopped rank of a pause that
// held. A SIGCONT to a rank is a request to resume its job (the shim's
// handler; libmpi-shim/README.md, "sig.c"), and the rank is frozen: mpid must
// read it pending there and resume the job everywhere.
func continueResumes(ctx context.Context, t *testing.T, tr *trial) string {
	if err := syscall.Kill(tr.stopped, syscall.SIGCONT); err != nil {
		t.Errorf("SIGCONT to rank pid %d: %v", tr.stopped, err)
		return ""
	}
	var st string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		jr, r := jobJSON(ctx, t, "status", tr.id)
		if st = jr.State; r.code == 0 && st == ctl.StateRunning {
			tr.resumed = true
			return ""
		}
	}
	return fmt.Sprintf("a SIGCONT to the frozen rank pid %d left the job %s for 10 s", tr.stopped, st)
}

// coordStateDir is the coordinator's (node0's) state directory as its mpid
// sees it: the rig gives every node its own /run/mpipause (docs/rig.md).
const coordStateDir = "/run/mpipause/mpid-node0"

// nodeSh runs a shell script inside node0's namespaces (its mount
// namespace: where its mpid sees coordStateDir).
func nodeSh(t *testing.T, script string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := rigCommand(ctx, jobRig, "exec", "node0", "--", "sh", "-c", script)
	return out, err
}

// diskFullSetup mounts a tmpfs of 256 KiB over the coordinator's state
// directory, in node0's mount namespace only, and fills it at once for a
// trial in PREPARE (the pausing record, written before the first step, is
// the one that fails); the mount goes once the trial is judged. Nothing is
// hidden under it: a running job has no record.
func diskFullSetup(ctx context.Context, t *testing.T, tr *trial) {
	if out, err := nodeSh(t, "set -e; d="+coordStateDir+"; mkdir -p $d; if ls $d/*.json 2>/dev/null; then echo records left; exit 1; fi; "+
		"mount -t tmpfs -o size=256k,mode=0700 mpipause-full $d"); err != nil {
		t.Fatalf("mount a small tmpfs on node0's %s: %v\n%s", coordStateDir, err, out)
	}
	tr.cleanup = func() {
		if out, err := nodeSh(t, "d="+coordStateDir+"; ls -a $d; umount $d"); err != nil {
			t.Errorf("unmount node0's %s: %v\n%s", coordStateDir, err, out)
		} else if strings.Contains(out, ".json") {
			t.Logf("faults: a record was left in the full directory: %s", out)
		}
	}
	if tr.phase == "PREPARE" {
		fillDisk(t)
		tr.injected = true
	}
}

func diskFullInject(ctx context.Context, t *testing.T, tr *trial) {
	if !tr.injected {
		fillDisk(t)
	}
}

// fillDisk fills the tmpfs until not one byte more fits.
func fillDisk(t *testing.T) {
	out, err := nodeSh(t, "d="+coordStateDir+"; head -c 1M /dev/zero > $d/.fill 2>/dev/null; "+
		"if printf x > $d/.probe 2>/dev/null; then echo still room; exit 1; fi; rm -f $d/.probe; df -k $d | tail -1")
	if err != nil {
		t.Fatalf("fill node0's %s: %v\n%s", coordStateDir, err, out)
	}
}

// recordSaysPaused: a pause that completed is recorded as paused on the
// coordinator, else a restart of its mpid rolls back a pause whose user was
// told it held (G5, docs/guarantees.md).
func recordSaysPaused(ctx context.Context, t *testing.T, tr *trial) string {
	out, err := nodeSh(t, "cat "+coordStateDir+"/*:"+tr.id+".json") // named by the job key, uid:id
	if err != nil {
		return fmt.Sprintf("the pause says paused, and the coordinator has no record of it (%v: %s): a restart of its mpid would forget it", err, strings.TrimSpace(out))
	}
	var f struct {
		Record struct {
			State string `json:"state"`
		} `json:"record"`
	}
	if a := strings.Index(out, "{"); a >= 0 {
		out = out[a:]
	}
	if err := json.Unmarshal([]byte(out), &f); err != nil {
		return fmt.Sprintf("the coordinator's record does not parse: %v", err)
	}
	if f.Record.State != ctl.StatePaused {
		return fmt.Sprintf("the pause says paused, and the coordinator's record says %q: a restart of its mpid would roll it back", f.Record.State)
	}
	return ""
}

// faultJob is an xchg job that runs until told to stop (-E), so that it
// outlives any number of trials, and then prints how many iterations it ran.
type faultJob struct {
	*proc
	id, app, stop string
	args          []string
	ranks         int // 6 unless set
}

// faultJobEnv keeps UCX (MPICH's transport here) from ending a job whose
// node's link is cut for longer than its TCP keepalive allows: 10 s idle
// and three probes 2 s apart by default, so a cut of about 16 s ends an
// MPICH job with "Endpoint timeout" and exit 15, no pause involved
// (measured on the rig, 22 s cut). A "stays cut" trial cuts node2 off
// until its mpid has rolled back on its own, its step's deadline and the
// lease's grace, about 15 s; the row tests that rollback, not how long an
// MPI library tolerates a partition. Open MPI's TCP transport sets no
// keepalive.
var faultJobEnv = []string{"UCX_TCP_KEEPIDLE=300s"}

// obs is the table's one observer: one per job would attach a program to
// the rig's cgroup per job, and the kernel refuses the 65th (E2BIG, 64
// programs a cgroup and attach type), which a long run's 65th job met.
func startFaultJob(ctx context.Context, t *testing.T, obs loader.Observer, lib mpiLib, id string) *faultJob {
	t.Helper()
	f := &faultJob{id: id, app: filepath.Join(binDir(t), "apps", "xchg."+lib.name), stop: t.TempDir()}
	f.args = []string{"-m", "a2a", "-s", "128K", "-t", "2000"}
	f.proc = runJobEnv(ctx, t, lib, id, faultJobEnv, f.app, append(f.args, "-n", "1000000", "-E", f.stop)...)
	// A job that ends before it runs fails the table with what it said:
	// its launcher's exit and output are the only account of why.
	since := sentBytes(ctx, obs)
	waitForWhy(t, "job "+id+" to make progress", time.Minute, f.done, func() (bool, string) {
		if sentBytes(ctx, obs) > since+4<<20 {
			return true, ""
		}
		select {
		case <-f.done:
			return false, fmt.Sprintf("%v; its output:\n%s", f.err, f.out.String())
		default:
			return false, ""
		}
	})
	waitRegisteredAgain(ctx, t, id, f.done)
	return f
}

var itersRE = regexp.MustCompile(`iters=(\d+)`)

// finish stops the job and reports whether it printed what an unpaused
// run of as many iterations prints.
func (f *faultJob) finish(ctx context.Context, t *testing.T) bool {
	t.Helper()
	if err := os.WriteFile(filepath.Join(f.stop, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-f.done:
	case <-ctx.Done():
		t.Errorf("job %s did not stop: %v", f.id, ctx.Err())
		return false
	}
	m := itersRE.FindStringSubmatch(f.out.String())
	if f.err != nil || m == nil {
		t.Errorf("job %s failed: %v\n%s", f.id, f.err, f.out.String())
		return false
	}
	ranks := f.ranks
	if ranks == 0 {
		ranks = 6
	}
	want := serial(t, f.app, ranks, append(f.args, "-n", m[1])...)
	if got, w := checksum(f.out.String()), checksum(want); got == "" || got != w {
		t.Errorf("job %s printed %q after %s iterations; an unpaused run %q", f.id, got, m[1], w)
		return false
	}
	return true
}

// waitEnd waits for a job that lost a rank to end (its launcher aborts it).
func (f *faultJob) waitEnd(ctx context.Context, t *testing.T) {
	select {
	case <-f.done:
	case <-time.After(time.Minute):
		t.Errorf("job %s did not end within 1 min of losing a rank", f.id)
		f.kill(t)
	}
}

func (f *faultJob) kill(t *testing.T) {
	for _, cg := range nodeJobCgroups(t, f.id) {
		os.WriteFile(filepath.Join(cg, "cgroup.kill"), []byte("1"), 0)
	}
	f.cmd.Process.Kill()
	<-f.done
}

// logTail is the last n lines of the file at path, or why it cannot be read.
func logTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
