package mpid

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/ranks"
)

// opRegistry is a registry with a store in a temporary directory and one
// running job, kept alive by this process as its creator.
func opRegistry(t *testing.T) (*registry, string) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	r := &registry{node: "n0", ranks: ranks.NewServer(nil), store: &store{dir: t.TempDir(), log: log}, log: log,
		jobs: map[string]*job{}, agent: idleAgent{}}
	self, err := os.FindProcess(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	id := "1000:op"
	r.jobs[id] = &job{id: id, name: "op", owner: 1000, state: ctl.StateRunning, coordinator: "n0", creator: self}
	return r, id
}

// recorded is the state of job id's record, "" if it has none.
func recorded(t *testing.T, r *registry, id string) string {
	t.Helper()
	rec, err := r.store.read(id)
	if errors.Is(err, os.ErrNotExist) {
		return ""
	}
	if err != nil {
		t.Fatalf("read the record: %v", err)
	}
	return rec.State
}

// TestOperationKeepsTheRecord: whatever pauses and resumes a job goes
// through, and however they end, its record says what a restarted mpid
// must know: pausing while a recorded pause is under way, paused once it
// holds, kept while a failed rollback is unconfirmed, none once the job
// runs. Generated sequences; MPIPAUSE_OP_SEED replays one.
func TestOperationKeepsTheRecord(t *testing.T) {
	seeds := []uint64{}
	if s := os.Getenv("MPIPAUSE_OP_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("MPIPAUSE_OP_SEED=%q: %v", s, err)
		}
		seeds = append(seeds, v)
	} else {
		for i := range 200 {
			seeds = append(seeds, uint64(i)*0x9e3779b97f4a7c15+1)
		}
	}
	for _, seed := range seeds {
		if steps, err := opSequence(t, seed); err != nil {
			t.Fatalf("seed %d: %v\nsteps: %v\nrerun: MPIPAUSE_OP_SEED=%d go test -count=1 -run '^TestOperationKeepsTheRecord$' ./internal/mpid/", seed, err, steps, seed)
		}
	}
}

// opSequence runs 30 generated operations on a fresh job and checks the
// record after each step.
func opSequence(t *testing.T, seed uint64) ([]string, error) {
	rng := rand.New(rand.NewPCG(seed, 7))
	r, id := opRegistry(t)
	v := ctl.Job{Nodes: []string{"n0", "n1"}, Coordinator: "n0", Ranks: 4}
	var steps []string
	// want is the record the job should have: pausing from a pause's
	// record() on, paused once it holds, none once the job runs again;
	// undone, refused or failed operations leave it as it was.
	want := ""
	check := func() error {
		if got := recorded(t, r, id); got != want {
			return fmt.Errorf("after %q the record says %q, want %q", steps[len(steps)-1], got, want)
		}
		return nil
	}
	for range 30 {
		state := r.jobs[id].state
		op := ctl.OpPause
		if state != ctl.StateRunning && rng.IntN(4) > 0 {
			op = ctl.OpResume
		}
		o, err := r.begin(id, op, v)
		steps = append(steps, fmt.Sprintf("begin %s (%s)", op, state))
		if err != nil {
			// Refused (a pause of a paused job, a resume of a running
			// one): nothing changes.
			if err := check(); err != nil {
				return steps, err
			}
			continue
		}
		if op == ctl.OpPause {
			if rng.IntN(6) == 0 {
				o.undo()
				steps = append(steps, "undo")
				if err := check(); err != nil {
					return steps, err
				}
				continue
			}
			if err := o.record(); err != nil {
				return steps, err
			}
			steps, want = append(steps, "record"), ctl.StatePausing
			if err := check(); err != nil {
				return steps, err
			}
		}
		// How it ends: held (a pause), rolled back or resumed (running),
		// or a rollback some node did not confirm (failed).
		var end string
		switch n := rng.IntN(3); {
		case op == ctl.OpPause && n == 0:
			end, want = ctl.StatePaused, ctl.StatePaused
			if _, err := o.endRecorded(end, ctl.Job{}); err != nil {
				return steps, err
			}
		case n == 1:
			end = ctl.StateFailed
			o.end(end, ctl.Job{})
		default:
			end, want = ctl.StateRunning, ""
			o.end(end, ctl.Job{})
		}
		steps = append(steps, "end "+end)
		if err := check(); err != nil {
			return steps, err
		}
		// A rollback retried (confirmRollback) ends failed or running.
		if end == ctl.StateFailed && rng.IntN(2) == 0 {
			o, _, ok := r.claimFailed(id, v)
			if !ok {
				return steps, errors.New("claimFailed refused a failed job")
			}
			end = []string{ctl.StateFailed, ctl.StateRunning}[rng.IntN(2)]
			o.end(end, ctl.Job{})
			if end == ctl.StateRunning {
				want = ""
			}
			steps = append(steps, "retried rollback: "+end)
			if err := check(); err != nil {
				return steps, err
			}
		}
	}
	return steps, nil
}

// idleAgent is an agent with no step under way.
type idleAgent struct{}

func (idleAgent) Pausing(string) bool { return false }
func (idleAgent) Forget(string)       {}
