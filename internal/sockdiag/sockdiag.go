// Package sockdiag dumps a network namespace's TCP sockets with the
// kernel's sock_diag (INET_DIAG) netlink interface, through
// mdlayher/netlink: the 4-tuple, state, cgroup id, queues and tcp_info of
// each socket, filtered in the kernel by state and cgroup. It is the sock_diag
// observer's source (loader/diag.go) where BPF cannot run.
package sockdiag

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// sock_diag / inet_diag constants (linux/sock_diag.h, linux/inet_diag.h,
// linux/netlink.h). x/sys/unix has only some of them.
const (
	sockDiagByFamily = unix.SOCK_DIAG_BY_FAMILY // 20

	inetDiagReqBytecode = 1 // INET_DIAG_REQ_BYTECODE

	inetDiagInfo     = 2  // INET_DIAG_INFO: struct tcp_info
	inetDiagCgroupID = 21 // INET_DIAG_CGROUP_ID: u64, Linux 5.7+ (commit b1f3e43dbfac)

	inetDiagBCJmp        = 1  // INET_DIAG_BC_JMP
	inetDiagBCCgroupCond = 13 // INET_DIAG_BC_CGROUP_COND: u64 cgroup v2 id

	nlaTypeMask = 0x3fff // NLA_TYPE_MASK: strips NLA_F_NESTED and NLA_F_NET_BYTEORDER

	sizeofInetDiagReqV2 = 56 // struct inet_diag_req_v2
	sizeofInetDiagMsg   = 72 // struct inet_diag_msg
)

// Offsets in struct inet_diag_msg (linux/inet_diag.h). The sockid's ports
// and addresses are in network byte order; everything else, including the
// two halves of the cookie, is in host order. TestLayoutBTF checks these
// against the running kernel's BTF.
const (
	offMsgFamily  = 0
	offMsgState   = 1
	offMsgTimer   = 2
	offMsgRetrans = 3
	offMsgSport   = 4  // __be16 id.idiag_sport
	offMsgDport   = 6  // __be16 id.idiag_dport
	offMsgSrc     = 8  // __be32 id.idiag_src[4]
	offMsgDst     = 24 // __be32 id.idiag_dst[4]
	offMsgIf      = 40 // __u32 id.idiag_if
	offMsgCookie  = 44 // __u32 id.idiag_cookie[2]: low half first
	offMsgExpires = 52
	offMsgRqueue  = 56
	offMsgWqueue  = 60
	offMsgUID     = 64
	offMsgInode   = 68
)

// Offsets in struct tcp_info (linux/tcp.h) of the fields a pause report uses.
// The struct only grows at its end, so an older kernel sends a shorter one
// and the fields past its end read as zero.
const (
	offTIState        = 0   // __u8 tcpi_state
	offTIRetransmits  = 2   // __u8 tcpi_retransmits: consecutive RTOs now
	offTIRTO          = 8   // __u32 tcpi_rto, µs
	offTIUnacked      = 24  // __u32 tcpi_unacked, segments
	offTILost         = 32  // __u32 tcpi_lost, segments
	offTIRetrans      = 36  // __u32 tcpi_retrans, segments
	offTILastDataSent = 44  // __u32 tcpi_last_data_sent, ms
	offTILastDataRecv = 52  // __u32 tcpi_last_data_recv, ms
	offTIRTT          = 68  // __u32 tcpi_rtt, µs
	offTIRTTVar       = 72  // __u32 tcpi_rttvar, µs
	offTITotalRetrans = 100 // __u32 tcpi_total_retrans, segments
	offTIBytesAcked   = 120 // __u64 tcpi_bytes_acked
	offTIBytesRecv    = 128 // __u64 tcpi_bytes_received
	offTINotsent      = 144 // __u32 tcpi_notsent_bytes
	offTIMinRTT       = 148 // __u32 tcpi_min_rtt, µs
	offTIBytesSent    = 200 // __u64 tcpi_bytes_sent
	offTIBytesRetrans = 208 // __u64 tcpi_bytes_retrans
)

// StateMask selects TCP states by bit: bit n is state n as the kernel
// numbers it (include/net/tcp_states.h, loader.TCPState), as in
// inet_diag_req_v2.idiag_states.
type StateMask uint32

