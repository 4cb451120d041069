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
	 * Adopted by tcpiter: the connection was established before sockops
	 * was attached, and its socket is in a watched cgroup.
	 */
	CONN_F_ADOPTED = 1 << 1,
	/* Our FIN is queued; conn_info.fin_seq is valid. */
	CONN_F_FIN_SENT = 1 << 2,
	/* The peer's FIN is in rcv_nxt; conn_info.peer_fin_seq is valid. */
	CONN_F_FIN_RCVD = 1 << 3,
	/*
	 * This end sent the SYN, as conn_counts_init took it: its bytes_acked
	 * counts the SYN, so snd_una - bytes_acked is one less than where its
	 * data starts. A reader of tcp_info (loader, Recheck) takes the same
	 * base from it.
	 */
	CONN_F_ACTIVE = 1 << 4,
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

/*
 * What the conns map keeps for a job's connection, in the socket itself.
 *
 * The byte counters are not kept here: fill_record derives them from the
 * kernel's own tcp_sock counters at snapshot time. What it cannot read
 * there without the socket lock is set here, under the lock: the sequence
 * numbers of the application's first byte in each direction, and where
 * the FINs sit (see fill_record).
 */
struct conn_info {
	__u64 cookie;	      /* socket cookie, kept to spare conniter a cache line */
	__u64 cgroup_id;      /* cgroup v2 id of the socket */
	__u64 established_ns; /* CLOCK_BOOTTIME; 0 when adopted */
	__u32 snd_base;	      /* sequence number of the first byte the application sent */
	__u32 rcv_base;	      /* sequence number of the first byte from the peer */
	__u32 fin_seq;	      /* our FIN's sequence number (CONN_F_FIN_SENT) */
	__u32 peer_fin_seq;   /* the peer's FIN's sequence number (CONN_F_FIN_RCVD) */
	__u32 flags;	      /* CONN_F_* */
	__u32 pad;
};

/* One record of the iterators, written with bpf_seq_write. */
struct tcp_record {
	__u64 cookie;
	__u64 cgroup_id;
	__u64 established_ns; /* copied from the conns entry */
	/* Whole life of the socket, from tcp_sock (fill_record). */
	__u64 bytes_sent;  /* bytes the application handed to sendmsg */
	__u64 bytes_recv;  /* bytes the application read (MSG_PEEK excluded) */
	__u64 retransmits; /* tcp_sock.total_retrans: segments retransmitted */
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

/*
 * The job's connections again, as a list the loader can read where the
 * kernel refuses iterators over maps (conniter does not load): socket
 * cookie -> where sock_diag finds the socket. An entry is made wherever a
 * conns entry is (sockops, tcpiter) and goes wherever one is deleted
 * (sockops, sockstat, tcpiter); every tcpiter pass makes again the entries
 * of the sockets it sees. A socket freed without passing TCP_CLOSE here
 * (the programs detached meanwhile) leaves its entry, which the loader's
 * lookup misses and removes. An entry that could not be made (the list
 * full) is counted in connlist_lost, and the loader walks again.
 */
#define MAX_LISTED 16384
struct conn_key {
	struct conn_tuple tuple;
	__u64 cgroup_id;      /* conn_info's */
	__u64 established_ns; /* conn_info's */
	__u32 snd_base;	      /* conn_info's: write_seq is snd_base + what tcp_info says was taken */
	__u32 flags;	      /* conn_info's */
	__u32 netns;	      /* inode of the socket's network namespace */
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, MAX_LISTED);
	__type(key, __u64);
	__type(value, struct conn_key);
} connlist SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} connlist_lost SEC(".maps");

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

/*
 * Kernel layouts that changed, as CO-RE flavors: libbpf-style relocation
 * picks the branch the running kernel's BTF has (bpf_core_field_exists),
 * and the verifier drops the other. Before 5.15 sock_cgroup_data was a
 * union whose u64 held the cgroup pointer, or, with its low bits set,
 * net_cls/net_prio data (the socket then counts as the root cgroup's);
 * before 6.1 a cgroup kept its ancestors' ids, not pointers to them.
 */
