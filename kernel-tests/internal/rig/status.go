package rig

import (
	"net/netip"
	"os"

	"github.com/mpipause/mpipause/kernel-tests/internal/links"
)

// NodeStatus is what `rig status` shows of one node.
type NodeStatus struct {
	Name   string `json:"name"`
	Netns  string `json:"netns"`
	Addr   string `json:"addr"`
	Exists bool   `json:"exists"`  // the network namespace is bound
	LinkUp bool   `json:"link_up"` // eth0 is up and has its address
	Procs  int    `json:"procs"`   // processes in the node
	// The node's mpid as recorded by up (0: none, as with --no-mpid), and
	// whether it runs and has written its ready file.
	MPIDPid   int  `json:"mpid_pid"`
	MPIDAlive bool `json:"mpid_alive"`
	MPIDReady bool `json:"mpid_ready"`
}

// Status is what `rig status` shows.
type Status struct {
	Name   string       `json:"name"`
	Up     bool         `json:"up"`
	Dir    string       `json:"dir"`
	Bridge string       `json:"bridge_netns"`
	Nodes  []NodeStatus `json:"nodes"`
}

// Status reports the rig's state as found in the kernel, not only as
// recorded: a node whose namespace vanished shows as not existing, a
// recorded mpid that died as not alive (and the rig as not up).
func (r *Rig) Status() (*Status, error) {
	s := &Status{Name: r.cfg.Name, Dir: r.Dir(), Bridge: r.BridgeNetns()}
	st, err := r.Load()
	if err != nil {
		return s, nil // not up: nothing more to say
	}
	s.Up = true
	for i := 0; i < st.Nodes; i++ {
		ns := NodeStatus{Name: NodeName(i), Netns: r.NodeNetns(i), Addr: r.NodeAddr(i).String()}
		if links.NetnsExists(ns.Netns) {
			ns.Exists = true
			if h, err := links.OpenNetns(ns.Netns); err == nil {
				ls, _ := h.Links()
				h.Close()
				want := netip.PrefixFrom(r.NodeAddr(i), r.cfg.Subnet.Bits())
				for _, l := range ls {
					if l.Name == nodeIf && l.Up && containsPrefix(l.Addrs, want) {
						ns.LinkUp = true
					}
				}
			}
			pids, _ := netnsPids(ns.Netns)
			ns.Procs = len(pids)
		}
		if d, ok := st.daemon(ns.Name); ok {
			ns.MPIDPid, ns.MPIDAlive = d.Pid, d.alive()
			_, err := os.Stat(d.Ready)
			ns.MPIDReady = ns.MPIDAlive && err == nil
		}
		if !ns.Exists || !ns.LinkUp || ns.MPIDPid != 0 && !ns.MPIDAlive {
			s.Up = false
		}
		s.Nodes = append(s.Nodes, ns)
	}
	return s, nil
}

func containsPrefix(ps []netip.Prefix, p netip.Prefix) bool {
	for _, x := range ps {
		if x == p {
			return true
		}
	}
	return false
}
