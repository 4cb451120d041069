// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * sockstat: follows the state changes of the job's connections: forgets a
 * connection when its socket reaches TCP_CLOSE, and records where its FINs
 * sit, which fill_record needs to count the application's bytes exactly.
 *
 * inet_sock_set_state fires for every inet socket of the machine, but only
 * when a state changes, a few times in a connection's life. There are no
 * programs on the send and receive paths any more: the byte counters come
 * from tcp_sock at snapshot time (fill_record), because tp_btf programs on
 * sock_send_length/sock_recv_length ran on every socket call of the whole
 * machine, about 100 ns a call for each loaded set, which cost MPI
 * ping-pongs 3% of their latency.
 */
#include "mpipause.h"
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/*
 * At TCP_CLOSE the entry goes, and its connlist entry with it. sockops
 * does the same for what it registered; this also covers the adopted entries, whose sockets sockops
 * never asked state callbacks for. (The entry would also go when the
 * socket is freed, but a socket the application has not closed yet can
 * sit in TCP_CLOSE indefinitely.)
 */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(mpipause_state, struct sock *sk, int oldstate, int newstate)
{
	struct conn_info *c;
	struct tcp_sock *tp;

	switch (newstate) {
	case TCP_CLOSE:
		if (!is_inet_tcp(sk))
			return 0;
		c = bpf_sk_storage_get(&conns, sk, NULL, 0);
		if (c) {
			conn_unlist(c->cookie);
			bpf_sk_storage_delete(&conns, sk);
		}
		return 0;
	case TCP_FIN_WAIT1:
	case TCP_LAST_ACK:
	case TCP_CLOSE_WAIT:
	case TCP_CLOSING:
		break;
	default:
		return 0;
	}
	if (!is_inet_tcp(sk))
		return 0;
	c = bpf_sk_storage_get(&conns, sk, NULL, 0);
	if (!c)
		return 0;
	tp = bpf_skc_to_tcp_sock(sk);
	if (tp)
		conn_note_fin(c, tp, newstate);
	return 0;
}
