package loader

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
)

// fakeCgroup makes a directory standing in for a watched cgroup, with
// below cgroups under it and procs listed in its own cgroup.procs.
func fakeCgroup(t *testing.T, below int, procs []int) string {
	t.Helper()
	dir := t.TempDir()
	var b strings.Builder
	for _, p := range procs {
		b.WriteString(strconv.Itoa(p) + "\n")
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	for i := range below {
		d := filepath.Join(dir, fmt.Sprintf("c%d", i))
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// wantTooMany checks that err is the one clear failure of a bounded read:
// ErrTooMany, naming the cgroup and the bound.
func wantTooMany(t *testing.T, err error, dir string, bound int) {
	t.Helper()
	if !errors.Is(err, cgroupv2.ErrTooMany) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), strconv.Itoa(bound)) {
		t.Fatalf("err %v, want ErrTooMany naming %s and %d", err, dir, bound)
	}
}

// TestSnapshotTreeBound: the sock_diag observer's cgroup ids and both
// observers' followed namespaces come from the watched trees read within
// MaxBelow cgroups below the watched ones, all of them together, and
// MaxMembers processes; past either the read fails, naming the cgroup and
// the bound, rather than give the kernel check part of the job. A caller
// that named the trees itself (Config.Unbounded) reads past both.
func TestSnapshotTreeBound(t *testing.T) {
	bounded, unbounded := Config{}.limits(), Config{Unbounded: true}.limits()
	diag := func(limits cgroupv2.Bound, dirs ...string) *SockDiagObserver {
		d := &SockDiagObserver{ns: &netnsSet{limits: limits}, cgroups: map[uint64]string{}}
		for i, dir := range dirs {
			d.cgroups[uint64(i+1)] = dir
		}
		return d
	}
	self := []int{os.Getpid()}
	ok := fakeCgroup(t, MaxBelow, self)
	past := fakeCgroup(t, MaxBelow+1, self)
	half1, half2 := fakeCgroup(t, MaxBelow/2, self), fakeCgroup(t, MaxBelow/2+1, self)

	t.Run("sock_diag ids", func(t *testing.T) {
		d := diag(bounded, ok)
		if ids, err := d.treeIDs(); err != nil || len(ids) != MaxBelow+1 {
			t.Fatalf("a tree of %d below: %d ids, %v", MaxBelow, len(ids), err)
		}
		_, err := diag(bounded, past).treeIDs()
		wantTooMany(t, err, past, MaxBelow)
		_, err = diag(bounded, half1, half2).treeIDs()
		if !errors.Is(err, cgroupv2.ErrTooMany) {
			t.Fatalf("two trees of %d below in all: err %v, want ErrTooMany", MaxBelow+1, err)
		}
		if ids, err := diag(unbounded, past).treeIDs(); err != nil || len(ids) != MaxBelow+2 {
			t.Fatalf("unbounded, a tree of %d below: %d ids, %v", MaxBelow+1, len(ids), err)
		}
	})
	t.Run("followed namespaces", func(t *testing.T) {
		if ns, _, err := jobNetns([]string{ok}, bounded); err != nil || len(ns) != 1 {
			t.Fatalf("a tree of %d below: %v, %v", MaxBelow, ns, err)
		}
		_, _, err := jobNetns([]string{past}, bounded)
		wantTooMany(t, err, past, MaxBelow)
		if _, _, err := jobNetns([]string{half1, half2}, bounded); !errors.Is(err, cgroupv2.ErrTooMany) {
			t.Fatalf("two trees of %d below in all: err %v, want ErrTooMany", MaxBelow+1, err)
		}
		pids := make([]int, MaxMembers+1)
		for i := range pids {
			pids[i] = 4000000 + i
		}
		crowd := fakeCgroup(t, 0, pids)
		_, _, err = jobNetns([]string{crowd}, bounded)
		wantTooMany(t, err, crowd, MaxMembers)
		if _, _, err := jobNetns([]string{past, crowd}, unbounded); err != nil {
			t.Fatalf("unbounded, %d cgroups and %d processes: %v", MaxBelow+1, MaxMembers+1, err)
		}
		s := &netnsSet{follow: true, followed: map[uint64]netns{}, limits: bounded}
		s.setDirs([]string{past})
		_, err = s.list()
		wantTooMany(t, err, past, MaxBelow)
	})
}

// TestSnapshotTreeBoundKernel: on a real cgroup v2 tree, a job cgroup
// whose owner made MaxBelow+1 cgroups below it fails both observers'
// Snapshot (the BPF one through the namespaces it follows, the sock_diag
// one through those and its cgroup ids), naming the cgroup and the bound;
// at MaxBelow they read it.
func TestSnapshotTreeBoundKernel(t *testing.T) {
	testutil.RequirePrivileged(t)
	job := testutil.NewCgroup(t)
	sleeper := exec.Command("sleep", "600")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
	if err := cgroupv2.AddProc(job, sleeper.Process.Pid); err != nil {
		t.Fatal(err)
	}
	var last string
	for i := range MaxBelow + 1 {
		dir := filepath.Join(job, fmt.Sprintf("c%d", i))
		if err := cgroupv2.Create(dir); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cgroupv2.RemoveEmpty(dir) })
		last = dir
	}
	for _, kind := range []string{KindBPF, KindSockDiag} {
		t.Run(kind, func(t *testing.T) {
			if err := cgroupv2.Create(last); err != nil {
				t.Fatal(err)
			}
			o, err := Open(context.Background(), Config{Cgroups: []string{job}, FollowJob: true, Require: kind})
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			_, err = o.Snapshot(context.Background())
			wantTooMany(t, err, job, MaxBelow)
			if err := cgroupv2.RemoveEmpty(last); err != nil {
				t.Fatal(err)
			}
			if _, err := o.Snapshot(context.Background()); err != nil {
				t.Fatalf("a tree of %d cgroups below the job's: %v", MaxBelow, err)
			}
		})
	}
}
