// SPDX-License-Identifier: Apache-2.0
//
// The rank channel's parts between its files: the connection (rankchan.c),
// what the shim's thread serves on it (rankserve.c) and the HELLO and JOIN
// lines (rankhello.c). The rest of the shim sees the channel through
// shim.h.
#ifndef MPIPAUSE_RANKCHAN_H
#define MPIPAUSE_RANKCHAN_H

#include <sys/socket.h>
#include <sys/un.h>

// rankchan.c: the connection to mpid (-1: none; it changes when the channel
// is lost and made again), a whole line sent on it, the shim's one warning
// line on stderr (MPIPAUSE_QUIET), mpid's address, and the channel opened
// with a HELLO line.
extern int mpp_rankch_fd;
int mpp_rankch_send_line(const char *s);
void mpp_rankch_warn(const char *fmt, const char *arg);
socklen_t mpp_rankch_addr(struct sockaddr_un *a, const char **name);
void mpp_rankch_open(const char *hello);

// rankserve.c: the thread's work on one connection, until it ends, and the
// drain's setting, read when the channel opens.
void mpp_rankch_serve(int sigfd);
void mpp_rankch_drain_init(void);

#endif
