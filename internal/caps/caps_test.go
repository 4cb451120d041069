package caps

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestMissingAgreesWithProc checks Missing against the kernel's other
// account of the same set, CapEff in /proc/thread-self/status, whatever the
// test runs with (every capability as root, none under `make test-unit`).
func TestMissingAgreesWithProc(t *testing.T) {
	b, err := os.ReadFile("/proc/thread-self/status")
	if err != nil {
		t.Fatal(err)
	}
	var eff uint64
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			if eff, err = strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil {
				t.Fatal(err)
			}
		}
	}
	all := []Cap{BPF, Perfmon, NetAdmin, SysAdmin}
	var want []string
	for _, c := range all {
		if eff&(1<<c) == 0 {
			want = append(want, c.String())
		}
	}
	got, err := Missing(all...)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("Missing = %v; CapEff %016x says %v", got, eff, want)
	}
}

func TestString(t *testing.T) {
	for c, want := range map[Cap]string{SysAdmin: "CAP_SYS_ADMIN", BPF: "CAP_BPF", 7: "capability 7"} {
		if got := c.String(); got != want {
			t.Errorf("Cap(%d) = %q, want %q", uint(c), got, want)
		}
	}
}

// TestMissingByKernel: a capability the running kernel predates (CAP_BPF,
// CAP_PERFMON before 5.8) is judged as CAP_SYS_ADMIN, which granted what
// it does there; one the kernel has is judged as itself.
func TestMissingByKernel(t *testing.T) {
	set := func(cs ...Cap) func(Cap) bool { return func(c Cap) bool { return slices.Contains(cs, c) } }
	for _, tt := range []struct {
		name string
		last Cap
		has  func(Cap) bool
		want []string
	}{
		{"5.8+, all held", BPF, set(BPF, Perfmon, NetAdmin), nil},
		{"5.8+, only CAP_SYS_ADMIN", BPF, set(SysAdmin, NetAdmin), []string{"CAP_PERFMON", "CAP_BPF"}},
		{"before 5.8, CAP_SYS_ADMIN", 37, set(SysAdmin, NetAdmin), nil},
		{"before 5.8, without CAP_SYS_ADMIN", 37, set(NetAdmin), []string{"CAP_SYS_ADMIN (this kernel has no CAP_PERFMON)", "CAP_SYS_ADMIN (this kernel has no CAP_BPF)"}},
	} {
		if got := missing([]Cap{Perfmon, BPF, NetAdmin}, tt.last, tt.has); !slices.Equal(got, tt.want) {
			t.Errorf("%s: missing %q, want %q", tt.name, got, tt.want)
		}
	}
	if l := lastCap(); l < BPF {
		t.Errorf("this kernel's last capability %d, want %d or more (it runs 5.8+)", l, BPF)
	}
}
