// Package rig runs a cluster of "nodes" on one machine for mpipause's
// multi-node tests: each node is a network namespace with its own loopback,
// an eth0 on a shared bridge, a host name, a mount namespace that shows the
// node's own /sys (with cgroup v2 and a bpffs put back), its own
// /run/mpipause (its mpid's sockets and state) and an /etc/hosts that names
// every node.
//
// Layout of a rig named R (R is "default" unless MPIPAUSE_RIG says otherwise):
//
//	netns nodeK (R-nodeK)     eth0 10.77.0.(K+1)/24, lo; hostname nodeK
//	netns mpipause-rig(-R)    bridge br0 with one veth port per node
//	/run/mpipause-rig/R/      state: ns/ (mount and UTS namespaces of the
//	                          nodes, bound to files), bpf/ (a bpffs, one
//	                          directory per node), run/nodeK (node K's
//	                          /run/mpipause), ssh (launcher agent),
//	                          mpid-nodeK.log and .ready (node K's daemon)
//	/etc/netns/<netns>/hosts  the node's /etc/hosts
//	<cgroup2>/mpipause-rig/R/nodeK  the cgroups of node K's daemon
//
// Up starts bin/mpid in every node, detached, and waits for their ready
// files (daemon.go); Down stops them before it kills what is left.
//
// The bridge lives in a namespace of its own rather than in the host's, so a
// rig adds nothing to the host's interfaces, routes or firewall, its traffic
// can never leave the machine, and two rigs (a user's and a test's) can use
// the same subnet side by side.
//
// Commands enter a node with nsenter(1) into the node's network, mount and
// UTS namespaces, so every process of a node, whoever started it, sees the
// same mounts and host name, as on a real machine. `ip netns exec` instead
// makes a fresh mount namespace per command and remounts /sys, which hides
// cgroup v2 and bpffs from the daemon that later runs in each node.
package rig
