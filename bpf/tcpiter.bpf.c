// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * tcpiter: an iter/tcp program that, in one pass over the TCP sockets of the
 * network namespace of the task that created the iterator, writes one
 * struct tcp_record per connection of the watched jobs, adopting (giving a
 * conns entry to) those established before sockops was attached.
 *
 * A socket belongs to a job when its cgroup is a watched cgroup or a
 * descendant of one. A socket of a watched cgroup without a conns entry is
 * one the job had established before mpipause attached (or before its
 * cgroup was watched): the pass adopts it. A socket with a conns entry whose
 * cgroup is not watched any more (Unwatch) loses its entry: the loader
 * runs the pass again after an Unwatch, so that conniter, which reads the
 * entries without a cgroup walk, stops seeing it.
 * Once a namespace has had its pass, conniter sees all of its job sockets;
 * the loader runs this pass once per namespace because it walks the whole
 * TCP established hash table, however few sockets the namespace has.
 *
 * bpf_iter_tcp_seq_show (net/ipv4/tcp_ipv4.c) runs the program with the
 * socket locked (lock_sock_fast) for full sockets, so the sequence numbers of
 * one record are consistent with each other, and with the counters that
 * conn_counts_init takes its bases from.
 */
#include "mpipause.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/*
 * sent_syn reports whether this end of an established connection opened
 * it, which decides whether bytes_acked counts a SYN (conn_counts_init).
 * Exact in SYN_SENT and SYN_RECV. Past them the kernel keeps no record of
 * it, but an accepted socket is a copy of its listener (sk_clone_lock),
 * sk_max_ack_backlog included, which is 0 on a socket that never
 * listened. Known limit: a socket accepted from a listener whose backlog
 * was 0 passes for the opener, and its bytes sent read one short (0 stays
 * 0). Only adopted connections need this; sockops is told by the kernel.
 */
static __always_inline bool sent_syn(const struct sock *sk)
{
	__u8 state = sk->__sk_common.skc_state;

	if (state == TCP_SYN_SENT)
		return true;
	if (state == TCP_SYN_RECV)
		return false;
	return sk->sk_max_ack_backlog == 0;
}

SEC("iter/tcp")
int mpipause_tcpiter(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	struct tcp_record rec = {};
	struct conn_info *c, init = {};
	struct tcp_sock *tp;
	struct cgroup *cgrp;
	struct sock *sk;

	if (!skc)
		return 0;
	/*
	 * TIME_WAIT and request sockets are not full sockets: they have no
	 * tcp_sock, no cgroup and no queues, and bpf_skc_to_tcp_sock returns
	 * NULL for them.
	 */
	tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0;
	sk = &tp->inet_conn.icsk_inet.sk;
	if (skc->skc_state == TCP_LISTEN || skc->skc_state == TCP_CLOSE)
		return 0;
	if (skc->skc_family != AF_INET && skc->skc_family != AF_INET6)
		return 0;

	cgrp = sk_cgroup(sk);
	c = bpf_sk_storage_get(&conns, sk, NULL, 0);
	if (!in_watched(cgrp)) {
		if (c) {
			conn_unlist(c->cookie);
			bpf_sk_storage_delete(&conns, sk);
		}
		return 0;
	}
	if (!c) {
		init.cookie = bpf_get_socket_cookie(sk);
		init.cgroup_id = cgroup_id(cgrp);
		init.flags = CONN_F_ADOPTED;
		conn_counts_init(&init, tp, sent_syn(sk));
		c = bpf_sk_storage_get(&conns, sk, &init, BPF_SK_STORAGE_GET_F_CREATE);
		if (!c)
			return 0;
	}
	/* Listed again at every pass: an entry lost to a full list comes back. */
	conn_list(skc, c);
	fill_record(&rec, tp, c);
	bpf_seq_write(ctx->meta->seq, &rec, sizeof(rec));
	return 0;
}
