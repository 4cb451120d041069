package quiesce

import (
	"errors"
	"fmt"
	"math/bits"
	"time"
)

// The binary encoding of a request or reply frame (wire version 2; version
// 1 was JSON). JSON cost about a fifth of a pause's CPU over TCP at 4,096
// simulated nodes (reflection, an allocation per field, deep stacks that
// goroutines had to grow), more than the HMAC and the agent together.
//
// The encoding is tagged, so that a field can be added the way an omitted
// JSON field could, without a new version: a body is a sequence of fields,
// each a uvarint key (tag<<3 | wire type) and a value. Wire type 0 is a
// uvarint (signed integers zigzag-encoded, booleans 1), wire type 2 a
// uvarint length and that many bytes: a string, or a nested message, a
// repeated field being the same tag again. A zero value is left out, as
// JSON's omitempty did; a receiver skips tags it does not know, and
// refuses any other wire type, a length past the end, and trailing bytes.
// The hellos stay JSON: they say which version follows.
//
// Nested messages are written with their length as a 4-byte uvarint
// (padded with continuation bits), so that the encoder writes them in
// place; a frame is bounded by MaxFrame, well below the 2^28 that four
// bytes can say.

const (
	wtVarint = 0
	wtBytes  = 2
)

// Field tags. Never reuse a tag for another meaning; add new ones.
const (
	// frame
	tagFrameTimeout = 1
	tagFrameMsg     = 2

	// Message
	tagMsgVersion = 1
	tagMsgJob     = 2
	tagMsgEpoch   = 3
	tagMsgSeq     = 4
	tagMsgKind    = 5
	tagMsgReply   = 6
	tagMsgNode    = 7 // repeated: Nodes
	tagMsgReport  = 8
	tagMsgErr     = 9
	tagMsgPayload = 10 // a nested message of the daemon's own (Message.Payload)
	tagMsgWait    = 11
	tagMsgFanout  = 12
	tagMsgCoord   = 13
	tagMsgPorts   = 14
	tagMsgDecider = 15
	tagMsgCheck   = 16

	// Report
	tagRepNodes        = 1
	tagRepPending      = 2 // repeated NodeReport
	tagRepChecked      = 3
	tagRepRanks        = 4
	tagRepDrained      = 5
	tagRepPorts        = 6
	tagRepOwn          = 7
	tagRepCounted      = 8
	tagRepDrainChecked = 9

	// NodeReport
	tagNodeNode       = 1
	tagNodeEmpty      = 2
	tagNodeConn       = 3 // repeated Conn
	tagNodeUngated    = 4
	tagNodeViolations = 5
	tagNodeErr        = 6
	tagNodeUnreached  = 7
	tagNodeChecked    = 8
	tagNodeRanks      = 9
	tagNodeDrained    = 10
	tagNodeRefused    = 11
	tagNodeFault      = 12
	tagNodeLate       = 13

	// Fault
	tagFaultCode = 1
	tagFaultRank = 2

	// Conn
	tagConnNode      = 1
	tagConnLocal     = 2
	tagConnRemote    = 3
	tagConnSendQueue = 4
	tagConnUnread    = 5
	tagConnRank      = 6
)

// --- encoding ---

func appendUvarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

func appendKey(b []byte, tag, wt int) []byte { return appendUvarint(b, uint64(tag)<<3|uint64(wt)) }

func appendUint(b []byte, tag int, v uint64) []byte {
	if v == 0 {
		return b
	}
	return appendUvarint(appendKey(b, tag, wtVarint), v)
}

func appendInt(b []byte, tag int, v int64) []byte {
	return appendUint(b, tag, uint64(v<<1)^uint64(v>>63))
}

func appendBool(b []byte, tag int, v bool) []byte {
	if !v {
		return b
	}
	return append(appendKey(b, tag, wtVarint), 1)
}

// appendStr writes s even when empty (an element of a repeated field).
func appendStr(b []byte, tag int, s string) []byte {
	b = appendUvarint(appendKey(b, tag, wtBytes), uint64(len(s)))
	return append(b, s...)
}

