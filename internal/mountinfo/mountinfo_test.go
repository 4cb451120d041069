package mountinfo

import (
	"slices"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tt := range []struct {
		name string
		in   string
		want []Mount
	}{
		{
			name: "hybrid cgroup layout",
			in: `31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
`,
			want: []Mount{
				{Root: "/", Point: "/sys/fs/cgroup", FSType: "tmpfs", Source: "tmpfs", SuperOpts: "rw,mode=755"},
				{Root: "/", Point: "/sys/fs/cgroup/unified", FSType: "cgroup2", Source: "cgroup2", SuperOpts: "rw,nsdelegate"},
			},
		},
		{
			name: "optional fields before the separator",
			in:   "29 23 0:26 / /sys/fs/bpf rw,nosuid shared:4 master:1 - bpf bpf rw,mode=700\n",
			want: []Mount{{Root: "/", Point: "/sys/fs/bpf", FSType: "bpf", Source: "bpf", SuperOpts: "rw,mode=700"}},
		},
		{
			name: "escaped space, tab, newline and backslash",
			in:   `29 23 0:26 /a\040b /mnt/c\011d\012e\134f rw - cgroup2 my\040src rw` + "\n",
			want: []Mount{{Root: "/a b", Point: "/mnt/c\td\ne\\f", FSType: "cgroup2", Source: "my src", SuperOpts: "rw"}},
		},
		{
			name: "not an escape: kept as written",
			in:   `29 23 0:26 / /mnt/x\9y\4000\04 rw - tmpfs none rw` + "\n",
			want: []Mount{{Root: "/", Point: `/mnt/x\9y\4000\04`, FSType: "tmpfs", Source: "none", SuperOpts: "rw"}},
		},
		{
			name: "malformed lines left out",
			in:   "no separator here\n1 2 0:1 / - proc proc rw\n\n22 1 0:21 / /proc rw - proc\n",
			want: []Mount{{Root: "/", Point: "/proc", FSType: "proc"}},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(strings.NewReader(tt.in))
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Fatalf("Parse =\n%+v\nwant\n%+v", got, tt.want)
			}
		})
	}
}

// TestParseLongLine: a line past bufio's default 64 KiB is read, not an
// error that would hide every mount after it.
func TestParseLongLine(t *testing.T) {
	long := "/mnt/" + strings.Repeat("d", 100*1024)
	got, err := Parse(strings.NewReader("1 0 0:1 / " + long + " rw - tmpfs none rw\n2 0 0:2 / /sys/fs/bpf rw - bpf bpf rw\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Point != long || got[1].FSType != "bpf" {
		t.Fatalf("got %d mounts, want the long one and the bpffs", len(got))
	}
}

// TestReadSelf: this process's own table has the root filesystem and proc.
func TestReadSelf(t *testing.T) {
	ms, err := Read(Self)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(ms, func(m Mount) bool { return m.Point == "/" }) ||
		!slices.ContainsFunc(ms, func(m Mount) bool { return m.FSType == "proc" }) {
		t.Fatalf("no / or proc mount in %+v", ms)
	}
	if _, err := Read("/nonexistent/mountinfo"); err == nil {
		t.Fatal("Read of a missing file succeeded")
	}
}
