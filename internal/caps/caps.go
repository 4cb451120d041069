// Package caps reads the calling thread's effective capabilities: what
// loader checks before it loads BPF or enters a network namespace, and what
// the test suite's privilege gate checks (internal/testutil). Being root is
// not enough: `setpriv --inh-caps=-all` and containers drop capabilities
// from uid 0, so the check is on the capability, never on the uid.
package caps

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Cap is a capability number (include/uapi/linux/capability.h).
type Cap uint

// The capabilities mpipause needs.
const (
	NetAdmin  Cap = 12 // attach to cgroups, bring links up
	SysPtrace Cap = 19 // /proc/PID/ns/net of another user's process
	SysAdmin  Cap = 21 // setns(2), mount(2)
	SysNice   Cap = 23 // a negative niceness, SCHED_RR
	Perfmon   Cap = 38 // tracing programs
	BPF       Cap = 39 // load programs, make maps
)

var names = map[Cap]string{
	NetAdmin:  "CAP_NET_ADMIN",
	SysPtrace: "CAP_SYS_PTRACE",
	SysAdmin:  "CAP_SYS_ADMIN",
	SysNice:   "CAP_SYS_NICE",
	Perfmon:   "CAP_PERFMON",
	BPF:       "CAP_BPF",
}

func (c Cap) String() string {
	if n, ok := names[c]; ok {
		return n
	}
	return fmt.Sprintf("capability %d", uint(c))
}

// Missing lists the capabilities of want, in want's order, that the calling
// thread lacks in its effective set. A capability the running kernel does
// not have (CAP_BPF and CAP_PERFMON came with Linux 5.8; before them
// CAP_SYS_ADMIN grants what they do) is judged as CAP_SYS_ADMIN.
func Missing(want ...Cap) ([]string, error) {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return nil, fmt.Errorf("capget: %w", err)
	}
	return missing(want, lastCap(), func(c Cap) bool { return c < 64 && data[c/32].Effective&(1<<(c%32)) != 0 }), nil
}

// missing is Missing over the kernel's last capability and a thread's
// effective set (has).
func missing(want []Cap, last Cap, has func(Cap) bool) []string {
	var out []string
	for _, c := range want {
		switch {
		case c <= last && !has(c):
			out = append(out, c.String())
		case c > last && !has(SysAdmin):
			out = append(out, fmt.Sprintf("%s (this kernel has no %s)", SysAdmin, c))
		}
	}
	return out
}

// lastCap is the highest capability the running kernel has
// (/proc/sys/kernel/cap_last_cap); if it cannot be read, every capability
// named here is taken to exist.
func lastCap() Cap {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return BPF
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 {
		return BPF
	}
	return Cap(n)
}
