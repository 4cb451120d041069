package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
)

// TestPauseSendPastGateFails: a rank that writes to a TCP connection with
// raw system calls, which no wrapper of the shim sees, keeps bytes moving
// while every gate is closed. Its peer reads them, so every queue can look
// empty; the kernel's write_seq still moves. A pause that sees it must not
// commit; its report says how many bytes went past the gates and on which
// node; the rollback leaves the job running, and it ends with an unpaused
// run's output.
func TestPauseSendPastGateFails(t *testing.T) {
	bin := binDir(t)
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) {
			sharedRig(t)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			id := fmt.Sprintf("pastgate-%s-%d", lib.name, os.Getpid())
			hold, leak := t.TempDir(), t.TempDir()
			f := &faultJob{id: id, app: filepath.Join(bin, "apps", "xchg."+lib.name), stop: t.TempDir()}
			f.args = []string{"-m", "ring", "-s", "32K", "-z", "2000"}
			f.proc = runJob(ctx, t, lib, id, f.app, append(f.args, "-n", "1000000", "-E", f.stop, "-w", hold, "-U", leak)...)
			atHold(t, hold, 6, f.proc)
			release(t, hold)
			waitFor(t, "rank 0's connection past the shim", time.Minute, f.done, func() bool {
				_, err := os.Stat(filepath.Join(leak, "leaking"))
				return err == nil
			})
			defer cli(context.Background(), t, "node0", nil, "resume", id)
			// The kernel is sampled at each check of a pause: a sender that
			// gets no CPU between two checks is not seen, and the pause
			// commits with every queue empty (G1 still holds at the
			// freeze). At nice -20 it runs in about half the pauses; up to
			// 16 tries.
			var fl *ctl.Failure
			for try := 1; try <= 16 && fl == nil; try++ {
				j, r := jobJSON(ctx, t, "pause", id, "--timeout", "2s")
				switch {
				case r.code == 0 && j.State == ctl.StatePaused:
					t.Logf("pause %d committed: the sender was not seen", try)
					if _, r := jobJSON(ctx, t, "resume", id); r.code != 0 {
						t.Fatalf("resume after pause %d: exit %d\n%s%s", try, r.code, r.stdout, r.stderr)
					}
				case r.code == 1 && j.State == ctl.StateRunning && j.Failure != nil:
					fl = j.Failure
					t.Logf("pause %d rolled back: %s", try, fl.Reason)
				default:
					t.Fatalf("pause %d of a job sending past its gates: exit %d, state %q, failure %+v; want a commit or a rollback with a report\n%s%s", try, r.code, j.State, j.Failure, r.stdout, r.stderr)
				}
			}
			if fl == nil {
				t.Fatal("16 pauses committed: the bytes sent past the gates were never seen")
			}
			if fl.Violations == 0 || fl.Node != "node0" || !strings.Contains(fl.Reason, "sent through closed gates on node0") {
				t.Errorf("failure report: %d bytes past the gates, node %q, reason %q; want some, node0, saying so", fl.Violations, fl.Node, fl.Reason)
			}
			checkFrozen(t, id, false, "after the rollback")
			if !f.finish(ctx, t) {
				t.Errorf("job %s did not end with an unpaused run's output", id)
			}
		})
	}
}
