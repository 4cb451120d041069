package testutil

import (
	"os"
	"testing"

	"github.com/mpipause/mpipause/internal/caps"
)

// PrivEnv is the variable that says privileges are expected: set (as
// make test and CI do), a privileged test that lacks them fails instead of
// skipping, so a CI run can never pass by silently skipping the kernel tier.
const PrivEnv = "MPIPAUSE_REQUIRE_PRIV"

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

// unavailable ends tb for want of something of the kernel's that the kernel
// tier needs, as RequirePrivileged does for capabilities: a failure when
// PrivEnv or CI is set, a skip otherwise.
func unavailable(tb testing.TB, format string, args ...any) {
	tb.Helper()
	if os.Getenv(PrivEnv) != "" || os.Getenv("CI") != "" {
		tb.Fatalf(format, args...)
	}
	tb.Skipf(format, args...)
}

// MissingCaps lists the capabilities from the kernel tier's set that the
// process lacks in its effective set.
func MissingCaps() []string {
	missing, err := caps.Missing(caps.BPF, caps.Perfmon, caps.NetAdmin, caps.SysAdmin)
	if err != nil {
		return []string{err.Error()}
	}
	return missing
}
