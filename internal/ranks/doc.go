// Package ranks is mpid's end of the rank channel: the unix socket on which
// the shim (libmpipause.so) of every MPI rank of the node registers after
// MPI_Init, and through which mpid closes, inspects and reopens the rank's
// send gate. libmpi-shim/rankchan.c (with rankserve.c and rankhello.c)
// is the other end; this comment is the protocol's one description, and
// docs/mpid.md, "Rank channel", says why it is so.
//
// A rank is authenticated by the kernel, not by what it says: the pid in its
// HELLO must be the pid SO_PEERCRED reports for the connection. A rank that
// exits or crashes is gone when its connection closes.
//
// Before all that, from the shim's constructor (before main, so before
// MPI_Init creates any socket), a rank of a named job may send one JOIN
// line on a connection of its own, asking to be moved into the job's
// cgroup: the kernel charges a socket to the cgroup of the process that
// creates it, at creation, for good, and mpid watches a job's sockets by
// cgroup. mpid answers OK or ERR and closes that connection; a JOIN does not
// register a rank.
//
// # Lines
//
// Text lines, each at most MaxRankLine after the first (the first, a JOIN
// or HELLO, at most 1 MiB); the parsers are in protocol.go.
//
//	JOIN, on a connection of its own, from the shim's constructor:
//	shim → mpid  JOIN 2 job=<id> pid=<pid> key=<job key>
//	mpid → shim  OK | ERR <reason>        (then mpid closes the connection)
//
//	HELLO, after MPI_Init, with the state page's and the gate page's fds
//	(SCM_RIGHTS):
//	shim → mpid  HELLO 2 job=<id> rank=<r> size=<n> pid=<pid> host=<h> key=<job key>
//	             [tstp=<hex: where the shim's SIGTSTP handler begins>]
//	             [root=<host of rank 0>] [hosts=<h0,h1,...> (rank 0)]
//
//	Requests, and the shim's answers:
//	mpid → shim  CLOSE | STATE
//	shim → mpid  CLOSED|STATE gate=<open|closed|flushing> gated=<n> closing=<n> held=<bytes>
//	mpid → shim  OPEN
//	shim → mpid  OPENED flushed=<bytes> errors=<n> errno=<e>   (after the flush)
//	mpid → shim  REOPEN [<gen>]
//	shim → mpid  REOPENED                 (at once; after the flush, EVENT flushed)
//	             REOPENED stale           (the gate is open, or closed in another
//	                                       generation: nothing done)
//	mpid → shim  DRAIN <n>, then n socket cookies in lines "C <hex> ..."
//	             (at most 12 a line, 65,536 in all)
//	shim → mpid  DRAINING sockets=<n> stashed=<bytes>
//	             | DRAINING off           (the gate is open)
//	             | DRAINING disabled      (MPIPAUSE_RECV_DRAIN=0)
//	             | ERROR drain set cut short (another request came first)
//	             | ERROR bad drain set
//
//	Unasked, from the shim (EVENT, to Jobs.Event):
//	EVENT flushed bytes=<n> errors=<n> errno=<e>   (a REOPEN's flush done)
//	EVENT stash full bytes=<n> max=<cap>           (once a DRAIN: the drain
//	                                                stopped at MPIPAUSE_STASH_MAX_MB)
//	EVENT unheld call=<sendmsg-ancillary|msg-zerocopy|msg-fastopen|pwritev2-flags> fd=<n> cookie=<hex>
//	                                               (the first 8 of a closing: a
//	                                                call the gate cannot hold went
//	                                                to the kernel behind the held
//	                                                bytes; on a job connection the
//	                                                next drain check fails the pause)
//	EVENT pause at=<ns> | EVENT resume at=<ns>     (the rank got SIGTSTP or
//	                                                SIGCONT; ns: CLOCK_MONOTONIC in
//	                                                its handler; an older shim's
//	                                                plain EVENT pause / resume is
//	                                                taken as it comes)
//	EVENT pause at=<ns> overtaken                  (a SIGTSTP whose handler a
//	                                                SIGCONT interrupted at its
//	                                                first instruction: never
//	                                                acted on)
package ranks
