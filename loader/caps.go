package loader

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Capability numbers (include/uapi/linux/capability.h).
const (
	capNetAdmin = 12
	capSysAdmin = 21
	capPerfmon  = 38
	capBPF      = 39
)

var capNames = map[uint]string{
	capNetAdmin: "CAP_NET_ADMIN",
	capSysAdmin: "CAP_SYS_ADMIN",
	capPerfmon:  "CAP_PERFMON",
	capBPF:      "CAP_BPF",
}

// missingCaps lists the capabilities of want that the calling thread lacks
// in its effective set. Being root is not enough: `setpriv --inh-caps=-all`
// and containers drop capabilities from uid 0.
func missingCaps(want ...uint) ([]string, error) {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return nil, fmt.Errorf("capget: %w", err)
	}
	var missing []string
	for _, c := range want {
		if data[c/32].Effective&(1<<(c%32)) == 0 {
			missing = append(missing, capNames[c])
		}
	}
	return missing, nil
}
