// Package loader loads mpipause's BPF programs, attaches them to a job's
// cgroup v2, pins them under a bpffs so that a daemon restart keeps their
// state, and reads the job's TCP connections back from the kernel.
//
// Two observers stand behind one interface: the BPF observer (sockops, a
// tp_btf program on state changes, iterators) and a sock_diag netlink fallback that is
// chosen automatically when BPF is not available. Both report the same
// [Conn]; [Open] picks one, [OpenBPF] and [OpenSockDiag] ask for one.
//
// The BPF observer keeps one entry per job connection in socket local
// storage (the conns map): sockops creates it when a process of the job's
// cgroup tree establishes a connection, the state-change program forgets it
// at close, and an iter/tcp pass, once per network namespace, adopts the
// connections the job had established before the programs were attached
// (the CLI attaches to running jobs). Snapshot then reads every connection,
// sequence numbers and the kernel's byte and retransmission counters
// together, in one pass of an iterator over
// the conns map, which costs in proportion to the job's sockets rather than
// to the machine's TCP hash table (bpf/README.md has the figures).
//
// The C sources are in bpf/; gen.go regenerates the committed bpf2go output.
package loader