// State masks for [Filter].
const (
	// StatesAll is every TCP state (what ss -a asks for). The kernel reports
	// request sockets (TCP_NEW_SYN_RECV) as SYN_RECV; bound but inactive
	// sockets (TCP_BOUND_INACTIVE, bit 13) are not included.
	StatesAll StateMask = 1<<12 - 1
	// StatesConnected leaves out LISTEN, SYN_RECV, TIME_WAIT and CLOSE, as
	// ss's "connected" does: what is left are the sockets that can hold
	// bytes of an established stream.
	StatesConnected StateMask = StatesAll &^ (1<<tcpListen | 1<<tcpSynRecv | 1<<tcpTimeWait | 1<<tcpClose)
)

// Kernel TCP state numbers (include/net/tcp_states.h).
const (
	tcpEstablished = 1
	tcpSynRecv     = 3
	tcpTimeWait    = 6
	tcpClose       = 7
	tcpListen      = 10
)

// TCPSocket is one TCP socket as INET_DIAG reported it.
type TCPSocket struct {
	// Family is unix.AF_INET or unix.AF_INET6. An AF_INET6 socket talking
	// IPv4 reports v4-mapped addresses (::ffff:a.b.c.d), as the kernel does.
	Family uint8
	// State is the kernel's state number (include/net/tcp_states.h).
	State  uint8
	Local  netip.AddrPort
	Remote netip.AddrPort
	// Interface is idiag_if: the bound device or IPv6 scope, 0 if none.
	Interface uint32
	// Cookie is the socket cookie (SO_COOKIE, bpf_get_socket_cookie): the
	// kernel splits it into idiag_cookie[0] (low half) and [1] (high half),
	// see sock_diag_save_cookie in net/core/sock_diag.c.
	Cookie uint64
	// RQueue and WQueue are idiag_rqueue and idiag_wqueue. For every state
	// but LISTEN, tcp_diag_get_info (net/ipv4/tcp_diag.c) sets
	//	rqueue = max(rcv_nxt - copied_seq, 0)  received, not yet read
	//	wqueue = write_seq - snd_una           written, not yet acknowledged
	// which are exactly the two queues of G1 (docs/guarantees.md). For
	// LISTEN they are the accept backlog and its limit; TIME_WAIT and
	// request sockets report 0.
	RQueue uint32
	WQueue uint32
	// UID owns the socket (0 for TIME_WAIT and request sockets), mapped
	// into the user namespace of the process that dumped it.
	UID uint32
	// Inode is the socket's inode number (0 for TIME_WAIT and request
	// sockets): what /proc/PID/fd links name as socket:[inode].
	Inode uint32
	// Cgroup is the cgroup v2 id of the socket (INET_DIAG_CGROUP_ID): the
	// cgroup of the process that created it; an accepted socket inherits
	// its listener's. 0 when the kernel did not say: TIME_WAIT and request
	// sockets, or a kernel older than 5.7. No cgroup has id 0.
	Cgroup uint64
	// Info is the socket's struct tcp_info (INET_DIAG_INFO); nil for
	// TIME_WAIT and request sockets, for which the kernel sends none.
	Info *TCPInfo
}

// TCPInfo holds the fields of struct tcp_info (linux/tcp.h) that a pause
// report uses. Fields past the end of what the kernel sent are zero.
type TCPInfo struct {
	// Len is how many bytes of struct tcp_info the kernel sent (232 and
	// more on current kernels).
	Len          int
	State        uint8
	Retransmits  uint8         // consecutive retransmission timeouts now pending
	RTO          time.Duration // retransmission timeout
	Unacked      uint32        // segments sent and not yet acknowledged
	Lost         uint32        // segments considered lost
	Retrans      uint32        // segments retransmitted and not yet acknowledged
	LastDataSent time.Duration // since the last data segment was sent
	LastDataRecv time.Duration // since the last data segment was received
	RTT          time.Duration // smoothed round-trip time
	RTTVar       time.Duration
	MinRTT       time.Duration
	TotalRetrans uint32 // segments retransmitted over the socket's life
	// BytesAcked counts bytes acknowledged by the peer
	// (tcpEStatsAppHCThruOctetsAcked, RFC 4898); BytesReceived the bytes
	// received in order; BytesSent and BytesRetrans the bytes sent and
	// resent. The kernel counts the SYN in BytesAcked, so an idle fresh
	// connection shows 1.
	BytesAcked    uint64
	BytesReceived uint64
	BytesSent     uint64
	BytesRetrans  uint64
	// NotsentBytes is the part of WQueue not yet sent at all (the rest is
	// in flight).
	NotsentBytes uint32
}