func appendString(b []byte, tag int, s string) []byte {
	if s == "" {
		return b
	}
	return appendStr(b, tag, s)
}

// beginNested starts a nested message; endNested, given what beginNested
// returned, writes its length in front of it.
func beginNested(b []byte, tag int) ([]byte, int) {
	b = append(appendKey(b, tag, wtBytes), 0x80, 0x80, 0x80, 0)
	return b, len(b)
}

func endNested(b []byte, start int) []byte {
	n := len(b) - start
	if n >= 1<<28 {
		// Far past MaxFrame, which the writer checks next: any length
		// will do, the frame is never sent.
		n = 1<<28 - 1
	}
	p := b[start-4 : start]
	p[0] = byte(n)&0x7f | 0x80
	p[1] = byte(n>>7)&0x7f | 0x80
	p[2] = byte(n>>14)&0x7f | 0x80
	p[3] = byte(n>>21) & 0x7f
	return b
}

func (f *frame) appendWire(b []byte) []byte { return appendFrame(b, f.TimeoutNanos, &f.Msg) }

func appendFrame(b []byte, timeout int64, m *Message) []byte {
	b = appendInt(b, tagFrameTimeout, timeout)
	b, at := beginNested(b, tagFrameMsg)
	b = m.appendWire(b)
	return endNested(b, at)
}

func (m *Message) appendWire(b []byte) []byte {
	b = appendInt(b, tagMsgVersion, int64(m.Version))
	b = appendString(b, tagMsgJob, m.Job)
	b = appendUint(b, tagMsgEpoch, m.Epoch)
	b = appendUint(b, tagMsgSeq, m.Seq)
	b = appendString(b, tagMsgKind, string(m.Kind))
	b = appendBool(b, tagMsgReply, m.Reply)
	for _, n := range m.Nodes {
		b = appendStr(b, tagMsgNode, n)
	}
	if m.Report != nil {
		var at int
		b, at = beginNested(b, tagMsgReport)
		b = m.Report.appendWire(b)
		b = endNested(b, at)
	}
	b = appendString(b, tagMsgErr, m.Err)
	if m.Payload != nil {
		// Written as a nested message is, so that the frame is the one a
		// daemon sent when the protocol still held the message's type.
		var at int
		b, at = beginNested(b, tagMsgPayload)
		b = append(b, m.Payload...)
		b = endNested(b, at)
	}
	b = appendInt(b, tagMsgWait, int64(m.Wait))
	b = appendString(b, tagMsgFanout, string(m.Fanout))
	b = appendString(b, tagMsgCoord, m.Coordinator)
	b = appendString(b, tagMsgDecider, m.Decider)
	b = appendBool(b, tagMsgCheck, m.Check)
	return appendPorts(b, tagMsgPorts, m.Ports)
}

func (r *Report) appendWire(b []byte) []byte {
	b = appendInt(b, tagRepNodes, int64(r.Nodes))
	for i := range r.Pending {
		var at int
		b, at = beginNested(b, tagRepPending)
		b = r.Pending[i].appendWire(b)
		b = endNested(b, at)
	}
	b = appendInt(b, tagRepChecked, int64(r.Checked))
	b = appendInt(b, tagRepRanks, int64(r.Ranks))
	b = appendUint(b, tagRepDrained, r.Drained)
	b = appendPorts(b, tagRepPorts, r.Ports)
	b = appendInt(b, tagRepCounted, int64(r.Counted))
	b = appendInt(b, tagRepDrainChecked, int64(r.DrainChecked))
	return appendPorts(b, tagRepOwn, r.Own)
}

// appendPorts writes a set of ports as one bytes field: the first port and
// then each one's distance from the one before, as uvarints, so that the
// dense sets of a large job cost about a byte a port.
func appendPorts(b []byte, tag int, p Ports) []byte {
	if len(p) == 0 {
		return b
	}
	b, at := beginNested(b, tag)
	prev := uint16(0)
	for i, x := range p {
		d := x - prev
		if i == 0 {
			d = x
		}
		b = appendUvarint(b, uint64(d))
		prev = x
	}
	return endNested(b, at)
}

