// Package loader loads mpipause's BPF programs, attaches them to a job's
// cgroups v2, pins them under a bpffs so that a daemon restart keeps their
// state, and reads the job's TCP connections back from the kernel.
//
// A job is a set of cgroups: the ranks stay in the cgroups their resource
// manager made (one per rank under Slurm, a systemd scope), which appear as
// ranks start and go as they end. [Config].Cgroup and Cgroups give the set
// at [Open]; both observers are a [Watcher] too, whose Watch and Unwatch
// change it while Snapshot runs, and Watched lists it. Sockets of a
// watched cgroup or of a descendant of one are the job's; those of any
// other cgroup, a sibling's too, are not. The BPF observer attaches sockops
// to each watched cgroup with a bpf_link of its own (the kernel's
// BPF_F_ALLOW_MULTI: a manager's own programs stay), keeps the ids in its
// watched map, and with Pin keeps everything under
// <bpffs>/mpipause/job-<Config.Job>/ (one link_sockops_<cgroup-id> per
// cgroup), so that Open with the same Job after a restart watches every
// cgroup again; [Unpin] removes the whole directory. Without Job a job is
// its one cgroup, pinned under <bpffs>/mpipause/<cgroup-id>/ as before.
// Snapshot still costs one conns-map pass, and after a Watch or Unwatch
// one iter/tcp pass per network namespace, whatever the number of
// cgroups. Where the kernel refuses map iterators (ScansTCP), every
// Snapshot runs the iter/tcp pass in each namespace anyway, which reports
// only the sockets of watched cgroups. Which programs run is the running
// kernel's to say ([Probe], [Features]): each refused program has a
// fallback, down to Linux 5.10, where [Open] complements the programs
// with sock_diag ([Complemented]).
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