// Taken is how many bytes the socket has taken from its process to send,
// as tcp_info says it: BytesSent counts retransmissions too and
// NotsentBytes what is written but never sent (write_seq - snd_nxt), so
// the sum is write_seq less the sequence number the data starts at (the
// count the BPF observer reads as a connection's bytes sent,
// loader.Conn.BytesSent, and the shim as where held bytes go,
// libmpi-shim/tcpsent.c) as long as every transmit went out. A transmit
// the local device refused (a link down, a full queue discipline) counts
// in BytesSent and leaves its bytes in NotsentBytes, so from then on the
// sum is ahead of the observer's count by those bytes
// (loader.TestTakenAheadOfWalk): never behind, and growing with each
// refusal. So a place in the stream read from tcp_info is compared with
// tcp_info's count, never with the observer's (internal/node, late); a
// lookup that counts as the observer does goes by BytesAcked instead
// (loader, countFromInfo). tcp_get_info reads the three under the
// socket's lock, so they agree with each other. ok is false where the kernel's tcp_info ends
// before tcpi_bytes_retrans (before 4.19). A FIN queued but not yet sent
// counts as a byte here and not there.
func (i *TCPInfo) Taken() (n uint64, ok bool) {
	if i == nil || i.Len < offTIBytesRetrans+8 {
		return 0, false
	}
	return i.BytesSent - i.BytesRetrans + uint64(i.NotsentBytes), true
}

// HasBytesAcked reports whether the kernel's tcp_info reaches
// tcpi_bytes_acked (4.1 and later).
func (i *TCPInfo) HasBytesAcked() bool {
	return i != nil && i.Len >= offTIBytesAcked+8
}

// Filter selects the sockets [DiagConn.DumpTCP] returns.
type Filter struct {
	// States selects by TCP state; 0 means StatesAll.
	States StateMask
	// Family is unix.AF_INET or unix.AF_INET6; 0 means both.
	Family uint8
	// Cgroups, if not nil, keeps only the sockets whose cgroup id is in it:
	// pass the ids of a job's cgroup and of all its descendants
	// (cgroupv2.TreeIDs). A non-nil empty slice matches nothing. Sockets
	// without a cgroup id (TIME_WAIT, request sockets) never match.
	Cgroups []uint64

	// userSpace filters by cgroup after the dump instead of in the kernel.
	// Only tests and benchmarks set it: see "Cgroup filtering" below.
	userSpace bool
}

// ErrNoCgroupID says the kernel does not report socket cgroup ids
// (INET_DIAG_CGROUP_ID needs Linux 5.7 with CONFIG_SOCK_CGROUP_DATA), so
// a cgroup filter cannot work.
var ErrNoCgroupID = errors.New("kernel reports no socket cgroup ids (INET_DIAG_CGROUP_ID needs Linux 5.7+)")

// ErrClosed says the DiagConn was closed.
var ErrClosed = errors.New("sock_diag: use of a closed DiagConn")

// maxBytecodeCgroups bounds the ids of one in-kernel cgroup filter: the
// bytecode's jump offsets are 16 bits wide.
const maxBytecodeCgroups = 4000

// recvBufSize is the user buffer of each netlink read. A netlink dump
// fills its skb up to the largest buffer the reader has offered
// (nlk->max_recvmsg_len, capped at 32 KiB less overhead, see netlink_dump
// in net/netlink/af_netlink.c); peeking at each datagram's size instead
// would keep the kernel at its default of about one page, 8x the syscalls.
const recvBufSize = 32 << 10

// DiagConn is a NETLINK_SOCK_DIAG socket in one network namespace. Its
// methods may be called from several goroutines; dumps run one at a time.
type DiagConn struct {
	mu     sync.Mutex
	ns     int           // our own dup of the netns fd, or -1 for the caller's netns
	c      *netlink.Conn // nil after a broken dump: redialed by the next one
	closed bool
	seq    uint32 // of LookupTCP's requests, whose replies it reads itself
	batch  int    // lookups LookupTCP sends at once: see lookupBatch
}