func (n *NodeReport) appendWire(b []byte) []byte {
	b = appendString(b, tagNodeNode, n.Node)
	b = appendBool(b, tagNodeEmpty, n.Empty)
	for i := range n.Conns {
		var at int
		b, at = beginNested(b, tagNodeConn)
		b = n.Conns[i].appendWire(b)
		b = endNested(b, at)
	}
	b = appendInt(b, tagNodeUngated, int64(n.Ungated))
	b = appendUint(b, tagNodeViolations, n.Violations)
	b = appendString(b, tagNodeErr, n.Err)
	b = appendBool(b, tagNodeUnreached, n.Unreached)
	b = appendInt(b, tagNodeChecked, int64(n.Checked))
	b = appendInt(b, tagNodeRanks, int64(n.Ranks))
	b = appendUint(b, tagNodeDrained, n.Drained)
	b = appendBool(b, tagNodeRefused, n.Refused)
	b = appendUint(b, tagNodeLate, n.Late)
	if n.Fault != nil {
		var at int
		b, at = beginNested(b, tagNodeFault)
		b = appendString(b, tagFaultCode, n.Fault.Code)
		b = appendInt(b, tagFaultRank, int64(n.Fault.Rank))
		b = endNested(b, at)
	}
	return b
}

func (c *Conn) appendWire(b []byte) []byte {
	b = appendString(b, tagConnNode, c.Node)
	b = appendString(b, tagConnLocal, c.Local)
	b = appendString(b, tagConnRemote, c.Remote)
	b = appendUint(b, tagConnSendQueue, c.SendQueue)
	b = appendUint(b, tagConnUnread, c.Unread)
	return appendInt(b, tagConnRank, int64(c.Rank))
}

// --- decoding ---

// errWire is what every malformed body reports.
var errWire = errors.New("malformed frame")

// wireReader decodes fields from a string: the frame's body, converted
// once, so that every string decoded from it is a substring and costs no
// allocation of its own.
type wireReader struct {
	s   string
	err error
}

func (r *wireReader) fail(what string) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s", errWire, what)
	}
	r.s = ""
}

func (r *wireReader) uvarint() uint64 {
	var v uint64
	for i := 0; i < len(r.s) && i < 10; i++ {
		c := r.s[i]
		if i == 9 && c > 1 {
			break // overflows 64 bits
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			r.s = r.s[i+1:]
			return v
		}
	}
	r.fail("bad varint")
	return 0
}

// next returns the next field's tag and wire type; ok is false at the end
// of the message or on an error.
func (r *wireReader) next() (tag int, wt int, ok bool) {
	if len(r.s) == 0 || r.err != nil {
		return 0, 0, false
	}
	k := r.uvarint()
	if r.err != nil {
		return 0, 0, false
	}
	wt = int(k & 7)
	if wt != wtVarint && wt != wtBytes {
		r.fail(fmt.Sprintf("wire type %d", wt))
		return 0, 0, false
	}
	if k>>3 > 1<<20 {
		r.fail("tag out of range")
		return 0, 0, false
	}
	return int(k >> 3), wt, true
}

// bytes reads a length-delimited value.
func (r *wireReader) bytes() string {
	n := r.uvarint()
	if r.err != nil {
		return ""
	}
	if n > uint64(len(r.s)) {
		r.fail("length past the end")
		return ""
	}
	v := r.s[:n]
	r.s = r.s[n:]
	return v
}

// skip passes over a field of a tag this version does not know.
func (r *wireReader) skip(wt int) {
	if wt == wtVarint {
		r.uvarint()
	} else {
		r.bytes()
	}
}

