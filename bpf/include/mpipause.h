/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * What mpipause's BPF programs share: the structs of their map values and
 * iterator records (mirrored in Go by bpf2go), the maps themselves, and the
 * helpers that decide whether a socket belongs to a watched job.
 *
 * Every object (sockops, sockstat, tcpiter, conniter) includes this header
 * and so declares the same maps; the loader creates them once and hands them
 * to the other objects (MapReplacements), so all programs share one conns map.
 */
#ifndef MPIPAUSE_H
#define MPIPAUSE_H

#include "vmlinux.h"
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

/* Not in vmlinux.h: they are macros, not enums, in the kernel. */
#define AF_INET 2
#define AF_INET6 10
#define MSG_PEEK 2

/*
 * Records conniter passes through its mmapable array; more still work,
 * through the slower seq_file path. 16384 * 120 bytes: 1.9 MiB per job.
 */
#define MAX_RECORDS 16384
/* Cgroups watched at once by one loaded set. */
#define MAX_WATCHED 64
/*
 * Deepest cgroup level looked at when matching a socket's cgroup against the
 * watched ones; a bound the verifier needs. Job cgroups sit a few levels down.
 */
#define MAX_CGROUP_LEVEL 32

/* conn_info.flags */
enum {
	/* Registered by sockops when the connection was established. */
	CONN_F_SOCKOPS = 1 << 0,
	/*
	 * Adopted by tcpiter or a counter: the connection was established
	 * before sockops was attached, and its socket is in a watched cgroup.
	 */
	CONN_F_ADOPTED = 1 << 1,
};

/* A connection's addresses; ports in host byte order. */
struct conn_tuple {
	__u8 saddr[16]; /* IPv4 in the first 4 bytes */
	__u8 daddr[16];
	__u16 sport;
	__u16 dport;
	__u16 family; /* AF_INET or AF_INET6 */
	__u16 pad;
};

/* What the conns map keeps for a job's connection, in the socket itself. */
struct conn_info {
	__u64 cookie;	      /* socket cookie, kept to spare conniter a cache line */
	__u64 cgroup_id;      /* cgroup v2 id of the socket */
	__u64 established_ns; /* CLOCK_BOOTTIME; 0 when adopted */
	__u64 bytes_sent;     /* sum of sock_send_length ret > 0 */
	__u64 bytes_recv;     /* sum of sock_recv_length ret > 0, MSG_PEEK excluded */
	__u64 retransmits;    /* tcp_retransmit_skb events */
	__u32 flags;	      /* CONN_F_* */
	__u32 pad;
};

/* One record of the iterators, written with bpf_seq_write. */
struct tcp_record {
	__u64 cookie;
	__u64 cgroup_id;
	/* Copied from the conns entry. */
	__u64 established_ns;
	__u64 bytes_sent;
	__u64 bytes_recv;
	__u64 retransmits;
	struct conn_tuple tuple;
	__u32 write_seq;
	__u32 snd_nxt;
	__u32 snd_una;
	__u32 rcv_nxt;
	__u32 copied_seq;
	__u32 netns; /* inode of the socket's network namespace */
	__u32 flags; /* conn_info.flags */
	__u8 state;  /* TCP_ESTABLISHED ... (include/net/tcp_states.h) */
	__u8 pad[3];
};

/*
 * The job's connections: socket local storage, so that a program holding a
 * socket finds its entry without a hash lookup, the entry dies with the
 * socket, and iter/bpf_sk_storage_map visits exactly the job's sockets, in
 * every network namespace, without walking the TCP hash tables.
 */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct conn_info);
} conns SEC(".maps");

/* Watched cgroup ids: a socket in one of them or below belongs to a job. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_WATCHED);
	__type(key, __u64);
	__type(value, __u8);
} watched SEC(".maps");

/*
 * The helpers below read kernel structs through BTF pointers (program
 * arguments, bpf_skc_to_tcp_sock results) with plain loads, which the
 * verifier turns into fault-safe loads and libbpf relocates (CO-RE, vmlinux.h
 * marks every struct preserve_access_index): several times cheaper than a
 * bpf_probe_read_kernel call each, which matters at 10,000 sockets a pass.
 */

static __always_inline struct cgroup *sk_cgroup(const struct sock *sk)
{
	return sk->sk_cgrp_data.cgroup;
}