// DialDiag opens a sock_diag socket in the network namespace netnsFD (an
// open /proc/PID/ns/net or /run/netns/NAME) without moving any thread of
// the caller there; netnsFD < 0 means the caller's own namespace. The
// caller may close netnsFD afterwards.
func DialDiag(netnsFD int) (*DiagConn, error) {
	d := &DiagConn{ns: -1}
	if netnsFD >= 0 {
		// Keep a dup so that a broken dump can redial, and so that it is
		// never 0, which netlink.Config reads as "no namespace".
		ns, err := unix.FcntlInt(uintptr(netnsFD), unix.F_DUPFD_CLOEXEC, 3)
		if err != nil {
			return nil, fmt.Errorf("dup netns fd %d: %w", netnsFD, err)
		}
		d.ns = ns
	}
	if err := d.dial(); err != nil {
		if d.ns >= 0 {
			unix.Close(d.ns)
		}
		return nil, err
	}
	return d, nil
}

func (d *DiagConn) dial() error {
	cfg := &netlink.Config{MessageBufferSize: recvBufSize}
	if d.ns >= 0 {
		cfg.NetNS = d.ns
	}
	c, err := netlink.Dial(unix.NETLINK_SOCK_DIAG, cfg)
	if err != nil {
		return fmt.Errorf("open sock_diag socket: %w", err)
	}
	d.c = c
	d.batch = 1
	if rc, err := c.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			if n, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF); err == nil {
				d.batch = min(max(n/lookupReplyCharge, 1), lookupBatch)
			}
		})
	}
	return nil
}

// Close closes the socket.
func (d *DiagConn) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	var err error
	if d.c != nil {
		err = d.c.Close()
		d.c = nil
	}
	if d.ns >= 0 {
		unix.Close(d.ns)
		d.ns = -1
	}
	return err
}

// DumpTCP returns the TCP sockets (IPv4 and IPv6) of the namespace that f
// selects, read in one dump per address family. Canceling ctx interrupts
// the dump; the next call reopens the socket.
func (d *DiagConn) DumpTCP(ctx context.Context, f Filter) ([]TCPSocket, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if d.c == nil {
		if d.closed {
			return nil, ErrClosed
		}
		if err := d.dial(); err != nil {
			return nil, err
		}
	}
	if f.States == 0 {
		f.States = StatesAll
	}
	if f.Cgroups != nil && len(f.Cgroups) == 0 {
		return nil, nil
	}
	var bc []byte
	if !f.userSpace && len(f.Cgroups) <= maxBytecodeCgroups {
		bc = cgroupBytecode(f.Cgroups) // nil for no filter
	}
	var set map[uint64]struct{}
	if f.Cgroups != nil && bc == nil {
		set = make(map[uint64]struct{}, len(f.Cgroups))
		for _, id := range f.Cgroups {
			set[id] = struct{}{}
		}
	}

	// The netlink library reads with no context: a deadline in the past
	// unblocks the read when ctx ends.
	c := d.c
	stop := context.AfterFunc(ctx, func() { _ = c.SetReadDeadline(time.Unix(1, 0)) })
	out, err := d.dump(f, bc, set)
	if !stop() || err != nil {
		// A dump left half read (or a deadline that may have fired) would
		// confuse the next request on this socket: start afresh next time.
		_ = d.c.Close()
		d.c = nil
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("sock_diag dump: %w", ctx.Err())
		}
		return nil, err
	}
	return out, nil
}

func (d *DiagConn) dump(f Filter, bc []byte, set map[uint64]struct{}) ([]TCPSocket, error) {
	var out []TCPSocket
	for _, fam := range []uint8{unix.AF_INET, unix.AF_INET6} {
		if f.Family != 0 && f.Family != fam {
			continue
		}
		req, err := d.c.Send(netlink.Message{
			Header: netlink.Header{Type: sockDiagByFamily, Flags: netlink.Request | netlink.Dump},
			Data:   marshalInetDiagReq(fam, f.States, bc),
		})
		if err != nil {
			return nil, fmt.Errorf("sock_diag dump request: %w", err)
		}
		// Decoding as the datagrams arrive keeps one of them in memory, not
		// the whole dump.
		for m, err := range d.c.ReceiveIter() {
			if err != nil {
				if bc != nil && errors.Is(err, unix.EINVAL) {
					// inet_diag_bc_audit refused INET_DIAG_BC_CGROUP_COND,
					// which kernels before 5.7 do not know.
					return nil, fmt.Errorf("%w: %w", ErrNoCgroupID, err)
				}
				return nil, fmt.Errorf("sock_diag dump of family %d: %w", fam, err)
			}
			if m.Header.Sequence != req.Header.Sequence || m.Header.Type != sockDiagByFamily {
				return nil, fmt.Errorf("sock_diag: unexpected message type %d seq %d in dump seq %d",
					m.Header.Type, m.Header.Sequence, req.Header.Sequence)
			}
			s, err := decodeInetDiagMsg(m.Data)
			if err != nil {
				return nil, err
			}
			if set != nil {
				if s.Cgroup == 0 && s.Info != nil {
					// A full socket without INET_DIAG_CGROUP_ID: the kernel
					// cannot tell us any socket's cgroup.
					return nil, ErrNoCgroupID
				}
				if _, ok := set[s.Cgroup]; !ok {
					continue
				}
			}
			out = append(out, s)
		}
	}
	return out, nil
}

