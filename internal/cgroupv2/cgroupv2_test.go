package cgroupv2

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
)

func TestRootFrom(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    string
		wantErr error
	}{
		{
			name: "hybrid",
			in: `31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
`,
			want: "/sys/fs/cgroup/unified",
		},
		{
			name: "unified with optional fields",
			in:   "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
			want: "/sys/fs/cgroup",
		},
		{
			name: "escaped space",
			in:   "29 23 0:26 / /mnt/cg\\040two rw - cgroup2 none rw\n",
			want: "/mnt/cg two",
		},
		{
			name:    "bind mount of a sub-tree is not the root",
			in:      "29 23 0:26 /job /mnt/job rw - cgroup2 none rw\n",
			wantErr: ErrNotMounted,
		},
		{
			name:    "none",
			in:      "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n",
			wantErr: ErrNotMounted,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := rootFrom(strings.NewReader(tt.in))
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("err = %v, want %v", err, tt.wantErr)
			}
			if got != tt.want {
				t.Fatalf("root = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestTreeIDs(t *testing.T) {
	// Any directory tree will do: a cgroup's id is its directory's inode
	// number, which is what TreeIDs reads.
	root := t.TempDir()
	for _, d := range []string{"a/b", "a/c/d", "e"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "a", "cgroup.procs"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var want []uint64
	for _, d := range []string{"", "a", "a/b", "a/c", "a/c/d", "e"} {
		id, err := ID(filepath.Join(root, d))
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, id)
	}

	got, err := TreeIDs(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) == 0 || got[0] != want[0] {
		t.Fatalf("TreeIDs(%s) = %v, want the root's id %d first", root, got, want[0])
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("TreeIDs(%s) = %v, want %v", root, got, want)
	}

	if _, err := TreeIDs(filepath.Join(root, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("TreeIDs(missing) err = %v, want ErrNotExist", err)
	}
}

func TestTreeIDsCgroup(t *testing.T) {
	testutil.RequirePrivileged(t)
	root, err := Root()
	if err != nil {
		t.Fatal(err)
	}
	job := filepath.Join(root, fmt.Sprintf("mpipause-test-treeids-%d", os.Getpid()))
	child := filepath.Join(job, "rank0")
	if err := Create(child); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Remove(child); err != nil {
			t.Error(err)
		}
		if err := Remove(job); err != nil {
			t.Error(err)
		}
	})
	jobID, err := ID(job)
	if err != nil {
		t.Fatal(err)
	}
	childID, err := ID(child)
	if err != nil {
		t.Fatal(err)
	}
	got, err := TreeIDs(job)
	if err != nil {
		t.Fatal(err)
	}
	if want := []uint64{jobID, childID}; !slices.Equal(got, want) {
		t.Fatalf("TreeIDs(%s) = %v, want %v", job, got, want)
	}
}

func TestFreezeThaw(t *testing.T) {
	testutil.RequirePrivileged(t)
	root, err := Root()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, fmt.Sprintf("mpipause-test-freeze-%d", os.Getpid()))
	if err := Create(dir); err != nil {
		t.Fatal(err)
	}
	fd, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	// A process that spins in user space and one asleep in a system call.
	var procs []*exec.Cmd
	for _, script := range []string{"while :; do :; done", "sleep 1000"} {
		c := exec.Command("sh", "-c", script)
		c.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd())}
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		procs = append(procs, c)
	}
	t.Cleanup(func() {
		Thaw(context.Background(), dir)
		for _, c := range procs {
			c.Process.Kill()
			c.Wait()
		}
		if err := Remove(dir); err != nil {
			t.Error(err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := Freeze(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if f, err := Frozen(dir); err != nil || !f {
		t.Fatalf("after Freeze: frozen %v, %v", f, err)
	}
	if err := Freeze(ctx, dir); err != nil { // idempotent
		t.Fatal(err)
	}
	if err := Thaw(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if f, err := Frozen(dir); err != nil || f {
		t.Fatalf("after Thaw: frozen %v, %v", f, err)
	}
	if err := Freeze(ctx, filepath.Join(dir, "nonexistent")); err == nil {
		t.Error("Freeze of a missing cgroup succeeded")
	}
}