// want checks a known tag's wire type; a mismatch is malformed.
func (r *wireReader) want(wt, is int) bool {
	if wt != is {
		r.fail("wrong wire type")
		r.s = ""
		return false
	}
	return true
}

func (r *wireReader) str(wt int) string {
	if !r.want(wt, wtBytes) {
		return ""
	}
	return r.bytes()
}

func (r *wireReader) uint(wt int) uint64 {
	if !r.want(wt, wtVarint) {
		return 0
	}
	return r.uvarint()
}

func (r *wireReader) int64(wt int) int64 {
	u := r.uint(wt)
	return int64(u>>1) ^ -int64(u&1)
}

// int decodes an int field; one that does not fit an int is malformed.
func (r *wireReader) int(wt int) int {
	v := r.int64(wt)
	if bits.UintSize == 32 && int64(int32(v)) != v {
		r.fail("integer out of range")
	}
	return int(v)
}

func (r *wireReader) bool(wt int) bool { return r.uint(wt) != 0 }

// nested returns a reader over a nested message.
func (r *wireReader) nested(wt int) wireReader {
	return wireReader{s: r.str(wt)}
}

// done folds a nested reader's error into r.
func (r *wireReader) done(n *wireReader) {
	if n.err != nil && r.err == nil {
		r.err = n.err
		r.s = ""
	}
}

// decodeFrame decodes a frame's body into f, which must be zero.
func decodeFrame(body string, f *frame) error { return decodeFrameMsg(body, &f.TimeoutNanos, &f.Msg) }

// decodeFrameMsg decodes a frame's body into its parts; m must be zero.
func decodeFrameMsg(body string, timeout *int64, m *Message) error {
	r := wireReader{s: body}
	for {
		tag, wt, ok := r.next()
		if !ok {
			break
		}
		switch tag {
		case tagFrameTimeout:
			*timeout = r.int64(wt)
		case tagFrameMsg:
			n := r.nested(wt)
			n.message(m)
			r.done(&n)
		default:
			r.skip(wt)
		}
	}
	if r.err != nil {
		return r.err
	}
	return nil
}

func (r *wireReader) message(m *Message) {
	for {
		tag, wt, ok := r.next()
		if !ok {
			return
		}
		switch tag {
		case tagMsgVersion:
			m.Version = r.int(wt)
		case tagMsgJob:
			m.Job = r.str(wt)
		case tagMsgEpoch:
			m.Epoch = r.uint(wt)
		case tagMsgSeq:
			m.Seq = r.uint(wt)
		case tagMsgKind:
			m.Kind = Kind(r.str(wt))
		case tagMsgReply:
			m.Reply = r.bool(wt)
		case tagMsgNode:
			if m.Nodes == nil {
				m.Nodes = make([]string, 0, r.count(tagMsgNode, wt))
			}
			m.Nodes = append(m.Nodes, r.str(wt))
		case tagMsgReport:
			n := r.nested(wt)
			m.Report = new(Report)
			n.report(m.Report)
			r.done(&n)
		case tagMsgErr:
			m.Err = r.str(wt)
		case tagMsgPayload:
			m.Payload = []byte(r.str(wt))
		case tagMsgWait:
			m.Wait = time.Duration(r.int64(wt))
		case tagMsgFanout:
			m.Fanout = Fanout(r.str(wt))
		case tagMsgCoord:
			m.Coordinator = r.str(wt)
		case tagMsgDecider:
			m.Decider = r.str(wt)
		case tagMsgCheck:
			m.Check = r.bool(wt)
		case tagMsgPorts:
			m.Ports = r.ports(wt)
		default:
			r.skip(wt)
		}
	}
}

// count returns how many fields of tag, wire type wt, follow back to back
// from here, the one about to be read included: the length of a repeated
// field, so that its slice is allocated once. It reads nothing.
func (r *wireReader) count(tag, wt int) int {
	c := wireReader{s: r.s}
	n := 0
	for {
		n++
		c.bytes()
		if c.err != nil {
			return n
		}
		t, w, ok := c.next()
		if !ok || t != tag || w != wt {
			return n
		}
	}
}