// DumpTCP opens a sock_diag socket in the network namespace netnsFD (< 0:
// the caller's own), dumps the TCP sockets f selects, and closes it. A
// caller that dumps repeatedly keeps a [DiagConn] instead.
func DumpTCP(ctx context.Context, netnsFD int, f Filter) ([]TCPSocket, error) {
	d, err := DialDiag(netnsFD)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return d.DumpTCP(ctx, f)
}

// marshalInetDiagReq builds a struct inet_diag_req_v2 asking for fam's TCP
// sockets in states with their tcp_info, followed by the filter bytecode
// if bc is not nil.
func marshalInetDiagReq(fam uint8, states StateMask, bc []byte) []byte {
	n := sizeofInetDiagReqV2
	if bc != nil {
		n += 4 + len(bc)
	}
	b := make([]byte, n)
	b[0] = fam
	b[1] = unix.IPPROTO_TCP
	b[2] = 1 << (inetDiagInfo - 1) // idiag_ext: INET_DIAG_INFO
	binary.NativeEndian.PutUint32(b[4:], uint32(states))
	// id (all zero) matches any socket in a dump; the cookie is only
	// checked for exact lookups.
	if bc != nil {
		a := b[sizeofInetDiagReqV2:]
		binary.NativeEndian.PutUint16(a[0:], uint16(4+len(bc)))
		binary.NativeEndian.PutUint16(a[2:], inetDiagReqBytecode)
		copy(a[4:], bc)
	}
	return b
}

// Cgroup filtering: in the kernel or in user space?
//
// The kernel can filter a dump by cgroup with INET_DIAG_BC_CGROUP_COND
// bytecode (exact ids; cgroupBytecode ORs a cgroup tree's), or this package
// can drop other cgroups' sockets after the dump. BenchmarkDumpTCP10k, one
// netns with 10,000 established loopback sockets, kernel 6.18, 2 cores,
// medians of 3 runs of 100 dumps (the machine is shared: +-20% noise):
//
//	                         every socket matches   none matches
//	no filter                22 ms                  -
//	user space, 1 id         23 ms                  18 ms
//	kernel,     1 id         25 ms                  2.0 ms
//	user space, 16 ids       27 ms                  -
//	kernel,     16 ids       22 ms                  -
//
// Nearly all of a dump is the kernel filling and copying each socket's
// message (tcp_info included; leaving it out saves under 20%), so where
// the filter keeps everything the two are equal within the noise, and
// where it keeps little the kernel's is about 10x faster: a node's netns
// holds other processes' sockets too. So the kernel filters, and user
// space only takes over past maxBytecodeCgroups ids.

// cgroupBytecode builds inet_diag bytecode that accepts a socket whose
// cgroup id is any of ids. The bytecode runs (inet_diag_bc_run in
// net/ipv4/inet_diag.c) until its remaining length is exactly 0 (accept) or
// below 0 (reject); every op jumps forward by yes or no bytes. Each id is
//
//	CGROUP_COND{yes: 12, no: 16} id   // match: fall into the JMP; else skip it
//	JMP{yes: 4, no: to the end}       // JMP always takes no: accept
//
// and the last COND's no jumps 4 bytes past the end: reject.
// inet_diag_bc_audit accepts this: every jump is forward, 4-aligned, at
// most 4 past the end, and lands on an op on the yes-chain.
func cgroupBytecode(ids []uint64) []byte {
	if len(ids) == 0 {
		return nil
	}
	const unit = 16
	b := make([]byte, unit*len(ids))
	for i, id := range ids {
		o := i * unit
		rest := len(b) - o // bytes from this COND to the end
		b[o] = inetDiagBCCgroupCond
		b[o+1] = 12
		no := 16
		if i == len(ids)-1 {
			no = rest + 4
		}
		binary.NativeEndian.PutUint16(b[o+2:], uint16(no))
		binary.NativeEndian.PutUint64(b[o+4:], id)
		b[o+12] = inetDiagBCJmp
		b[o+13] = 4
		binary.NativeEndian.PutUint16(b[o+14:], uint16(rest-12))
	}
	return b
}

