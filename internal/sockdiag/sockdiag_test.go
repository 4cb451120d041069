package sockdiag

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf/btf"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"golang.org/x/sys/unix"
)

// diagCmp compares TCPSockets (netip values have unexported fields).
var diagCmp = cmpopts.EquateComparable(netip.AddrPort{})

// encodeInetDiagMsg lays s out as the kernel does (inet_sk_diag_fill,
// net/ipv4/inet_diag.c): struct inet_diag_msg, then INET_DIAG_INFO with
// s.Info.Len bytes of struct tcp_info, then INET_DIAG_CGROUP_ID. It writes
// by offset on purpose, independently of the decoder's helpers.
func encodeInetDiagMsg(s TCPSocket) []byte {
	b := make([]byte, 72)
	b[0], b[1] = s.Family, s.State
	binary.BigEndian.PutUint16(b[4:], s.Local.Port())
	binary.BigEndian.PutUint16(b[6:], s.Remote.Port())
	if s.Family == unix.AF_INET {
		a, r := s.Local.Addr().As4(), s.Remote.Addr().As4()
		copy(b[8:], a[:])
		copy(b[24:], r[:])
	} else {
		a, r := s.Local.Addr().As16(), s.Remote.Addr().As16()
		copy(b[8:], a[:])
		copy(b[24:], r[:])
	}
	ne := binary.NativeEndian
	ne.PutUint32(b[40:], s.Interface)
	ne.PutUint32(b[44:], uint32(s.Cookie))
	ne.PutUint32(b[48:], uint32(s.Cookie>>32))
	ne.PutUint32(b[56:], s.RQueue)
	ne.PutUint32(b[60:], s.WQueue)
	ne.PutUint32(b[64:], s.UID)
	ne.PutUint32(b[68:], s.Inode)
	if s.Info != nil {
		b = appendAttr(b, 2, encodeTCPInfo(*s.Info))
	}
	if s.Cgroup != 0 {
		b = appendAttr(b, 21, ne.AppendUint64(nil, s.Cgroup))
	}
	return b
}

