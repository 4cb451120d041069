package testutil

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// PrivEnv is the variable that says privileges are expected: set (as
// make test and CI do), a privileged test that lacks them fails instead of
// skipping, so a CI run can never pass by silently skipping the kernel tier.
const PrivEnv = "MPIPAUSE_REQUIRE_PRIV"

// Capabilities the kernel tier needs (linux/capability.h numbers).
const (
	capNetAdmin = 12
	capSysAdmin = 21
	capBPF      = 39
	capPerfmon  = 38
)

// RequirePrivileged skips t (or fails it, when PrivEnv or CI is set) unless
// the process holds CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN and CAP_SYS_ADMIN:
// what loading tracing programs, attaching to cgroups, mounting bpffs and
// entering network namespaces take.
func RequirePrivileged(tb testing.TB) {
	tb.Helper()
	missing := MissingCaps()
	if len(missing) == 0 {
		return
	}
	if os.Getenv(PrivEnv) != "" || os.Getenv("CI") != "" {
		tb.Fatalf("privileged test without privileges (missing %v); run as root", missing)
	}
	tb.Skipf("needs %v (run as root, or set %s=1 to make this a failure)", missing, PrivEnv)
}

// MissingCaps lists the capabilities from the kernel tier's set that the
// process lacks in its effective set.
func MissingCaps() []string {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return []string{"capget: " + err.Error()}
	}
	has := func(c uint) bool { return data[c/32].Effective&(1<<(c%32)) != 0 }
	var missing []string
	for _, c := range []struct {
		n    uint
		name string
	}{{capBPF, "CAP_BPF"}, {capPerfmon, "CAP_PERFMON"}, {capNetAdmin, "CAP_NET_ADMIN"}, {capSysAdmin, "CAP_SYS_ADMIN"}} {
		if !has(c.n) {
			missing = append(missing, c.name)
		}
	}
	return missing
}
