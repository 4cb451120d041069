// SPDX-License-Identifier: Apache-2.0

package mpid

import (
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/quiesce"
)

// TestRankRequestDuringOperation: a rank's request that comes while the
// job's pause is under way (a scheduler's suspend and resume close
// together; a user's pause as Slurm resumes) is what the user wants last:
// it is acted on when the pause ends, not dropped; one signalled before
// the request under way is not.
func TestRankRequestDuringOperation(t *testing.T) {
	cases := []struct {
		name string // short: it names the test's rank socket
		// byUser: the pause under way is a user's (mpipause), not the
		// rank's SIGTSTP.
		byUser bool
		// during sends the rank's second request while the pause is held
		// in FREEZE; after, once it ended (its stamp taken during it).
		during, after bool
		// older: the second request is stamped before the first.
		older bool
		want  string
	}{
		{name: "rank pause, resume during", during: true, want: ctl.StateRunning},
		{name: "user pause, resume during", byUser: true, during: true, want: ctl.StateRunning},
		{name: "user pause, resume after", byUser: true, after: true, want: ctl.StateRunning},
		{name: "rank pause, older resume", during: true, older: true, want: ctl.StatePaused},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
			defer mem.Close()
			n := startNode(t, "node0", mem, testKeys(t))
			created := n.ask(t, ctl.OpCreate, "j1")
			s := n.rank(t, "j1", created.Token, 0, 1)
			hold := make(chan struct{})
			n.cgroups.mu.Lock()
			n.cgroups.hold = hold
			n.cgroups.mu.Unlock()
			state := func() string {
				st := n.ask(t, ctl.OpStatus, "j1")
				if st.Job == nil {
					t.Fatal("no job")
				}
				return st.Job.State
			}
			var marks int
			handled := func() { t.Helper(); s.handled(t, n, &marks) }
			before := monotonic()
			user := make(chan ctl.Reply, 1)
			if tc.byUser {
				go func() { user <- n.ask(t, ctl.OpPause, "j1") }()
			} else {
				s.send("EVENT pause at=%d\n", monotonic())
			}
			for deadline := time.Now().Add(10 * time.Second); state() != ctl.StatePausing; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the pause never began")
				}
			}
			at := monotonic()
			if tc.older {
				at = before
			}
			if tc.during {
				s.send("EVENT resume at=%d\n", at)
				handled()
			}
			close(hold)
			if tc.byUser {
				if rep := <-user; rep.Err != nil {
					t.Fatalf("the user's pause: %+v", rep.Err)
				}
			}
			if tc.after {
				for deadline := time.Now().Add(10 * time.Second); state() != ctl.StatePaused; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("the pause never ended")
					}
				}
				s.send("EVENT resume at=%d\n", at)
				handled()
			}
			// Settled: no rank's request under way, nor the job busy.
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
				n.coord.evMu.Lock()
				idle := len(n.coord.events) == 0
				n.coord.evMu.Unlock()
				if st := state(); idle && st != ctl.StatePausing && st != ctl.StateResuming {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("never settled: %s", state())
				}
			}
			if got := state(); got != tc.want {
				t.Errorf("the job is %s, want %s; log:\n%s", got, tc.want, n.log.String())
			}
		})
	}
}