func appendAttr(b []byte, typ uint16, v []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(4+len(v)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, v...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// encodeTCPInfo lays out a struct tcp_info of i.Len bytes (linux/tcp.h).
func encodeTCPInfo(i TCPInfo) []byte {
	b := make([]byte, i.Len)
	ne := binary.NativeEndian
	put8 := func(off int, v uint8) {
		if off < len(b) {
			b[off] = v
		}
	}
	put32 := func(off int, v uint32) {
		if off+4 <= len(b) {
			ne.PutUint32(b[off:], v)
		}
	}
	put64 := func(off int, v uint64) {
		if off+8 <= len(b) {
			ne.PutUint64(b[off:], v)
		}
	}
	us := func(d time.Duration) uint32 { return uint32(d / time.Microsecond) }
	ms := func(d time.Duration) uint32 { return uint32(d / time.Millisecond) }
	put8(0, i.State)
	put8(2, i.Retransmits)
	put32(8, us(i.RTO))
	put32(24, i.Unacked)
	put32(32, i.Lost)
	put32(36, i.Retrans)
	put32(44, ms(i.LastDataSent))
	put32(52, ms(i.LastDataRecv))
	put32(68, us(i.RTT))
	put32(72, us(i.RTTVar))
	put32(100, i.TotalRetrans)
	put64(120, i.BytesAcked)
	put64(128, i.BytesReceived)
	put32(144, i.NotsentBytes)
	put32(148, us(i.MinRTT))
	put64(200, i.BytesSent)
	put64(208, i.BytesRetrans)
	return b
}

func established4() TCPSocket {
	return TCPSocket{
		Family:    unix.AF_INET,
		State:     tcpEstablished,
		Local:     netip.MustParseAddrPort("10.1.2.3:40000"),
		Remote:    netip.MustParseAddrPort("10.1.2.4:5201"),
		Cookie:    0x0000_1234_8000_0001, // both halves used, high bit of the low half set
		RQueue:    13000,
		WQueue:    7,
		UID:       1000,
		Inode:     987654,
		Cgroup:    0x1_0000_0042,
		Interface: 0,
		Info: &TCPInfo{
			Len: 280, State: tcpEstablished, Retransmits: 1, RTO: 204 * time.Millisecond,
			Unacked: 2, Lost: 1, Retrans: 1, LastDataSent: 5 * time.Millisecond,
			LastDataRecv: 9 * time.Millisecond, RTT: 51 * time.Microsecond, RTTVar: 25 * time.Microsecond,
			MinRTT: 12 * time.Microsecond, TotalRetrans: 3, BytesAcked: 1 << 40, BytesReceived: 1<<33 + 5,
			BytesSent: 1<<40 + 9, BytesRetrans: 4096, NotsentBytes: 3,
		},
	}
}

func TestDecodeInetDiagMsg(t *testing.T) {
	v6 := established4()
	v6.Family = unix.AF_INET6
	v6.Local = netip.MustParseAddrPort("[fe80::1]:1")
	v6.Remote = netip.MustParseAddrPort("[2001:db8::ff00:42:8329]:65535")
	v6.Interface = 4

	mapped := established4()
	mapped.Family = unix.AF_INET6
	mapped.Local = netip.MustParseAddrPort("[::ffff:127.0.0.1]:80")
	mapped.Remote = netip.MustParseAddrPort("[::ffff:127.0.0.1]:33000")

	oldInfo := established4() // a kernel whose tcp_info ends at tcpi_total_retrans
	oldInfo.Info = &TCPInfo{Len: 104, State: tcpEstablished, RTT: 7 * time.Microsecond, TotalRetrans: 2}

	timeWait := TCPSocket{ // tcp_twsk_diag_fill: no attributes, no uid or inode
		Family: unix.AF_INET, State: tcpTimeWait,
		Local:  netip.MustParseAddrPort("127.0.0.1:41000"),
		Remote: netip.MustParseAddrPort("127.0.0.1:80"),
		Cookie: 77,
	}

	withExtra := func(s TCPSocket, attrs ...[]byte) []byte {
		b := encodeInetDiagMsg(s)
		for _, a := range attrs {
			b = append(b, a...)
		}
		return b
	}
	attr := func(typ uint16, v ...byte) []byte { return appendAttr(nil, typ, v) }

	cut := encodeInetDiagMsg(established4())

	tests := []struct {
		name    string
		in      []byte
		want    TCPSocket
		wantErr bool
	}{
		{name: "ipv4 established", in: encodeInetDiagMsg(established4()), want: established4()},
		{name: "ipv6 link-local", in: encodeInetDiagMsg(v6), want: v6},
		{name: "ipv6 v4-mapped kept as the kernel says", in: encodeInetDiagMsg(mapped), want: mapped},
		{name: "short tcp_info of an older kernel", in: encodeInetDiagMsg(oldInfo), want: oldInfo},
		{name: "time-wait without attributes", in: encodeInetDiagMsg(timeWait), want: timeWait},
		{
			name: "unknown, padding and flagged attributes",
			in: withExtra(timeWait,
				attr(8, 1),                              // INET_DIAG_SHUTDOWN
				attr(14),                                // INET_DIAG_PAD
				attr(0x8000|19, 1, 2, 3, 4),             // INET_DIAG_ULP_INFO, NLA_F_NESTED
				attr(0x4000|21, 9, 0, 0, 0, 0, 0, 0, 0), // cgroup id with NLA_F_NET_BYTEORDER set: type still matches
			),
			want: func() TCPSocket {
				s := timeWait
				s.Cgroup = binary.NativeEndian.Uint64([]byte{9, 0, 0, 0, 0, 0, 0, 0})
				return s
			}(),
		},
		{
			name: "last attribute without its padding",
			in:   append(encodeInetDiagMsg(timeWait), attr(8, 1)[:5]...),
			want: timeWait,
		},
		{name: "empty", in: nil, wantErr: true},
		{name: "header cut short", in: cut[:71], wantErr: true},
		{name: "unknown family", in: func() []byte { b := encodeInetDiagMsg(timeWait); b[0] = unix.AF_UNIX; return b }(), wantErr: true},
		{name: "attribute longer than the message", in: cut[:len(cut)-1], wantErr: true},
		{name: "attribute length below its header", in: withExtra(timeWait, []byte{2, 0, 1, 0}), wantErr: true},
		{name: "trailing bytes", in: withExtra(timeWait, []byte{1, 2}), wantErr: true},
		{name: "cgroup id of 4 bytes", in: withExtra(timeWait, attr(21, 1, 2, 3, 4)), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := decodeInetDiagMsg(tt.in)
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, want error %v", err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if diff := cmp.Diff(tt.want, got, diagCmp); diff != "" {
				t.Fatalf("decode (-want +got):\n%s", diff)
			}
		})
	}
}

