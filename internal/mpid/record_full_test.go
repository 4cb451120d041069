package mpid

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
)

// unwritable makes dir refuse new files, as a full disk refuses mpid's
// records (the fault table fills a real one: docs/testing.md, "Faults
// and load"). It skips where this process writes through a directory's
// mode (CAP_DAC_OVERRIDE); make test-unit drops every capability.
func unwritable(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o500); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Chmod(dir, 0o700) }) // for t.TempDir's removal
	if f, err := os.CreateTemp(dir, "probe"); err == nil {
		f.Close()
		os.Remove(f.Name())
		t.Skip("this process writes through a directory's mode (CAP_DAC_OVERRIDE); make test-unit runs without it")
	}
}

// TestPauseRefusedWithoutRecord: a coordinator that cannot write the record
// of a pause under way (what its successor would roll back) refuses the
// pause before any node is touched, says why, and can pause once it can
// write again. Before, it paused on, and its own COMMIT, taking it for a
// plain node's, failed on the same disk after every other step had run.
func TestPauseRefusedWithoutRecord(t *testing.T) {
	nodes, mem, created := startThree(t)
	var shims []*testShim
	for i, n := range nodes {
		shims = append(shims, n.rank(t, "j1", created.Token, i, 3))
	}
	waitNodes(t, mem, nodes[0], "j1", "node0,node1,node2")
	dir := nodes[0].cfg.StateDir
	unwritable(t, dir)

	rep := nodes[0].ask(t, ctl.OpPause, "j1")
	if rep.Err == nil || rep.Err.Code != ctl.CodeFailed {
		t.Fatalf("pause with the coordinator's records unwritable: %+v", rep.Err)
	}
	if f := rep.Job.Failure; rep.Job.State != ctl.StateRunning || f == nil || f.Phase != "PREPARE" || f.Node != "node0" ||
		!strings.Contains(f.Reason, "cannot record") {
		t.Errorf("the refused pause's report: state %s, failure %+v", rep.Job.State, rep.Job.Failure)
	}
	for i, s := range shims {
		s.mu.Lock()
		if s.closes != 0 {
			t.Errorf("node%d: rank %d's gate was closed %d times by a pause that could not be recorded", i, i, s.closes)
		}
		s.mu.Unlock()
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if rep := nodes[0].ask(t, ctl.OpPause, "j1"); rep.Err != nil || rep.Job.State != ctl.StatePaused {
		t.Fatalf("pause once the records can be written: %+v", rep.Err)
	}
	if rep := nodes[0].ask(t, ctl.OpResume, "j1"); rep.Err != nil {
		t.Fatalf("resume: %+v", rep.Err)
	}
}

// TestPauseRolledBackWhenUnrecorded: a pause that held on every node but
// whose coordinator cannot record it as paused (its disk filled during the
// pause) is rolled back everywhere and reported failed, not reported paused
// with a record saying pausing, which a restarted mpid rolls back (G5).
func TestPauseRolledBackWhenUnrecorded(t *testing.T) {
	nodes, mem, created := startThree(t)
	var shims []*testShim
	for i, n := range nodes {
		shims = append(shims, n.rank(t, "j1", created.Token, i, 3))
	}
	waitNodes(t, mem, nodes[0], "j1", "node0,node1,node2")
	key := jobid.Key(uint32(os.Getuid()), "j1")
	dir := nodes[0].cfg.StateDir

	// Held at node0's FREEZE, after the coordinator recorded the pause
	// under way, while the disk fills.
	hold := make(chan struct{})
	nodes[0].cgroups.mu.Lock()
	nodes[0].cgroups.hold = hold
	nodes[0].cgroups.mu.Unlock()
	done := make(chan *ctl.Reply, 1)
	go func() {
		r, _ := ctl.Do(context.Background(), nodes[0].ctlAddr, ctl.Request{Op: ctl.OpPause, Job: "j1"}, nil)
		done <- r
	}()
	// Not waitFor: its mem.Drain waits for every handler to return, and
	// node0's FREEZE handler is held until the record is seen (a wait
	// begun before the record was written lasted the whole FREEZE deadline).
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if r, err := readRecord(recordPath(dir, key)); err == nil && r.State == ctl.StatePausing {
			break
		}
		select {
		case r := <-done:
			t.Fatalf("the pause ended before node0's FREEZE: %+v", r)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the coordinator never recorded the pause under way")
		}
	}
	unwritable(t, dir)
	close(hold)
	rep := <-done
	if rep == nil {
		t.Fatal("no reply to the pause")
	}
	if rep.Err == nil || rep.Err.Code != ctl.CodeFailed {
		t.Fatalf("a pause its coordinator could not record as paused: %+v, state %s", rep.Err, rep.Job.State)
	}
	if f := rep.Job.Failure; rep.Job.State != ctl.StateRunning || f == nil || f.Phase != "COMMIT" || !strings.Contains(f.Reason, "cannot record") {
		t.Errorf("its report: state %s, failure %+v", rep.Job.State, rep.Job.Failure)
	}
	for i, n := range nodes {
		if f, _ := n.cgroups.Frozen(n.reg.jobDir(key)); f {
			t.Errorf("node%d: still frozen after the rollback", i)
		}
		shims[i].mu.Lock()
		if shims[i].gate != "open" {
			t.Errorf("node%d: gate %s after the rollback", i, shims[i].gate)
		}
		shims[i].mu.Unlock()
	}
	if st := nodes[1].ask(t, ctl.OpStatus, "j1"); st.Job == nil || st.Job.State != ctl.StateRunning {
		t.Errorf("status on node1 after the rollback: %+v", st.Job)
	}
}
