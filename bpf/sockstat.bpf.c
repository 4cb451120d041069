// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * sockstat: counts, per job connection, the bytes the application handed to
 * sendmsg and got from recvmsg, and the retransmissions, so that a byte that
 * moves while the shim says a socket is gated is seen by the kernel itself.
 *
 * sock:sock_send_length and sock:sock_recv_length fire in
 * sock_sendmsg_nosec/sock_recvmsg_nosec (net/socket.c, Linux 6.3+) for every
 * socket of the system, with the return value of the protocol's
 * sendmsg/recvmsg: bytes on success, -errno on failure. Paths that bypass
 * them (splice from a socket, TCP_ZEROCOPY_RECEIVE) are not counted.
 */
#include "mpipause.h"
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/*
 * foreign marks the sockets these programs found outside every watched
 * cgroup. The programs below run for every send and receive of the whole
 * machine, and for a socket that is not a job's the conns lookup misses and
 * in_watched walks its cgroup's ancestors, a hash lookup per level: about
 * 400 ns a call, measured with kernel.bpf_stats_enabled, which an 11 us MPI
 * ping-pong showed (and a rig runs one set of programs per node's mpid).
 * Marked, such a socket costs one more storage lookup. A mark never goes
 * stale: a socket keeps the cgroup it was created in, and the loader fills
 * the watched set before it attaches these programs, never after.
 */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u8);
} foreign SEC(".maps");

/*
 * job_conn returns the conns entry of sk when sk is a job's connection,
 * adopting it (creating the entry) when its cgroup is watched but nothing
 * registered it yet. NULL for every other socket.
 */
static __always_inline struct conn_info *job_conn(struct sock *sk)
{
	struct conn_info *c, init;
	struct cgroup *cgrp;
	__u8 state;

	if (!is_inet_tcp(sk))
		return NULL;
	c = bpf_sk_storage_get(&conns, sk, NULL, 0);
	if (c)
		return c;
	if (bpf_sk_storage_get(&foreign, sk, NULL, 0))
		return NULL;

	/* Only live connections: an entry made for a closed socket would stay. */
	state = sk->__sk_common.skc_state;
	if (state == TCP_CLOSE || state == TCP_LISTEN)
		return NULL;
	cgrp = sk_cgroup(sk);
	if (!in_watched(cgrp)) {
		bpf_sk_storage_get(&foreign, sk, NULL, BPF_SK_STORAGE_GET_F_CREATE);
		return NULL;
	}
	init = job_conn_init(sk, cgrp);
	return bpf_sk_storage_get(&conns, sk, &init, BPF_SK_STORAGE_GET_F_CREATE);
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(mpipause_send, struct sock *sk, int ret, int flags)
{
	struct conn_info *c;

	if (ret <= 0)
		return 0;
	c = job_conn(sk);
	if (c)
		__sync_fetch_and_add(&c->bytes_sent, ret);
	return 0;
}

SEC("tp_btf/sock_recv_length")
int BPF_PROG(mpipause_recv, struct sock *sk, int ret, int flags)
{
	struct conn_info *c;

	/* A peek leaves the bytes in the receive queue: not consumed. */
	if (ret <= 0 || (flags & MSG_PEEK))
		return 0;
	c = job_conn(sk);
	if (c)
		__sync_fetch_and_add(&c->bytes_recv, ret);
	return 0;
}

/*
 * Every retransmission attempt. Linux 6.18 also passes the attempt's error;
 * it is not read so that the program loads on kernels without it.
 */
SEC("tp_btf/tcp_retransmit_skb")
int BPF_PROG(mpipause_retransmit, struct sock *sk, struct sk_buff *skb)
{
	struct conn_info *c;

	c = job_conn(sk);
	if (c)
		__sync_fetch_and_add(&c->retransmits, 1);
	return 0;
}

/*
 * Forget a connection when its socket reaches TCP_CLOSE. sockops does the
 * same for what it registered; this also covers the adopted entries, whose
 * sockets sockops never asked state callbacks for. (The entry would also go
 * when the socket is freed, but a socket the application has not closed yet
 * can sit in TCP_CLOSE indefinitely.)
 */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(mpipause_state, struct sock *sk, int oldstate, int newstate)
{
	if (newstate != TCP_CLOSE || !is_inet_tcp(sk))
		return 0;
	bpf_sk_storage_delete(&conns, sk);
	return 0;
}