func TestMarshalInetDiagReq(t *testing.T) {
	got := marshalInetDiagReq(unix.AF_INET6, StatesConnected, []byte{1, 2, 3, 4})
	want := make([]byte, 56+8)
	want[0], want[1], want[2] = unix.AF_INET6, unix.IPPROTO_TCP, 1<<(2-1)
	binary.NativeEndian.PutUint32(want[4:], 0xfff&^(1<<10|1<<3|1<<6|1<<7))
	binary.NativeEndian.PutUint16(want[56:], 8) // nla_len
	binary.NativeEndian.PutUint16(want[58:], 1) // INET_DIAG_REQ_BYTECODE
	copy(want[60:], []byte{1, 2, 3, 4})
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("request (-want +got):\n%s", diff)
	}
	if n := len(marshalInetDiagReq(unix.AF_INET, StatesAll, nil)); n != 56 {
		t.Fatalf("request without bytecode is %d bytes, want 56", n)
	}
}

// bcOp reads struct inet_diag_bc_op.
func bcOp(b []byte) (code, yes uint8, no uint16) {
	return b[0], b[1], binary.NativeEndian.Uint16(b[2:])
}

// bcAudit mirrors inet_diag_bc_audit and valid_cc (net/ipv4/inet_diag.c)
// for the ops cgroupBytecode emits.
func bcAudit(bc []byte) error {
	validCC := func(cc int) bool {
		b, n := bc, len(bc)
		for n >= 0 {
			if cc > n {
				return false
			}
			if cc == n {
				return true
			}
			if len(b) < 4 {
				return false
			}
			_, yes, _ := bcOp(b)
			if yes < 4 || yes&3 != 0 {
				return false
			}
			n -= int(yes)
			b = b[yes:]
		}
		return false
	}
	if len(bc) < 4 {
		return errors.New("EINVAL: shorter than one op")
	}
	b, n := bc, len(bc)
	for n > 0 {
		minLen := 4
		code, yes, no := bcOp(b)
		switch code {
		case inetDiagBCCgroupCond:
			minLen += 8
			if n < minLen {
				return errors.New("EINVAL: cgroup cond cut short")
			}
		case inetDiagBCJmp:
		default:
			return errors.New("EINVAL: unexpected op")
		}
		if int(no) < minLen || int(no) > n+4 || no&3 != 0 {
			return errors.New("EINVAL: bad no")
		}
		if int(no) < n && !validCC(n-int(no)) {
			return errors.New("EINVAL: no lands between ops")
		}
		if int(yes) < minLen || int(yes) > n+4 || yes&3 != 0 {
			return errors.New("EINVAL: bad yes")
		}
		n -= int(yes)
		if n > 0 {
			b = b[yes:]
		}
	}
	if n != 0 {
		return errors.New("EINVAL: yes chain overruns")
	}
	return nil
}

// bcRun mirrors inet_diag_bc_run for a socket of cgroup id.
func bcRun(bc []byte, id uint64) bool {
	b, n := bc, len(bc)
	for n > 0 {
		code, yes, no := bcOp(b)
		ok := true
		switch code {
		case inetDiagBCJmp:
			ok = false
		case inetDiagBCCgroupCond:
			ok = binary.NativeEndian.Uint64(b[4:]) == id
		}
		step := int(no)
		if ok {
			step = int(yes)
		}
		n -= step
		if n > 0 {
			b = b[step:]
		}
	}
	return n == 0
}

func TestCgroupBytecode(t *testing.T) {
	// One id, by hand: COND{12, 20} id, JMP{4, 4}.
	want := []byte{inetDiagBCCgroupCond, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, inetDiagBCJmp, 4, 0, 0}
	binary.NativeEndian.PutUint16(want[2:], 20)
	binary.NativeEndian.PutUint64(want[4:], 0x42)
	binary.NativeEndian.PutUint16(want[14:], 4)
	if diff := cmp.Diff(want, cgroupBytecode([]uint64{0x42})); diff != "" {
		t.Fatalf("bytecode for one id (-want +got):\n%s", diff)
	}

	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{1, 2, 3, 17, 255, maxBytecodeCgroups} {
		ids := make([]uint64, n)
		in := make(map[uint64]bool, n)
		for i := range ids {
			ids[i] = rng.Uint64()>>1 | 1
			in[ids[i]] = true
		}
		bc := cgroupBytecode(ids)
		if err := bcAudit(bc); err != nil {
			t.Fatalf("%d ids: kernel would refuse the bytecode: %v", n, err)
		}
		for _, id := range ids {
			if !bcRun(bc, id) {
				t.Fatalf("%d ids: id %#x rejected", n, id)
			}
		}
		for _, id := range []uint64{0, 1, ids[0] + 1, ids[n-1] ^ 2} {
			if !in[id] && bcRun(bc, id) {
				t.Fatalf("%d ids: id %#x accepted", n, id)
			}
		}
	}
}

