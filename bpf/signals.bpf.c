// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * signals: when the kernel generated the last SIGTSTP and the last SIGCONT
 * for each process mpid registered as a rank (rank_signals, keyed by tgid,
 * filled and emptied by mpid).
 *
 * A rank's signal handler stamps its request when it runs, and a handler
 * can run long after its signal was generated: one whose frame was built
 * as a freeze caught the thread runs after the thaw, after the SIGCONT
 * that ended the stop. Only the generation order says which came first
 * (internal/mpid/signals.go).
 *
 * signal_generate fires for every signal sent on the machine; anything but
 * SIGTSTP and SIGCONT returns at the first compare, and those two cost one
 * hash lookup.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Not in vmlinux.h: they are macros in the kernel. */
#define SIGCONT 18
#define SIGTSTP 20

/*
 * Processes watched at once by one mpid: more than its users may register
 * as ranks (4,096 each) on any node that runs a few users' jobs. Entries
 * are made as ranks register, so the map costs what it holds.
 */
#define MAX_RANK_PROCS 65536

/* bpf_ktime_get_ns: CLOCK_MONOTONIC, the clock the shim stamps with. */
struct signal_times {
	__u64 tstp_ns; /* the last SIGTSTP generated for the process; 0: none */
	__u64 cont_ns; /* the last SIGCONT; 0: none */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, MAX_RANK_PROCS);
	__type(key, __u32); /* tgid */
	__type(value, struct signal_times);
} rank_signals SEC(".maps");

/*
 * Every outcome counts (delivered, already pending, ignored): a SIGCONT
 * discards the pending stop signals whatever becomes of it, and a SIGTSTP
 * merged into a pending one is still a later suspend. The kernel calls
 * this under the target's siglock, so two writes to one entry do not race.
 */
SEC("tp_btf/signal_generate")
int BPF_PROG(mpipause_signal, int sig, struct kernel_siginfo *info, struct task_struct *task,
	     int group, int result)
{
	struct signal_times *t;
	__u32 tgid;

	if (sig != SIGTSTP && sig != SIGCONT)
		return 0;
	tgid = task->tgid;
	t = bpf_map_lookup_elem(&rank_signals, &tgid);
	if (!t)
		return 0;
	if (sig == SIGTSTP)
		t->tstp_ns = bpf_ktime_get_ns();
	else
		t->cont_ns = bpf_ktime_get_ns();
	return 0;
}
