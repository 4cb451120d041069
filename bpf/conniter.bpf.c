// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * conniter: an iter/bpf_sk_storage_map program over the conns map that
 * produces one struct tcp_record per job connection, in every network
 * namespace at once.
 *
 * It visits only the sockets that have a conns entry, so its cost grows with
 * the job, not with the machine: iter/tcp walks the whole established hash
 * table (262,144 buckets here, shared by all namespaces) on every pass,
 * which alone cost several milliseconds.
 *
 * Records go into the mmapable records array, at the index of the object in
 * the pass, not through bpf_seq_write: the seq_file buffer holds 32 KiB, and
 * every time it fills, read(2) returns and the next read restarts the walk
 * of the current map bucket from its head (bpf_sk_storage_map_seq_find_next
 * skips elements by count). With few buckets (two on a 2-CPU machine) that
 * made the pass quadratic. Writing nothing to the seq_file, the whole pass
 * runs in one read. The seq_file carries only the pass's framing and what
 * does not fit in the array: an 8-byte mark at the first object, records
 * past MAX_RECORDS, and at the end the index of the last object (meta
 * seq_num: the call after the last object sees the last object's index, and
 * 0 when there was none, hence the mark).
 *
 * The socket is not locked here (unlike iter/tcp); fill_record reads the
 * sequence numbers in an order that keeps the queue lengths it implies
 * non-negative, and derives the byte counters so that they never go
 * backwards. Entries leave the map when their socket reaches TCP_CLOSE
 * (sockops, sockstat) or is freed.
 */
#include "mpipause.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* kernel/bpf/helpers.c, Linux 6.2+ */
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;

/* Records of one pass, by object index; read by the loader through mmap. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, MAX_RECORDS);
	__type(key, __u32);
	__type(value, struct tcp_record);
} records SEC(".maps");

/*
 * conniter_pass is the programs' body; cast says how the visited socket
 * becomes its tcp_sock.
 */
static __always_inline int conniter_pass(struct bpf_iter__bpf_sk_storage_map *ctx, bool cast)
{
	struct seq_file *seq = ctx->meta->seq;
	__u64 n = ctx->meta->seq_num;
	struct conn_info *c = ctx->value;
	struct sock *sk = ctx->sk;
	struct tcp_record *rec, spill;
	struct tcp_sock *tp;
	__u32 idx = n;

	if (!sk) {
		/* The call after the last object. */
		bpf_seq_write(seq, &n, sizeof(n));
		return 0;
	}
	if (n == 0)
		bpf_seq_write(seq, &n, sizeof(n));
	rec = n < MAX_RECORDS ? bpf_map_lookup_elem(&records, &idx) : NULL;
	if (!rec) {
		__builtin_memset(&spill, 0, sizeof(spill));
		rec = &spill;
	} else {
		__builtin_memset(rec, 0, sizeof(*rec));
	}
	if (c) {
		/*
		 * Only TCP sockets get a conns entry, so a cast will do; unlike
		 * bpf_skc_to_tcp_sock it reads nothing (sk_protocol is one more
		 * cache line). The result is read-only and its loads fault-safe.
		 */
		if (cast)
			tp = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct tcp_sock));
		else
			tp = bpf_skc_to_tcp_sock(sk);
		if (tp)
			fill_record(rec, tp, c);
	}
	if (rec == &spill)
		bpf_seq_write(seq, &spill, sizeof(spill));
	return 0;
}

SEC("iter/bpf_sk_storage_map")
int mpipause_conniter(struct bpf_iter__bpf_sk_storage_map *ctx)
{
	return conniter_pass(ctx, true);
}

/*
 * The same pass where the kernel lacks bpf_rdonly_cast (before 6.2): the
 * helper costs one cache line of the socket more. The loader loads one of
 * the two.
 */
SEC("iter/bpf_sk_storage_map")
int mpipause_conniter_skc(struct bpf_iter__bpf_sk_storage_map *ctx)
{
	return conniter_pass(ctx, false);
}
