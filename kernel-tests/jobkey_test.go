package kerneltests

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
)

// TestJobKeyNotOnCommandLine (docs/security.md, job keys): a job's key is
// the one thing that lets a process join the job, and every user of a node
// can read every process's command line in /proc. So, for a 3 x 2 job of
// each library launched with `mpipause run` (the launcher starting the
// remote nodes' daemons through ssh), no process's command line on any node
// may hold the key, from before the launch until every rank has connected.
// The rig's nodes share the host's pid namespace, so one /proc holds them
// all; the test checks that (each rank's pid namespace is its own) and
// that its scan saw every rank's command line. The key itself is read from
// the ranks' environment (which only their owner and root can read): that
// every rank has the same one also shows the key reached them.
func TestJobKeyNotOnCommandLine(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { testJobKeyNotOnCommandLine(t, lib) })
	}
}

func testJobKeyNotOnCommandLine(t *testing.T, lib mpiLib) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	hold := t.TempDir()
	args := []string{"-m", "a2a", "-n", "20", "-s", "64K", "-w", hold}
	id := fmt.Sprintf("jobkey-%s-%d", lib.name, os.Getpid())

	// Every command line of every process, from before the launch: a
	// launcher may hand the key to a helper that is gone by the time the
	// ranks are up.
	scan := &cmdlineScan{seen: map[int][]string{}}
	stop := make(chan struct{})
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			scan.pass()
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	p := runJob(ctx, t, lib, id, app, args...)
	atHold(t, hold, 2*jobNodes, p)
	close(stop)
	<-scanned
	scan.pass() // once more, with every rank connected

	self, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	var key string
	var ranks []int
	for _, cg := range nodeJobCgroups(t, id) {
		b, err := os.ReadFile(filepath.Join(cg, "cgroup.procs"))
		if err != nil {
			t.Fatalf("job %s: %v", id, err)
		}
		for _, f := range strings.Fields(string(b)) {
			pid, _ := strconv.Atoi(f)
			ranks = append(ranks, pid)
			if ns, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid)); ns != self {
				t.Fatalf("rank %d (%s) is in pid namespace %q, not the test's %q: one /proc does not show every node", pid, cg, ns, self)
			}
			k := environVar(t, pid, ctl.TokenEnv)
			switch {
			case k == "":
				t.Fatalf("rank %d (%s) has no %s in its environment: the key did not reach it", pid, cg, ctl.TokenEnv)
			case key == "":
				key = k
			case k != key:
				t.Fatalf("rank %d (%s) has the job key %q, another rank %q", pid, cg, k, key)
			}
		}
	}
	if len(ranks) != 2*jobNodes {
		t.Fatalf("job %s has %d ranks in its cgroups, want %d: %v", id, len(ranks), 2*jobNodes, ranks)
	}
	// The key is "<coordinator>:<MAC>"; the MAC alone is the secret.
	_, secret, _ := strings.Cut(key, ":")
	if len(secret) < 32 {
		t.Fatalf("the job key %q has no MAC after its node name", key)
	}

	// The scanner is done (scanned): its results are the test's alone.
	for _, pid := range ranks {
		if !anyContains(scan.seen[pid], hold) {
			t.Errorf("the scan never read rank %d's command line (holding in %s): it does not cover every node", pid, hold)
		}
	}
	leaks := 0
	for pid, lines := range scan.seen {
		for _, l := range lines {
			if strings.Contains(l, secret) {
				leaks++
				t.Errorf("pid %d's command line holds job %s's key: %q", pid, id, l)
			}
		}
	}
	if leaks == 0 {
		t.Logf("%s: %d scans of /proc read %d processes' command lines (%d distinct) from before the launch until every rank connected; the job key (in all %d ranks' environments) is in none of them",
			lib.name, scan.passes, len(scan.seen), scan.lines, len(ranks))
	}

	release(t, hold)
	p.finish(ctx, t, "job "+id, serial(t, app, 2*jobNodes, args[:6]...))
}

// cmdlineScan collects the command lines of every process on the machine.
type cmdlineScan struct {
	mu     sync.Mutex
	seen   map[int][]string // pid: the distinct command lines it had
	passes int
	lines  int
}

func (s *cmdlineScan) pass() {
	ents, _ := os.ReadDir("/proc")
	s.mu.Lock()
	defer s.mu.Unlock()
	s.passes++
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil || len(b) == 0 {
			continue // gone, or a kernel thread
		}
		l := string(bytes.ReplaceAll(bytes.TrimSuffix(b, []byte{0}), []byte{0}, []byte{' '}))
		if !slices.Contains(s.seen[pid], l) {
			s.seen[pid] = append(s.seen[pid], l)
			s.lines++
		}
	}
}

// anyContains: one of lines mentions s.
func anyContains(lines []string, s string) bool {
	for _, l := range lines {
		if strings.Contains(l, s) {
			return true
		}
	}
	return false
}

// environVar is the value of name in pid's initial environment, "" if it
// has none.
func environVar(t *testing.T, pid int, name string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err != nil {
		t.Fatalf("rank %d: %v", pid, err)
	}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte(name+"=")); ok {
			return string(v)
		}
	}
	return ""
}