// TestLayoutBTF checks the offsets the decoder uses against the running
// kernel's BTF, so a layout mistake cannot hide behind a test encoder that
// shares it.
func TestLayoutBTF(t *testing.T) {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		t.Skipf("kernel BTF (/sys/kernel/btf/vmlinux): %v", err)
	}
	offset := func(structName string, path ...string) (uint32, uint32) {
		t.Helper()
		var s *btf.Struct
		if err := spec.TypeByName(structName, &s); err != nil {
			t.Fatalf("BTF struct %s: %v", structName, err)
		}
		var off uint32
		for i, name := range path {
			var m *btf.Member
			for j := range s.Members {
				if s.Members[j].Name == name {
					m = &s.Members[j]
				}
			}
			if m == nil {
				t.Fatalf("BTF struct %s has no member %s", structName, name)
			}
			off += m.Offset.Bytes()
			if i == len(path)-1 {
				sz, err := btf.Sizeof(m.Type)
				if err != nil {
					t.Fatal(err)
				}
				return off, uint32(sz)
			}
			inner, ok := btf.UnderlyingType(m.Type).(*btf.Struct)
			if !ok {
				t.Fatalf("%s.%s is not a struct", structName, name)
			}
			s = inner
		}
		return off, 0
	}
	size := func(name string) int {
		var s *btf.Struct
		if err := spec.TypeByName(name, &s); err != nil {
			t.Fatalf("BTF struct %s: %v", name, err)
		}
		return int(s.Size)
	}

	if got := size("inet_diag_msg"); got != sizeofInetDiagMsg {
		t.Errorf("sizeof(inet_diag_msg) = %d, decoder uses %d", got, sizeofInetDiagMsg)
	}
	if got := size("inet_diag_req_v2"); got != sizeofInetDiagReqV2 {
		t.Errorf("sizeof(inet_diag_req_v2) = %d, request uses %d", got, sizeofInetDiagReqV2)
	}
	for _, f := range []struct {
		strct string
		path  []string
		off   int
		size  uint32
	}{
		{"inet_diag_msg", []string{"idiag_family"}, offMsgFamily, 1},
		{"inet_diag_msg", []string{"idiag_state"}, offMsgState, 1},
		{"inet_diag_msg", []string{"idiag_timer"}, offMsgTimer, 1},
		{"inet_diag_msg", []string{"idiag_retrans"}, offMsgRetrans, 1},
		{"inet_diag_msg", []string{"id", "idiag_sport"}, offMsgSport, 2},
		{"inet_diag_msg", []string{"id", "idiag_dport"}, offMsgDport, 2},
		{"inet_diag_msg", []string{"id", "idiag_src"}, offMsgSrc, 16},
		{"inet_diag_msg", []string{"id", "idiag_dst"}, offMsgDst, 16},
		{"inet_diag_msg", []string{"id", "idiag_if"}, offMsgIf, 4},
		{"inet_diag_msg", []string{"id", "idiag_cookie"}, offMsgCookie, 8},
		{"inet_diag_msg", []string{"idiag_expires"}, offMsgExpires, 4},
		{"inet_diag_msg", []string{"idiag_rqueue"}, offMsgRqueue, 4},
		{"inet_diag_msg", []string{"idiag_wqueue"}, offMsgWqueue, 4},
		{"inet_diag_msg", []string{"idiag_uid"}, offMsgUID, 4},
		{"inet_diag_msg", []string{"idiag_inode"}, offMsgInode, 4},
		{"inet_diag_req_v2", []string{"idiag_states"}, 4, 4},
		{"tcp_info", []string{"tcpi_state"}, offTIState, 1},
		{"tcp_info", []string{"tcpi_retransmits"}, offTIRetransmits, 1},
		{"tcp_info", []string{"tcpi_rto"}, offTIRTO, 4},
		{"tcp_info", []string{"tcpi_unacked"}, offTIUnacked, 4},
		{"tcp_info", []string{"tcpi_lost"}, offTILost, 4},
		{"tcp_info", []string{"tcpi_retrans"}, offTIRetrans, 4},
		{"tcp_info", []string{"tcpi_last_data_sent"}, offTILastDataSent, 4},
		{"tcp_info", []string{"tcpi_last_data_recv"}, offTILastDataRecv, 4},
		{"tcp_info", []string{"tcpi_rtt"}, offTIRTT, 4},
		{"tcp_info", []string{"tcpi_rttvar"}, offTIRTTVar, 4},
		{"tcp_info", []string{"tcpi_total_retrans"}, offTITotalRetrans, 4},
		{"tcp_info", []string{"tcpi_bytes_acked"}, offTIBytesAcked, 8},
		{"tcp_info", []string{"tcpi_bytes_received"}, offTIBytesRecv, 8},
		{"tcp_info", []string{"tcpi_notsent_bytes"}, offTINotsent, 4},
		{"tcp_info", []string{"tcpi_min_rtt"}, offTIMinRTT, 4},
		{"tcp_info", []string{"tcpi_bytes_sent"}, offTIBytesSent, 8},
		{"tcp_info", []string{"tcpi_bytes_retrans"}, offTIBytesRetrans, 8},
	} {
		off, sz := offset(f.strct, f.path...)
		if int(off) != f.off || sz != f.size {
			t.Errorf("%s.%v at %d (%d bytes), decoder uses %d (%d bytes)", f.strct, f.path, off, sz, f.off, f.size)
		}
	}
}

