package rig

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/mountinfo"
)

// InitNodeCommand is the hidden subcommand of the rig binary that `up` runs
// once per node, inside the node's new mount, UTS and network namespaces,
// with a JSON NodeSpec as its argument. It calls InitNode.
const InitNodeCommand = "_init-node"

// NodeSpec says what a node's mount namespace needs. Up derives it from the
// host's mounts.
type NodeSpec struct {
	Hostname string `json:"hostname"`
	// EtcDir holds files bound over their namesakes in /etc (hosts), as
	// `ip netns exec` does with /etc/netns/<name>/.
	EtcDir string `json:"etc_dir"`
	// BPFDir is the node's directory in the rig's bpffs, bound on /sys/fs/bpf.
	BPFDir string `json:"bpf_dir"`
	// Cgroup2 is where the host mounts cgroup v2 (/sys/fs/cgroup on unified
	// hosts, /sys/fs/cgroup/unified on hybrid ones) and Cgroup2Opts its
	// superblock options, which a second mount must repeat: cgroup2 applies
	// the options of each new mount to the one shared superblock.
	Cgroup2     string `json:"cgroup2,omitempty"`
	Cgroup2Opts string `json:"cgroup2_opts,omitempty"`
	// Tracefs is where the host mounts tracefs under /sys, if it does.
	Tracefs string `json:"tracefs,omitempty"`
	// RunDir is the node's own directory, bound on NodeRunMount.
	RunDir string `json:"run_dir,omitempty"`
}

// nodeSpecFromHost fills the host-derived fields of a NodeSpec.
func nodeSpecFromHost(mounts []mountinfo.Mount) NodeSpec {
	var s NodeSpec
	for _, m := range mounts {
		switch {
		case m.FSType == "cgroup2" && m.Root == "/" && s.Cgroup2 == "":
			s.Cgroup2 = m.Point
			s.Cgroup2Opts = dropOpts(m.SuperOpts, "rw", "ro")
		case m.FSType == "tracefs" && strings.HasPrefix(m.Point, "/sys/") && s.Tracefs == "":
			s.Tracefs = m.Point
		}
	}
	return s
}

// InitNode sets up a node's mount and UTS namespaces; the caller is already
// in them and in the node's network namespace, and they are fresh copies of
// the host's (propagation slave, so nothing mounted here reaches the host).
//
//   - host name;
//   - /sys: a sysfs of the node's network namespace, as `ip netns exec`
//     mounts, so /sys/class/net lists the node's own interfaces. It hides
//     everything mounted under the host's /sys, hence:
//   - cgroup v2 again at the host's place, so cgroup paths read the same in
//     and out of the node (same hierarchy: no cgroup namespace);
//   - the node's directory of the rig's bpffs on /sys/fs/bpf, where a daemon
//     looks for a bpffs and where its pins outlive its restarts;
//   - tracefs again if the host has it under /sys;
//   - every file of EtcDir bound over /etc/<file> (the node's /etc/hosts);
//   - RunDir on /run/mpipause (NodeRunMount), mpid's sockets and state: the
//     node's own, as on a machine of its own (the mount point is made on
//     the host if missing, and never removed: see Down).
func InitNode(spec NodeSpec) error {
	if err := unix.Sethostname([]byte(spec.Hostname)); err != nil {
		return fmt.Errorf("set host name: %w", err)
	}
	if err := unix.Unmount("/sys", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount host /sys: %w", err)
	}
	if err := unix.Mount("sysfs", "/sys", "sysfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount node /sys: %w", err)
	}
	if spec.Cgroup2 != "" {
		if err := mountCgroup2(spec.Cgroup2, spec.Cgroup2Opts); err != nil {
			return err
		}
	}
	if spec.BPFDir != "" {
		if err := unix.Mount(spec.BPFDir, "/sys/fs/bpf", "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s on /sys/fs/bpf: %w", spec.BPFDir, err)
		}
	}
	if spec.Tracefs != "" {
		if err := unix.Mount("tracefs", spec.Tracefs, "tracefs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			return fmt.Errorf("mount tracefs on %s: %w", spec.Tracefs, err)
		}
	}
	if spec.RunDir != "" {
		if err := os.MkdirAll(NodeRunMount, 0o755); err != nil {
			return fmt.Errorf("make %s: %w", NodeRunMount, err)
		}
		if err := unix.Mount(spec.RunDir, NodeRunMount, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s on %s: %w", spec.RunDir, NodeRunMount, err)
		}
	}
	if spec.EtcDir != "" {
		ents, err := os.ReadDir(spec.EtcDir)
		if err != nil {
			return fmt.Errorf("read %s: %w", spec.EtcDir, err)
		}
		for _, e := range ents {
			src, dst := filepath.Join(spec.EtcDir, e.Name()), filepath.Join("/etc", e.Name())
			if _, err := os.Stat(dst); errors.Is(err, os.ErrNotExist) {
				if err := os.WriteFile(dst, nil, 0o644); err != nil {
					return fmt.Errorf("create %s: %w", dst, err)
				}
			}
			if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
				return fmt.Errorf("bind %s on %s: %w", src, dst, err)
			}
		}
	}
	return nil
}

// mountCgroup2 mounts cgroup v2 at dir inside the fresh /sys. The new sysfs
// has an empty /sys/fs/cgroup; on a hybrid host the v2 mount point is a
// directory below it, which sysfs cannot hold, so a tmpfs goes there first,
// as on the host.
func mountCgroup2(dir, opts string) error {
	const base = "/sys/fs/cgroup"
	if dir != base && strings.HasPrefix(dir, base+"/") {
		if err := unix.Mount("tmpfs", base, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=755"); err != nil {
			return fmt.Errorf("mount tmpfs on %s: %w", base, err)
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("make %s: %w", dir, err)
		}
	} else if !strings.HasPrefix(dir, "/sys/") {
		return nil // not under /sys: the host's mount is still visible
	}
	if err := unix.Mount("cgroup2", dir, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return fmt.Errorf("mount cgroup2 on %s: %w", dir, err)
	}
	return nil
}

// RunInitNode is InitNodeCommand's body: decode the spec and apply it.
func RunInitNode(arg string) error {
	var spec NodeSpec
	if err := json.Unmarshal([]byte(arg), &spec); err != nil {
		return fmt.Errorf("%s: bad spec: %w", InitNodeCommand, err)
	}
	return InitNode(spec)
}

func isMountPoint(mounts []mountinfo.Mount, dir string) bool {
	for _, m := range mounts {
		if m.Point == dir {
			return true
		}
	}
	return false
}

// dropOpts removes the named options from a comma-separated list.
func dropOpts(opts string, drop ...string) string {
	var keep []string
	for _, o := range strings.Split(opts, ",") {
		if o != "" && !contains(drop, o) {
			keep = append(keep, o)
		}
	}
	return strings.Join(keep, ",")
}