struct sock_cgroup_data___pre515 {
	__u64 val;
} __attribute__((preserve_access_index));

struct cgroup___pre61 {
	__u64 ancestor_ids[0];
} __attribute__((preserve_access_index));

/*
 * sk_cgroup returns the socket's cgroup v2, or NULL where the kernel keeps
 * net_cls/net_prio data in its place (before 5.15), which no watched
 * cgroup matches. The pointer is read, not loaded through BTF, so that
 * both layouts give the same kind of value; cgroup_id and in_watched read
 * through it with probe reads.
 */
static __always_inline struct cgroup *sk_cgroup(const struct sock *sk)
{
	struct cgroup *cgrp = NULL;
	__u64 v = 0;

	if (bpf_core_field_exists(sk->sk_cgrp_data.cgroup)) {
		bpf_core_read(&cgrp, sizeof(cgrp), &sk->sk_cgrp_data.cgroup);
		return cgrp;
	}
	bpf_core_read(&v, sizeof(v), &((struct sock_cgroup_data___pre515 *)&sk->sk_cgrp_data)->val);
	if (v & 3)
		return NULL;
	return (struct cgroup *)v;
}

static __always_inline __u64 cgroup_id(const struct cgroup *cgrp)
{
	if (!cgrp)
		return 0;
	return BPF_CORE_READ(cgrp, kn, id);
}

/*
 * in_watched reports whether cgrp or one of its ancestors is watched.
 * The ancestor at level i is ancestors[i] (6.1+; ancestors[cgrp->level] is
 * cgrp itself), or its id is ancestor_ids[i] (before 6.1), so the walk
 * costs one hash lookup per level.
 */
