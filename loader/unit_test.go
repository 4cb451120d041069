package loader

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"strings"
	"testing"
	"testing/iotest"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"
)

func TestBPFFSFrom(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want string
	}{
		{
			name: "sysfs",
			in: `22 1 0:21 / /proc rw,nosuid - proc proc rw
35 24 0:30 / /sys/fs/bpf rw,nosuid,nodev shared:14 - bpf bpf rw,mode=700
`,
			want: "/sys/fs/bpf",
		},
		{
			name: "elsewhere, as inside ip netns exec",
			in:   "99 98 0:30 / /run/mpipause/bpf\\040fs rw - bpf none rw\n",
			want: "/run/mpipause/bpf fs",
		},
		{name: "none", in: "22 1 0:21 / /proc rw - proc proc rw\n41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"},
		{name: "empty"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := bpffsFrom(strings.NewReader(tt.in))
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Errorf("bpffsFrom = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestNetnsPath(t *testing.T) {
	tests := []struct {
		name, in, path, label string
	}{
		{name: "bare name", in: "node1", path: "/run/netns/node1", label: "node1"},
		{name: "named path", in: "/run/netns/node2", path: "/run/netns/node2", label: "node2"},
		{name: "proc path", in: "/proc/42/ns/net", path: "/proc/42/ns/net", label: "/proc/42/ns/net"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, label := netnsPath(tt.in)
			if path != tt.path || label != tt.label {
				t.Errorf("netnsPath(%q) = %q, %q; want %q, %q", tt.in, path, label, tt.path, tt.label)
			}
		})
	}
}

func recordBytes(rs ...record) []byte {
	if len(rs) == 0 {
		return nil
	}
	return append([]byte(nil), unsafe.Slice((*byte)(unsafe.Pointer(&rs[0])), len(rs)*recordSize)...)
}

func TestConnFromRecord(t *testing.T) {
	boot := 1000 * time.Hour
	v4 := record{Cookie: 7, CgroupId: 9, EstablishedNs: 5e9, BytesSent: 3, BytesRecv: 4, Retransmits: 1,
		WriteSeq: 5, SndNxt: 5, SndUna: 0xfffffffb, RcvNxt: 2, CopiedSeq: 0xfffffff0, Flags: 1, State: 1}
	v4.Tuple.Family, v4.Tuple.Sport, v4.Tuple.Dport = afInet, 1234, 80
	copy(v4.Tuple.Saddr[:], []byte{192, 0, 2, 1})
	copy(v4.Tuple.Daddr[:], []byte{192, 0, 2, 2})
	mapped := record{State: 8}
	mapped.Tuple.Family, mapped.Tuple.Sport, mapped.Tuple.Dport = afInet6, 1, 2
	mapped.Tuple.Saddr = netip.MustParseAddr("::ffff:127.0.0.1").As16()
	mapped.Tuple.Daddr = netip.MustParseAddr("::1").As16()

	tests := []struct {
		name string
		in   record
		want Conn
	}{
		{
			name: "ipv4, sequence numbers wrapped",
			in:   v4,
			want: Conn{Cookie: 7, Local: netip.MustParseAddrPort("192.0.2.1:1234"), Remote: netip.MustParseAddrPort("192.0.2.2:80"),
				State: StateEstablished, Netns: "n", Cgroup: 9, WriteSeq: 5, SndNxt: 5, SndUna: 0xfffffffb, RcvNxt: 2, CopiedSeq: 0xfffffff0,
				SendQueue: 10, Unread: 18, Counted: true, BytesSent: 3, BytesRecv: 4, Retransmits: 1,
				Established: time.Unix(0, 5e9).Add(boot)},
		},
		{
			name: "v4-mapped unmapped, adopted without time",
			in:   mapped,
			want: Conn{Local: netip.MustParseAddrPort("127.0.0.1:1"), Remote: netip.MustParseAddrPort("[::1]:2"), State: StateCloseWait, Netns: "n"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := tt.in.conn("n", boot)
			if diff := cmp.Diff(tt.want, got, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
				t.Errorf("conn (-want +got):\n%s", diff)
			}
		})
	}
}

func TestConns(t *testing.T) {
	// Namespaces 2 and 4 are not watched; runs of one namespace, and a
	// namespace coming back after another, as a pass over the map yields.
	var recs []record
	for i, ino := range []uint32{1, 1, 2, 3, 3, 1, 4, 4, 3} {
		recs = append(recs, record{Cookie: uint64(i), Netns: ino})
	}
	got, unknown := conns(recs, map[uint32]string{1: "a", 3: "c"}, 0)
	if !unknown {
		t.Errorf("conns with records of namespaces 2 and 4 says none was unknown")
	}
	type cn struct {
		Cookie uint64
		Netns  string
	}
	var short []cn
	for _, c := range got {
		short = append(short, cn{c.Cookie, c.Netns})
	}
	want := []cn{{0, "a"}, {1, "a"}, {3, "c"}, {4, "c"}, {5, "a"}, {8, "c"}}
	if diff := cmp.Diff(want, short); diff != "" {
		t.Errorf("conns (-want +got):\n%s", diff)
	}
	if got, unknown := conns(nil, nil, 0); len(got) != 0 || unknown {
		t.Errorf("conns of no records: %d, unknown %v", len(got), unknown)
	}
	if got, unknown := conns(recs[2:3], map[uint32]string{1: "a"}, 0); len(got) != 0 || !unknown {
		t.Errorf("conns of an unwatched namespace's record: %v, unknown %v", got, unknown)
	}
	if _, unknown := conns(recs[:2], map[uint32]string{1: "a"}, 0); unknown {
		t.Errorf("conns of watched namespaces' records says one was unknown")
	}
}

func TestReadRecords(t *testing.T) {
	var in []record
	for i := range 1000 {
		in = append(in, record{Cookie: uint64(i + 1)})
	}
	got, err := readRecords(iotest.HalfReader(bytes.NewReader(recordBytes(in...))), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(in) || got[999].Cookie != 1000 {
		t.Fatalf("read %d records, last cookie %d", len(got), got[len(got)-1].Cookie)
	}
	if _, err := readRecords(bytes.NewReader(make([]byte, recordSize+1)), nil); err == nil {
		t.Error("a partial record was accepted")
	}
}

// pass frames a conniter pass as bpf/conniter.bpf.c does: n objects, of
// which the first room are in the array mem and the rest in the tail.
func pass(n, room int) (mem, tail []byte) {
	var all []record
	for i := range n {
		all = append(all, record{Cookie: uint64(i + 1)})
	}
	mem = make([]byte, room*recordSize)
	copy(mem, recordBytes(all[:min(n, room)]...))
	if n > 0 {
		tail = make([]byte, 8)
	}
	if n > room {
		tail = append(tail, recordBytes(all[room:]...)...)
	}
	last := max(n-1, 0)
	return mem, binary.LittleEndian.AppendUint64(tail, uint64(last))
}

func TestSplitPass(t *testing.T) {
	tests := []struct {
		name    string
		n, room int
	}{
		{name: "empty", n: 0, room: 4},
		{name: "one", n: 1, room: 4},
		{name: "full", n: 4, room: 4},
		{name: "spill", n: 9, room: 4},
		{name: "all spill", n: 3, room: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mem, tail := pass(tt.n, tt.room)
			var buf []record
			got, err := splitPass(mem, tail, &buf)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != tt.n {
				t.Fatalf("%d records, want %d", len(got), tt.n)
			}
			for i, r := range got {
				if r.Cookie != uint64(i+1) {
					t.Fatalf("record %d has cookie %d", i, r.Cookie)
				}
			}
		})
	}
	mem, tail := pass(5, 4)
	for _, bad := range [][]byte{nil, tail[:7], tail[:len(tail)-1], tail[8:]} {
		if _, err := splitPass(mem, bad, new([]record)); err == nil {
			t.Errorf("splitPass accepted a %d-byte tail", len(bad))
		}
	}
}

// FuzzSplitPass feeds splitPass arbitrary iterator output: it must return
// an error or records, never panic or read past what it was given.
func FuzzSplitPass(f *testing.F) {
	for _, c := range []struct{ n, room int }{{0, 2}, {1, 2}, {3, 2}} {
		_, tail := pass(c.n, c.room)
		f.Add(tail, uint8(c.room))
	}
	f.Fuzz(func(t *testing.T, tail []byte, room uint8) {
		mem := make([]byte, int(room%8)*recordSize)
		recs, err := splitPass(mem, tail, new([]record))
		if err == nil && len(recs) > len(mem)/recordSize+len(tail)/recordSize {
			t.Fatalf("%d records from %d bytes", len(recs), len(mem)+len(tail))
		}
	})
}

// BenchmarkConvert10k times the user-space half of a Snapshot of 10,000
// sockets: turning the records into Conns.
func BenchmarkConvert10k(b *testing.B) {
	recs := make([]record, 10000)
	for i := range recs {
		recs[i].Tuple.Family = afInet
		recs[i].Cookie = uint64(i)
		recs[i].Netns = 1
	}
	labels := map[uint32]string{1: "n"}
	for b.Loop() {
		conns(recs, labels, 0)
	}
}
