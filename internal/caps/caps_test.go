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