static __always_inline bool in_watched(const struct cgroup *cgrp)
{
	bool ptrs = bpf_core_field_exists(cgrp->ancestors);
	int level;

	if (!cgrp)
		return false;
	level = BPF_CORE_READ(cgrp, level);
	for (int i = 0; i < MAX_CGROUP_LEVEL; i++) {
		struct cgroup *anc = NULL;
		__u64 id = 0;

		if (i > level)
			break;
		if (ptrs) {
			bpf_core_read(&anc, sizeof(anc), &cgrp->ancestors[i]);
			if (!anc)
				break;
			id = BPF_CORE_READ(anc, kn, id);
		} else {
			bpf_core_read(&id, sizeof(id),
				      &((struct cgroup___pre61 *)cgrp)->ancestor_ids[i]);
		}
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

/*
 * conn_list lists the connection whose conns entry is c (connlist): its
 * tuple and namespace, and what a read of it by sock_diag needs of c,
 * keyed by its cookie. Called again wherever c changes in what it copies.
 */
static __always_inline void conn_list(const struct sock_common *skc, const struct conn_info *c)
{
	struct conn_key k = {};
	__u64 cookie = c->cookie;
	__u32 zero = 0;
	__u64 *lost;

	fill_tuple(skc, &k.tuple);
	k.cgroup_id = c->cgroup_id;
	k.established_ns = c->established_ns;
	k.snd_base = c->snd_base;
	k.flags = c->flags;
	k.netns = BPF_CORE_READ(skc, skc_net.net, ns.inum);
	if (bpf_map_update_elem(&connlist, &cookie, &k, BPF_ANY) == 0)
		return;
	lost = bpf_map_lookup_elem(&connlist_lost, &zero);
	if (lost)
		__sync_fetch_and_add(lost, 1);
}

/* conn_unlist takes the connection off connlist. */
static __always_inline void conn_unlist(__u64 cookie)
{
	bpf_map_delete_elem(&connlist, &cookie);
}

/* is_inet_tcp reports whether sk is an IPv4 or IPv6 TCP socket. */
static __always_inline bool is_inet_tcp(const struct sock *sk)
{
	__u16 family = sk->__sk_common.skc_family;

	return sk->sk_protocol == IPPROTO_TCP && (family == AF_INET || family == AF_INET6);
}

/* fin_sent_state reports whether a socket in state has queued its FIN. */
static __always_inline bool fin_sent_state(int state)
{
	return state == TCP_FIN_WAIT1 || state == TCP_FIN_WAIT2 || state == TCP_CLOSING ||
	       state == TCP_LAST_ACK;
}

/* fin_rcvd_state reports whether a socket in state has the peer's FIN. */
static __always_inline bool fin_rcvd_state(int state)
{
	return state == TCP_CLOSE_WAIT || state == TCP_CLOSING || state == TCP_LAST_ACK;
}

/*
 * conn_counts_init sets what fill_record needs besides tcp_sock: the
 * sequence numbers the application's data starts at, and the FINs already
 * there. Only with the socket locked (sockops, iter/tcp), where the
 * counters and the sequence numbers agree with each other.
 *
 * tcp_snd_una_update adds every advance of snd_una to bytes_acked, SYN and
 * FIN included, so snd_una - bytes_acked stays what it was when the socket
 * began: the initial sequence number (ISS) on the side that sent the SYN,
 * whose SYN counts once acknowledged, and ISS + 1 on the side that
 * accepted, whose socket is born with snd_una = ISS + 1 and bytes_acked 0
 * (tcp_create_openreq_child). Data starts at ISS + 1 on both, hence
 * active. tcp_rcv_nxt_update likewise counts every advance of rcv_nxt in
 * bytes_received: the peer's FIN, never its SYN (rcv_nxt is set past it
 * directly), so rcv_nxt - bytes_received is where the peer's data starts.
 */
static __always_inline void conn_counts_init(struct conn_info *c, const struct tcp_sock *tp,
					     bool active)
{
	int state = tp->inet_conn.icsk_inet.sk.__sk_common.skc_state;
	__u32 flags = c->flags & ~(CONN_F_FIN_SENT | CONN_F_FIN_RCVD | CONN_F_ACTIVE);

	c->snd_base = tp->snd_una - (__u32)tp->bytes_acked + (active ? 1 : 0);
	if (active)
		flags |= CONN_F_ACTIVE;
	c->rcv_base = tp->rcv_nxt - (__u32)tp->bytes_received;
	/* No data after a FIN: it is the last sequence number of its side. */
	if (fin_sent_state(state)) {
		c->fin_seq = tp->write_seq - 1;
		flags |= CONN_F_FIN_SENT;
	}
	if (fin_rcvd_state(state)) {
		c->peer_fin_seq = tp->rcv_nxt - 1;
		flags |= CONN_F_FIN_RCVD;
	}
	c->flags = flags;
}

/*
 * conn_note_fin records a FIN in c at the state change that comes with it,
 * under the socket lock (inet_sock_set_state fires before the new state
 * is stored): our FIN takes write_seq, which tcp_send_fin advances only
 * after tcp_close_state; the peer's is already in rcv_nxt (tcp_fin runs
 * after tcp_rcv_nxt_update). The sequence number is stored before the
 * flag, and both are volatile so that the compiler keeps that order, which
 * fill_record relies on.
 */
static __always_inline void conn_note_fin(struct conn_info *c, const struct tcp_sock *tp,
					  int newstate)
{
	if ((newstate == TCP_FIN_WAIT1 || newstate == TCP_LAST_ACK) &&
	    !(c->flags & CONN_F_FIN_SENT)) {
		*(volatile __u32 *)&c->fin_seq = tp->write_seq;
		*(volatile __u32 *)&c->flags = c->flags | CONN_F_FIN_SENT;
	}
	if ((newstate == TCP_CLOSE_WAIT || newstate == TCP_CLOSING) &&
	    !(c->flags & CONN_F_FIN_RCVD)) {
		*(volatile __u32 *)&c->peer_fin_seq = tp->rcv_nxt - 1;
		*(volatile __u32 *)&c->flags = c->flags | CONN_F_FIN_RCVD;
	}
}

/*
 * widen returns the 64-bit count whose low 32 bits are low, nearest to
 * approx (which must be within 2^31 of it); never negative.
 */
static __always_inline __u64 widen(__u64 approx, __u32 low)
{
	__s64 v = approx + (__s32)(low - (__u32)approx);

	return v < 0 ? 0 : v;
}

/*
 * fill_record fills rec from a job's socket and its conns entry. The
 * sequence numbers are read in the order that keeps the derived queue
 * lengths non-negative even without the socket lock (conniter): snd_una
 * before write_seq, copied_seq before rcv_nxt, each only ever growing (x86
 * does not reorder loads with loads; a weakly ordered CPU could).
 *
 * The byte counters cover the socket's whole life and come from tcp_sock:
 * sent = bytes_acked + (write_seq - snd_una), read = bytes_received -
 * (rcv_nxt - copied_seq), less the SYN and FINs those count. No load order
 * makes these sums consistent without the lock: an ACK adds to bytes_acked
 * and snd_una one after the other, so a read between the two is off by
 * that ACK, up or down, and the next read would go backwards. So the sums
 * give only the high bits; the low 32 come from one sequence number each,
 * the end of the application's data (write_seq, or our FIN once queued;
 * copied_seq, but not past the peer's FIN), minus the base conn_counts_init
 * took under the lock. Each end only grows, so the counters never go
 * backwards and are exact as soon as the application's call has returned.
 * The FIN's flag is read after write_seq and copied_seq, its sequence
 * number after the flag (the reverse of the order they were stored in):
 * write_seq including our FIN or copied_seq past the peer's means the flag
 * is seen.
 *
 * At 10,000 sockets a pass the cost is cache misses: this touches the first
 * cache line of sock_common (two with IPv6 addresses), the three lines of
 * tcp_sock that hold the sequence numbers, and for the counters three more
 * (bytes_received, bytes_acked, total_retrans on 6.18's layout);
 * bpf/README.md has what that costs.
 */
static __always_inline void fill_record(struct tcp_record *rec, const struct tcp_sock *tp,
					const struct conn_info *c)
{
	const struct sock_common *skc = &tp->inet_conn.icsk_inet.sk.__sk_common;
	__u32 flags, snd_end, rcv_end, peer_fin;
	__u64 acked, rcvd;

	rec->cookie = c->cookie;
	rec->cgroup_id = c->cgroup_id;
	rec->established_ns = c->established_ns;
	fill_tuple(skc, &rec->tuple);
	rec->state = skc->skc_state;
	rec->netns = skc->skc_net.net->ns.inum;
	rec->snd_una = *(volatile __u32 *)&tp->snd_una;
	rec->snd_nxt = *(volatile __u32 *)&tp->snd_nxt;
	rec->write_seq = *(volatile __u32 *)&tp->write_seq;
	rec->copied_seq = *(volatile __u32 *)&tp->copied_seq;
	rec->rcv_nxt = *(volatile __u32 *)&tp->rcv_nxt;
	acked = *(volatile __u64 *)&tp->bytes_acked;
	rcvd = *(volatile __u64 *)&tp->bytes_received;
	rec->retransmits = tp->total_retrans;

	flags = *(volatile __u32 *)&c->flags;
	rec->flags = flags;
	snd_end = rec->write_seq;
	if (flags & CONN_F_FIN_SENT)
		snd_end = *(volatile __u32 *)&c->fin_seq;
	rcv_end = rec->copied_seq;
	if (flags & CONN_F_FIN_RCVD) {
		peer_fin = *(volatile __u32 *)&c->peer_fin_seq;
		if ((__s32)(rcv_end - peer_fin) > 0)
			rcv_end = peer_fin;
	}
	rec->bytes_sent = widen(acked + (__s32)(snd_end - rec->snd_una), snd_end - c->snd_base);
	rec->bytes_recv = widen(rcvd - (__s32)(rec->rcv_nxt - rcv_end), rcv_end - c->rcv_base);
}

#endif /* MPIPAUSE_H */