// decodeInetDiagMsg decodes one SOCK_DIAG_BY_FAMILY reply: a struct
// inet_diag_msg followed by netlink attributes. It never panics; bytes it
// cannot make sense of are an error.
func decodeInetDiagMsg(b []byte) (TCPSocket, error) {
	var s TCPSocket
	if len(b) < sizeofInetDiagMsg {
		return s, fmt.Errorf("sock_diag: inet_diag_msg of %d bytes, want %d", len(b), sizeofInetDiagMsg)
	}
	s.Family = b[offMsgFamily]
	s.State = b[offMsgState]
	sport := binary.BigEndian.Uint16(b[offMsgSport:])
	dport := binary.BigEndian.Uint16(b[offMsgDport:])
	switch s.Family {
	case unix.AF_INET:
		s.Local = netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[offMsgSrc:offMsgSrc+4])), sport)
		s.Remote = netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[offMsgDst:offMsgDst+4])), dport)
	case unix.AF_INET6:
		s.Local = netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[offMsgSrc:offMsgSrc+16])), sport)
		s.Remote = netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[offMsgDst:offMsgDst+16])), dport)
	default:
		return s, fmt.Errorf("sock_diag: socket of address family %d", s.Family)
	}
	ne := binary.NativeEndian
	s.Interface = ne.Uint32(b[offMsgIf:])
	s.Cookie = uint64(ne.Uint32(b[offMsgCookie:])) | uint64(ne.Uint32(b[offMsgCookie+4:]))<<32
	s.RQueue = ne.Uint32(b[offMsgRqueue:])
	s.WQueue = ne.Uint32(b[offMsgWqueue:])
	s.UID = ne.Uint32(b[offMsgUID:])
	s.Inode = ne.Uint32(b[offMsgInode:])

	attrs := b[sizeofInetDiagMsg:]
	for len(attrs) > 0 {
		if len(attrs) < 4 {
			return s, fmt.Errorf("sock_diag: %d trailing bytes after attributes", len(attrs))
		}
		n := int(ne.Uint16(attrs[0:]))
		typ := ne.Uint16(attrs[2:]) & nlaTypeMask
		if n < 4 || n > len(attrs) {
			return s, fmt.Errorf("sock_diag: attribute %d of length %d in %d bytes", typ, n, len(attrs))
		}
		v := attrs[4:n]
		switch typ {
		case inetDiagInfo:
			info := decodeTCPInfo(v)
			s.Info = &info
		case inetDiagCgroupID:
			if len(v) != 8 {
				return s, fmt.Errorf("sock_diag: cgroup id attribute of %d bytes", len(v))
			}
			s.Cgroup = ne.Uint64(v)
		}
		// Attributes are 4-aligned; the last one's padding may be cut.
		attrs = attrs[min(nlaAlign(n), len(attrs)):]
	}
	return s, nil
}

func nlaAlign(n int) int { return (n + 3) &^ 3 }

// InfoOf reads the tcp_info of TCP socket fd (getsockopt TCP_INFO), as
// much of it as the kernel has: the same struct a lookup's reply carries,
// and the one the shim reads (libmpi-shim/tcpsent.c).
func InfoOf(fd int) (TCPInfo, error) {
	b := make([]byte, 512)
	n := uint32(len(b))
	if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.IPPROTO_TCP, unix.TCP_INFO,
		uintptr(unsafe.Pointer(&b[0])), uintptr(unsafe.Pointer(&n)), 0); e != 0 {
		return TCPInfo{}, fmt.Errorf("getsockopt TCP_INFO: %w", e)
	}
	return decodeTCPInfo(b[:min(int(n), len(b))]), nil
}

