// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * sockops: attached to a job's cgroup v2, registers every TCP connection a
 * process of the cgroup (or of a descendant) establishes, and forgets it when
 * the socket reaches TCP_CLOSE.
 *
 * Connections established before the program was attached are never seen
 * here; tcpiter adopts them by cgroup.
 */
#include "mpipause.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/*
 * record registers the connection; active is whether this end sent the
 * SYN. The callback runs with the socket locked, which conn_counts_init
 * needs.
 */
static __always_inline void record(struct bpf_sock_ops *ctx, bool active)
{
	struct conn_info *c, init = {};
	struct bpf_sock *bsk = ctx->sk;
	struct tcp_sock *tp;

	if (!bsk)
		return;
	tp = bpf_skc_to_tcp_sock(bsk);
	if (!tp)
		return;
	init.cookie = bpf_get_socket_cookie(ctx);
	init.cgroup_id = cgroup_id(sk_cgroup(&tp->inet_conn.icsk_inet.sk));
	init.established_ns = bpf_ktime_get_boot_ns();
	init.flags = CONN_F_SOCKOPS;
	conn_counts_init(&init, tp, active);
	/*
	 * Created whole, so that conniter never sees a half-filled entry. One
	 * may exist already (tcpiter adopted the socket in SYN_SENT): claim it.
	 */
	c = bpf_sk_storage_get(&conns, bsk, &init, BPF_SK_STORAGE_GET_F_CREATE);
	if (!c)
		return;
	*c = init;
	conn_list(&tp->inet_conn.icsk_inet.sk.__sk_common, &init);
}

#ifndef SOL_TCP
#define SOL_TCP 6
#endif

/*
 * A pause commits only when nothing is unacknowledged, and the last small
 * segment a rank sends before its gate closes is acknowledged by a delayed
 * ACK: up to 40 ms later when the receiver has nothing to send back, which
 * was most of a pause's drain on the rig. Capping the delay bounds that
 * wait; the kernel refuses less than two jiffies (8 ms at HZ=250), hence the
 * second try. Bulk transfers are unaffected (they ACK every other segment),
 * an idle connection sends at most one more ACK per cap.
 */
static void cap_delayed_ack(struct bpf_sock_ops *ctx)
{
	int us = 8000;

	if (bpf_setsockopt(ctx, SOL_TCP, TCP_BPF_DELACK_MAX, &us, sizeof(us)) != 0) {
		us = 20000; /* HZ=100 */
		bpf_setsockopt(ctx, SOL_TCP, TCP_BPF_DELACK_MAX, &us, sizeof(us));
	}
}

/*
 * note_fin notes a FIN of a connection sockops registered, as sockstat
 * does for every job connection: the callback runs before the new state
 * is stored, like the tracepoint, with the socket locked. Kernels before
 * 5.11 give tracing programs no socket storage, so sockstat does not load
 * there, and this is what keeps the byte counts of registered connections
 * exact (conn_note_fin notes each FIN once, whichever program is first).
 */
static __always_inline void note_fin(struct bpf_sock *bsk, int newstate)
{
	struct conn_info *c;
	struct tcp_sock *tp;

	if (newstate != BPF_TCP_FIN_WAIT1 && newstate != BPF_TCP_LAST_ACK &&
	    newstate != BPF_TCP_CLOSE_WAIT && newstate != BPF_TCP_CLOSING)
		return;
	c = bpf_sk_storage_get(&conns, bsk, NULL, 0);
	if (!c)
		return;
	tp = bpf_skc_to_tcp_sock(bsk);
	if (tp)
		conn_note_fin(c, tp, newstate);
}

SEC("sockops")
int mpipause_sockops(struct bpf_sock_ops *ctx)
{
	struct bpf_sock *bsk;

	if (ctx->family != AF_INET && ctx->family != AF_INET6)
		return 1;

	switch (ctx->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		record(ctx, ctx->op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB);
		cap_delayed_ack(ctx);
		/* Ask for BPF_SOCK_OPS_STATE_CB on every later state change. */
		bpf_sock_ops_cb_flags_set(ctx,
					  ctx->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		/* args[0] is the old state, args[1] the new one. */
		bsk = ctx->sk;
		if (!bsk)
			break;
		if (ctx->args[1] == BPF_TCP_CLOSE) {
			conn_unlist(bpf_get_socket_cookie(ctx));
			bpf_sk_storage_delete(&conns, bsk);
		} else
			note_fin(bsk, ctx->args[1]);
		break;
	}
	return 1;
}