func (r *wireReader) report(rep *Report) {
	for {
		tag, wt, ok := r.next()
		if !ok {
			return
		}
		switch tag {
		case tagRepNodes:
			rep.Nodes = r.int(wt)
		case tagRepPending:
			n := r.nested(wt)
			var nr NodeReport
			n.nodeReport(&nr)
			r.done(&n)
			rep.Pending = append(rep.Pending, nr)
		case tagRepChecked:
			rep.Checked = r.int(wt)
		case tagRepRanks:
			rep.Ranks = r.int(wt)
		case tagRepDrained:
			rep.Drained = r.uint(wt)
		case tagRepPorts:
			rep.Ports = r.ports(wt)
		case tagRepOwn:
			rep.Own = r.ports(wt)
		case tagRepCounted:
			rep.Counted = r.int(wt)
		case tagRepDrainChecked:
			rep.DrainChecked = r.int(wt)
		default:
			r.skip(wt)
		}
	}
}

// ports decodes appendPorts' field. Anything but a strictly increasing set
// of 16-bit ports is malformed: a receiver searches it as a sorted set.
func (r *wireReader) ports(wt int) Ports {
	n := r.nested(wt)
	var out Ports
	for len(n.s) > 0 && n.err == nil {
		d := n.uvarint()
		x := d
		if len(out) > 0 {
			if d == 0 {
				n.fail("ports out of order")
				break
			}
			x += uint64(out[len(out)-1])
		}
		if x > 1<<16-1 {
			n.fail("port out of range")
			break
		}
		out = append(out, uint16(x))
	}
	r.done(&n)
	if r.err != nil {
		return nil
	}
	return out
}

func (r *wireReader) nodeReport(nr *NodeReport) {
	for {
		tag, wt, ok := r.next()
		if !ok {
			return
		}
		switch tag {
		case tagNodeNode:
			nr.Node = r.str(wt)
		case tagNodeEmpty:
			nr.Empty = r.bool(wt)
		case tagNodeConn:
			n := r.nested(wt)
			var c Conn
			n.conn(&c)
			r.done(&n)
			nr.Conns = append(nr.Conns, c)
		case tagNodeUngated:
			nr.Ungated = r.int(wt)
		case tagNodeViolations:
			nr.Violations = r.uint(wt)
		case tagNodeErr:
			nr.Err = r.str(wt)
		case tagNodeUnreached:
			nr.Unreached = r.bool(wt)
		case tagNodeChecked:
			nr.Checked = r.int(wt)
		case tagNodeRanks:
			nr.Ranks = r.int(wt)
		case tagNodeDrained:
			nr.Drained = r.uint(wt)
		case tagNodeRefused:
			nr.Refused = r.bool(wt)
		case tagNodeLate:
			nr.Late = r.uint(wt)
		case tagNodeFault:
			n := r.nested(wt)
			nr.Fault = new(Fault)
			n.fault(nr.Fault)
			r.done(&n)
		default:
			r.skip(wt)
		}
	}
}

func (r *wireReader) fault(f *Fault) {
	for {
		tag, wt, ok := r.next()
		if !ok {
			return
		}
		switch tag {
		case tagFaultCode:
			f.Code = r.str(wt)
		case tagFaultRank:
			f.Rank = r.int(wt)
		default:
			r.skip(wt)
		}
	}
}

func (r *wireReader) conn(c *Conn) {
	for {
		tag, wt, ok := r.next()
		if !ok {
			return
		}
		switch tag {
		case tagConnNode:
			c.Node = r.str(wt)
		case tagConnLocal:
			c.Local = r.str(wt)
		case tagConnRemote:
			c.Remote = r.str(wt)
		case tagConnSendQueue:
			c.SendQueue = r.uint(wt)
		case tagConnUnread:
			c.Unread = r.uint(wt)
		case tagConnRank:
			c.Rank = r.int(wt)
		default:
			r.skip(wt)
		}
	}
}