// decodeTCPInfo decodes the fields of TCPInfo from a struct tcp_info of any
// length: a field past the end of b stays zero.
func decodeTCPInfo(b []byte) TCPInfo {
	u8 := func(off int) uint8 {
		if off < len(b) {
			return b[off]
		}
		return 0
	}
	u32 := func(off int) uint32 {
		if off+4 <= len(b) {
			return binary.NativeEndian.Uint32(b[off:])
		}
		return 0
	}
	u64 := func(off int) uint64 {
		if off+8 <= len(b) {
			return binary.NativeEndian.Uint64(b[off:])
		}
		return 0
	}
	us := func(off int) time.Duration { return time.Duration(u32(off)) * time.Microsecond }
	ms := func(off int) time.Duration { return time.Duration(u32(off)) * time.Millisecond }
	return TCPInfo{
		Len:           len(b),
		State:         u8(offTIState),
		Retransmits:   u8(offTIRetransmits),
		RTO:           us(offTIRTO),
		Unacked:       u32(offTIUnacked),
		Lost:          u32(offTILost),
		Retrans:       u32(offTIRetrans),
		LastDataSent:  ms(offTILastDataSent),
		LastDataRecv:  ms(offTILastDataRecv),
		RTT:           us(offTIRTT),
		RTTVar:        us(offTIRTTVar),
		MinRTT:        us(offTIMinRTT),
		TotalRetrans:  u32(offTITotalRetrans),
		BytesAcked:    u64(offTIBytesAcked),
		BytesReceived: u64(offTIBytesRecv),
		BytesSent:     u64(offTIBytesSent),
		BytesRetrans:  u64(offTIBytesRetrans),
		NotsentBytes:  u32(offTINotsent),
	}
}

// ID names one socket for [DiagConn.LookupTCP]: its 4-tuple as the socket
// sees it and its cookie.
type ID struct {
	Local, Remote netip.AddrPort
	Cookie        uint64
}

// LookupTCP reads the sockets ids name, each by an exact lookup
// (SOCK_DIAG_BY_FAMILY without NLM_F_DUMP: inet_diag_find_one_icsk, a hash
// lookup of the 4-tuple, then the cookie compared), so that its cost is
// that of the sockets asked for, not of the namespace's hash tables, which
// a dump walks bucket by bucket whatever they hold. ok[i] says whether
// ids[i] is still there; a socket closed since, or its 4-tuple reused by
// another (another cookie), is not. Each comes with its tcp_info (read
// under the socket's lock, after the queues, which are read without it).
func (d *DiagConn) LookupTCP(ctx context.Context, ids []ID) (out []TCPSocket, ok []bool, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	if d.c == nil {
		if d.closed {
			return nil, nil, ErrClosed
		}
		if err := d.dial(); err != nil {
			return nil, nil, err
		}
	}
	c := d.c
	stop := context.AfterFunc(ctx, func() { _ = c.SetReadDeadline(time.Unix(1, 0)) })
	out, ok = make([]TCPSocket, len(ids)), make([]bool, len(ids))
	for i := 0; i < len(ids) && err == nil; i += d.batch {
		j := min(i+d.batch, len(ids))
		err = d.lookupBatch(ids[i:j], out[i:j], ok[i:j])
	}
	if !stop() || err != nil {
		_ = d.c.Close()
		d.c = nil
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, fmt.Errorf("sock_diag lookup: %w", ctx.Err())
		}
		return nil, nil, err
	}
	return out, ok, nil
}

// The requests LookupTCP sends at once have their replies queued on the
// socket before it reads one, so they must fit its receive buffer
// (SO_RCVBUF, about 208 KiB by default, as the kernel counts it): a reply
// that does not fit is dropped and the read fails with ENOBUFS. The kernel
// charges each reply its skb's whole allocation, about 1.2 KiB for the 400
// bytes of a socket with its tcp_info here (192 at once overflowed the
// default buffer, 128 did not); lookupReplyCharge leaves room for a larger
// tcp_info. lookupBatch bounds a batch where the buffer is large.
const (
	lookupReplyCharge = 2 << 10
	lookupBatch       = 256
)