func FuzzDecodeInetDiagMsg(f *testing.F) {
	v6 := established4()
	v6.Family = unix.AF_INET6
	v6.Local = netip.MustParseAddrPort("[2001:db8::1]:1")
	for _, s := range []TCPSocket{established4(), v6, {
		Family: unix.AF_INET, State: tcpTimeWait,
		Local: netip.AddrPortFrom(netip.IPv4Unspecified(), 0), Remote: netip.AddrPortFrom(netip.IPv4Unspecified(), 0),
	}} {
		f.Add(encodeInetDiagMsg(s))
	}
	f.Add([]byte{})
	f.Add(make([]byte, 76))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := decodeInetDiagMsg(b)
		if err != nil {
			return
		}
		if s.Family != unix.AF_INET && s.Family != unix.AF_INET6 {
			t.Fatalf("decoded family %d without error", s.Family)
		}
		// What decodes must survive a round trip through the kernel's layout.
		again, err := decodeInetDiagMsg(encodeInetDiagMsg(s))
		if err != nil {
			t.Fatalf("re-encoded socket does not decode: %v", err)
		}
		if diff := cmp.Diff(s, again, diagCmp); diff != "" {
			t.Fatalf("round trip (-first +second):\n%s", diff)
		}
	})
}

func FuzzDecodeTCPInfo(f *testing.F) {
	f.Add(encodeTCPInfo(*established4().Info))
	f.Add(make([]byte, 104))
	f.Add([]byte{1})
	f.Fuzz(func(t *testing.T, b []byte) {
		i := decodeTCPInfo(b)
		if i.Len != len(b) {
			t.Fatalf("Len = %d for %d bytes", i.Len, len(b))
		}
		if again := decodeTCPInfo(encodeTCPInfo(i)); again != i {
			t.Fatalf("round trip: %+v then %+v", i, again)
		}
	})
}

// TestTaken: what a socket took is bytes sent, less those resent, plus
// those never sent; a tcp_info that ends before tcpi_bytes_retrans (a
// kernel before 4.19), or none, cannot say.
func TestTaken(t *testing.T) {
	b := make([]byte, offTIBytesRetrans+8)
	binary.NativeEndian.PutUint64(b[offTIBytesSent:], 5000)
	binary.NativeEndian.PutUint64(b[offTIBytesRetrans:], 1200)
	binary.NativeEndian.PutUint32(b[offTINotsent:], 300)
	full := decodeTCPInfo(b)
	if n, ok := full.Taken(); !ok || n != 4100 {
		t.Errorf("Taken: %d, %v; want 4100, true", n, ok)
	}
	short := decodeTCPInfo(b[:offTIBytesRetrans+4])
	if n, ok := short.Taken(); ok {
		t.Errorf("Taken of a %d-byte tcp_info: %d, true; want false", short.Len, n)
	}
	var none *TCPInfo
	if _, ok := none.Taken(); ok {
		t.Errorf("Taken of no tcp_info: true; want false")
	}
}
