// Package kerneltests holds mpipause's multi-node tier: real Open MPI and
// MPICH jobs on the netns rig (kernel-tests/rig), observed by the real
// kernel observer. `make test-multinode` runs it with MPIPAUSE_BIN set to
// the repository's bin/, where `make build` put rig, mpipause and the apps.
package kerneltests

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
)

// jobRig is the rig the MPI tests share; rig tests of their own use other
// names, so a user's default rig is never touched.
const (
	jobRig   = "kt"
	jobNodes = 3
)

var (
	jobRigOnce sync.Once
	jobRigErr  error
	jobRigUp   bool
)

func TestMain(m *testing.M) {
	code := m.Run()
	if jobRigUp {
		if out, err := rigCommand(context.Background(), jobRig, "down"); err != nil {
			fmt.Fprintf(os.Stderr, "rig %s down: %v\n%s", jobRig, err, out)
			code = 1
		}
	}
	os.Exit(code)
}

// binDir is where `make build` left the binaries the tests run.
func binDir(t *testing.T) string {
	t.Helper()
	testutil.RequirePrivileged(t)
	d := os.Getenv("MPIPAUSE_BIN")
	if d == "" {
		t.Fatal("MPIPAUSE_BIN is not set: run this tier with `make test-multinode` (it builds bin/ and sets it)")
	}
	for _, f := range []string{"rig", "mpipause", "apps/xchg.openmpi", "apps/xchg.mpich"} {
		if _, err := os.Stat(filepath.Join(d, f)); err != nil {
			t.Fatalf("%s: %v (run `make build`)", filepath.Join(d, f), err)
		}
	}
	return d
}

// rigCommand runs `rig ARGS...` on the rig called name and returns its
// combined output.
func rigCommand(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(os.Getenv("MPIPAUSE_BIN"), "rig"), args...)
	cmd.Env = append(os.Environ(), "MPIPAUSE_RIG="+name)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// mustRig is rigCommand that fails the test on error.
func mustRig(t *testing.T, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := rigCommand(ctx, name, args...)
	if err != nil {
		t.Fatalf("rig %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// sharedRig brings the MPI tests' rig up once; TestMain takes it down.
func sharedRig(t *testing.T) {
	t.Helper()
	binDir(t)
	jobRigOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		var out string
		out, jobRigErr = rigCommand(ctx, jobRig, "up", fmt.Sprint(jobNodes))
		if jobRigErr != nil {
			jobRigErr = fmt.Errorf("%w\n%s", jobRigErr, out)
		}
		jobRigUp = true // down also cleans a half-made rig
	})
	if jobRigErr != nil {
		t.Fatalf("rig up %d: %v", jobNodes, jobRigErr)
	}
}

// waitFor polls cond until it holds, the deadline passes or stop closes: a
// readiness check on state the test can see, never a fixed sleep.
func waitFor(t *testing.T, what string, timeout time.Duration, stop <-chan struct{}, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		select {
		case <-stop:
			t.Fatalf("gave up waiting for %s: the job ended", what)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s after %v", what, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