static __always_inline __u64 cgroup_id(const struct cgroup *cgrp)
{
	return cgrp->kn->id;
}

/*
 * in_watched reports whether cgrp or one of its ancestors is watched.
 * cgrp->ancestors[i] is the ancestor at level i (ancestors[cgrp->level] is
 * cgrp itself), so the walk costs one hash lookup per level. A variable
 * index into a BTF pointer's array is not a plain load the verifier
 * accepts, hence the CO-RE probe reads here.
 */
static __always_inline bool in_watched(const struct cgroup *cgrp)
{
	int level;

	if (!cgrp)
		return false;
	level = cgrp->level;
	for (int i = 0; i < MAX_CGROUP_LEVEL; i++) {
		struct cgroup *anc = NULL;
		__u64 id;

		if (i > level)
			break;
		bpf_core_read(&anc, sizeof(anc), &cgrp->ancestors[i]);
		if (!anc)
			break;
		id = BPF_CORE_READ(anc, kn, id);
		if (bpf_map_lookup_elem(&watched, &id))
			return true;
	}
	return false;
}

/* fill_tuple copies a socket's addresses and ports into t. */
static __always_inline void fill_tuple(const struct sock_common *skc, struct conn_tuple *t)
{
	__u16 family = skc->skc_family;

	t->family = family;
	t->sport = skc->skc_num;
	t->dport = bpf_ntohs(skc->skc_dport);
	if (family == AF_INET) {
		*(__u32 *)t->saddr = skc->skc_rcv_saddr;
		*(__u32 *)t->daddr = skc->skc_daddr;
		return;
	}
	for (int i = 0; i < 4; i++) {
		((__u32 *)t->saddr)[i] = skc->skc_v6_rcv_saddr.in6_u.u6_addr32[i];
		((__u32 *)t->daddr)[i] = skc->skc_v6_daddr.in6_u.u6_addr32[i];
	}
}

/* is_inet_tcp reports whether sk is an IPv4 or IPv6 TCP socket. */
static __always_inline bool is_inet_tcp(const struct sock *sk)
{
	__u16 family = sk->__sk_common.skc_family;

	return sk->sk_protocol == IPPROTO_TCP && (family == AF_INET || family == AF_INET6);
}

/* job_conn_init is the conns entry of a socket adopted into a job. */
static __always_inline struct conn_info job_conn_init(struct sock *sk, const struct cgroup *cgrp)
{
	struct conn_info info = {
		.cookie = bpf_get_socket_cookie(sk),
		.cgroup_id = cgroup_id(cgrp),
		.flags = CONN_F_ADOPTED,
	};

	return info;
}

/*
 * fill_record fills rec from a job's socket and its conns entry. The
 * sequence numbers are read in the order that keeps the derived queue
 * lengths non-negative even without the socket lock (conniter): snd_una
 * before write_seq, copied_seq before rcv_nxt, each only ever growing (x86
 * does not reorder loads with loads; a weakly ordered CPU could).
 *
 * At 10,000 sockets a pass the cost is cache misses: this touches the first
 * cache line of sock_common (two with IPv6 addresses) and the three lines of
 * tcp_sock that hold the sequence numbers, nothing else of the socket.
 */
static __always_inline void fill_record(struct tcp_record *rec, const struct tcp_sock *tp,
					const struct conn_info *c)
{
	const struct sock_common *skc = &tp->inet_conn.icsk_inet.sk.__sk_common;

	rec->cookie = c->cookie;
	rec->cgroup_id = c->cgroup_id;
	rec->established_ns = c->established_ns;
	rec->bytes_sent = c->bytes_sent;
	rec->bytes_recv = c->bytes_recv;
	rec->retransmits = c->retransmits;
	rec->flags = c->flags;
	fill_tuple(skc, &rec->tuple);
	rec->state = skc->skc_state;
	rec->netns = skc->skc_net.net->ns.inum;
	rec->snd_una = *(volatile __u32 *)&tp->snd_una;
	rec->snd_nxt = *(volatile __u32 *)&tp->snd_nxt;
	rec->write_seq = *(volatile __u32 *)&tp->write_seq;
	rec->copied_seq = *(volatile __u32 *)&tp->copied_seq;
	rec->rcv_nxt = *(volatile __u32 *)&tp->rcv_nxt;
}

#endif /* MPIPAUSE_H */