// lookupBatch sends the lookups of ids in one sendmsg, then reads one reply
// each (the kernel answers the requests of the datagram in turn: a
// SOCK_DIAG_BY_FAMILY message, or an NLMSG_ERROR). A lookup's kernel work
// is a hash lookup; one request and one reply each cost more in system
// calls and in the netlink library's checks (15-30 µs a socket, measured)
// than this, one call for all and one a reply.
func (d *DiagConn) lookupBatch(ids []ID, out []TCPSocket, found []bool) error {
	const hdr = unix.SizeofNlMsghdr
	req := make([]byte, 0, len(ids)*(hdr+sizeofInetDiagReqV2))
	d.seq++
	base := d.seq
	d.seq += uint32(len(ids))
	for i, id := range ids {
		body, err := marshalInetDiagLookup(id)
		if err != nil {
			return err
		}
		h := make([]byte, hdr)
		binary.NativeEndian.PutUint32(h[0:], uint32(hdr+len(body)))
		binary.NativeEndian.PutUint16(h[4:], sockDiagByFamily)
		binary.NativeEndian.PutUint16(h[6:], unix.NLM_F_REQUEST)
		binary.NativeEndian.PutUint32(h[8:], base+uint32(i))
		req = append(append(req, h...), body...)
	}
	rc, err := d.c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Write(func(fd uintptr) bool {
		serr = unix.Sendto(int(fd), req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
		return serr != unix.EAGAIN
	}); err != nil {
		return fmt.Errorf("sock_diag lookup request: %w", err)
	}
	if serr != nil {
		return fmt.Errorf("sock_diag lookup request: %w", serr)
	}
	buf := make([]byte, recvBufSize)
	for left := len(ids); left > 0; {
		var n int
		if err := rc.Read(func(fd uintptr) bool {
			n, _, serr = unix.Recvfrom(int(fd), buf, 0)
			return serr != unix.EAGAIN
		}); err != nil {
			return fmt.Errorf("sock_diag lookup reply: %w", err)
		}
		if serr != nil {
			return fmt.Errorf("sock_diag lookup reply: %w", serr)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return fmt.Errorf("sock_diag lookup reply: %w", err)
		}
		for _, m := range msgs {
			k := int(m.Header.Seq - base)
			if m.Header.Seq < base || k >= len(ids) {
				continue // a reply to an earlier request, given up
			}
			left--
			switch m.Header.Type {
			case sockDiagByFamily:
				if out[k], err = decodeInetDiagMsg(m.Data); err != nil {
					return err
				}
				found[k] = out[k].Cookie == ids[k].Cookie
			case unix.NLMSG_ERROR:
				if len(m.Data) < 4 {
					return fmt.Errorf("sock_diag lookup: an error reply of %d bytes", len(m.Data))
				}
				// ENOENT: no socket has the 4-tuple; ESTALE: one has,
				// with another cookie (sock_diag_check_cookie).
				switch e := syscall.Errno(-int32(binary.NativeEndian.Uint32(m.Data))); e {
				case unix.ENOENT, unix.ESTALE:
				default:
					return fmt.Errorf("sock_diag lookup of %v -> %v: %w", ids[k].Local, ids[k].Remote, e)
				}
			default:
				return fmt.Errorf("sock_diag lookup: reply of type %d", m.Header.Type)
			}
		}
	}
	return nil
}

// marshalInetDiagLookup builds the struct inet_diag_req_v2 of an exact
// lookup of id. The kernel looks an AF_INET6 request with two v4-mapped
// addresses up among the IPv4 sockets, where a dual-stack socket talking
// IPv4 is; an IPv4 id is asked as AF_INET.
func marshalInetDiagLookup(id ID) ([]byte, error) {
	l, r := id.Local.Addr(), id.Remote.Addr()
	if !l.IsValid() || !r.IsValid() || l.Is4() != r.Is4() {
		return nil, fmt.Errorf("sock_diag lookup: addresses %v and %v", id.Local, id.Remote)
	}
	b := make([]byte, sizeofInetDiagReqV2)
	b[0] = unix.AF_INET6
	if l.Is4() {
		b[0] = unix.AF_INET
	}
	b[1] = unix.IPPROTO_TCP
	b[2] = 1 << (inetDiagInfo - 1) // idiag_ext: INET_DIAG_INFO
	binary.NativeEndian.PutUint32(b[4:], uint32(StatesAll))
	// struct inet_diag_sockid starts at byte 8 of the request; its
	// offsets within are those of inet_diag_msg's id less 4.
	const sockid = 8 - offMsgSport
	binary.BigEndian.PutUint16(b[sockid+offMsgSport:], id.Local.Port())
	binary.BigEndian.PutUint16(b[sockid+offMsgDport:], id.Remote.Port())
	if l.Is4() {
		a, c := l.As4(), r.As4()
		copy(b[sockid+offMsgSrc:], a[:])
		copy(b[sockid+offMsgDst:], c[:])
	} else {
		a, c := l.As16(), r.As16()
		copy(b[sockid+offMsgSrc:], a[:])
		copy(b[sockid+offMsgDst:], c[:])
	}
	binary.NativeEndian.PutUint32(b[sockid+offMsgCookie:], uint32(id.Cookie))
	binary.NativeEndian.PutUint32(b[sockid+offMsgCookie+4:], uint32(id.Cookie>>32))
	return b, nil
}
