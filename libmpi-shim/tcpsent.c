// SPDX-License-Identifier: Apache-2.0
//
// mpp_tcp_sent: how many bytes a TCP socket has taken from its process,
// from the kernel. Its own file because it needs linux/tcp.h's struct
// tcp_info (the counters of 4.19 and later), which cannot share a file
// with glibc's netinet/tcp.h.
#include "shim.h"

#include <linux/tcp.h>
#include <netinet/in.h>
#include <stddef.h>
#include <sys/socket.h>

// tcp_get_info reads the three under the socket's lock: bytes_sent counts
// retransmissions too, notsent_bytes is what is written but never sent
// (write_seq - snd_nxt), so the sum is write_seq less the sequence number
// the data starts at: the count mpid's observer calls a connection's bytes
// sent (loader.Conn.BytesSent), until the local device refuses a transmit,
// whose bytes bytes_sent then counts once more (internal/sockdiag, Taken):
// mpid compares this count with its own TCP_INFO read, never with the
// observer's (docs/guarantees.md, G4). A kernel whose tcp_info is
// shorter, or a socket that is not TCP: MPP_SENT_UNKNOWN.
uint64_t mpp_tcp_sent(int fd)
{
	struct tcp_info ti;
	socklen_t len = sizeof(ti);

	if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) < 0 ||
	    len < offsetof(struct tcp_info, tcpi_bytes_retrans) + sizeof(ti.tcpi_bytes_retrans))
		return MPP_SENT_UNKNOWN;
	return ti.tcpi_bytes_sent - ti.tcpi_bytes_retrans + ti.tcpi_notsent_bytes;
}
