package loader

import (
	"context"
	"net/netip"
	"strconv"
	"time"
)

// TCPState is a socket's state as the kernel numbers it (include/net/tcp_states.h).
type TCPState uint8

// The TCP states that matter to mpipause; the rest print as numbers.
const (
	StateEstablished TCPState = 1
	StateSynSent     TCPState = 2
	StateSynRecv     TCPState = 3
	StateFinWait1    TCPState = 4
	StateFinWait2    TCPState = 5
	StateTimeWait    TCPState = 6
	StateClose       TCPState = 7
	StateCloseWait   TCPState = 8
	StateLastAck     TCPState = 9
	StateListen      TCPState = 10
	StateClosing     TCPState = 11
)

var stateNames = [...]string{
	1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
	6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
}

func (s TCPState) String() string {
	if int(s) < len(stateNames) && stateNames[s] != "" {
		return stateNames[s]
	}
	return "STATE(" + strconv.Itoa(int(s)) + ")"
}

// Conn is one TCP connection of a job, as one observer read it from the kernel.
//
// The sequence fields are the kernel's own 32-bit counters; SendQueue and
// Unread are derived from them (or, for sock_diag, reported by the kernel as
// wqueue/rqueue), so that G1 (docs/guarantees.md) reads: SendQueue == 0 &&
// Unread == 0.
type Conn struct {
	Cookie uint64 // socket cookie: stable identity of the socket for its lifetime
	Local  netip.AddrPort
	Remote netip.AddrPort
	State  TCPState
	// Netns names the network namespace the socket lives in: "" for the
	// observer's own, otherwise the name or path it was asked to look in.
	Netns string
	// Cgroup is the cgroup v2 id of the socket (the cgroup of the process that
	// created it).
	Cgroup uint64

	WriteSeq  uint32 // tp->write_seq: end of the data the application has written
	SndNxt    uint32 // tp->snd_nxt: next sequence number to send
	SndUna    uint32 // tp->snd_una: first unacknowledged byte
	RcvNxt    uint32 // tp->rcv_nxt: next byte expected from the peer
	CopiedSeq uint32 // tp->copied_seq: end of the data the application has read

	SendQueue uint32 // bytes written but not yet acknowledged by the peer (write_seq - snd_una)
	Unread    uint32 // bytes received but not yet read by the application (rcv_nxt - copied_seq)

	// Counted: the BPF observer read the counters below from the kernel's
	// tcp_sock (a Recheck from its tcp_info), so they cover the socket's
	// whole life, from before the observer attached too. False from the
	// sock_diag observer, which leaves them zero.
	Counted bool
	// BytesSent: bytes the application handed to the kernel (send, write,
	// ...), acknowledged or not; SYN and FIN not included.
	BytesSent uint64
	// BytesRecv: bytes the application read (a MSG_PEEK reads none).
	// Both are exact once the call that moved them has returned, and never
	// go backwards.
	BytesRecv uint64
	// Retransmits: segments the kernel retransmitted (tcp_sock
	// total_retrans; on an accepted socket, the SYN-ACK's too).
	Retransmits uint64
	// Established: when sockops registered the connection; zero for one
	// adopted after the fact.
	Established time.Time
	// Active: this end sent the SYN, as the counts' base takes it (sockops
	// is told; a connection adopted after the fact is judged by its
	// listener's backlog, bpf/README.md). The kernel's bytes_acked counts
	// that SYN, so a Recheck, which counts from tcp_info's bytes_acked,
	// takes one off where the Snapshot did.
	Active bool
}

// Empty reports whether nothing is in flight on the connection in either
// direction: the wire-empty condition G1 of docs/guarantees.md.
func (c Conn) Empty() bool { return c.SendQueue == 0 && c.Unread == 0 }

// Observer reads a job's TCP connections from the kernel.
type Observer interface {
	// Snapshot returns every TCP connection of the job's cgroup (including
	// descendants) in every network namespace the observer watches, read in
	// one pass per namespace.
	Snapshot(ctx context.Context) ([]Conn, error)
	// Kind names the observer: "bpf" or "sock_diag".
	Kind() string
	// Close releases the observer's resources. Whatever it attached only for
	// itself is detached; state pinned for a daemon stays pinned.
	Close() error
}
