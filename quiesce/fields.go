package quiesce

// The wire's tagged fields (wire.go) for a message the protocol carries
// unread (Message.Payload): a daemon writes and reads its own message in
// the same format as the frame around it, so that a field can be added to
// it without a new version either, and nothing outside this package
// repeats the varint code.

// AppendStringField appends a field holding s; an empty s is left out,
// which a reader takes for "".
func AppendStringField(b []byte, tag int, s string) []byte { return appendString(b, tag, s) }

// AppendBytesField appends a field holding v; an empty v is left out.
func AppendBytesField(b []byte, tag int, v []byte) []byte {
	if len(v) == 0 {
		return b
	}
	b = appendUvarint(appendKey(b, tag, wtBytes), uint64(len(v)))
	return append(b, v...)
}

// AppendUintField appends a field holding v; 0 is left out.
func AppendUintField(b []byte, tag int, v uint64) []byte { return appendUint(b, tag, v) }

// AppendIntField appends a field holding v, zigzag-encoded; 0 is left out.
func AppendIntField(b []byte, tag int, v int64) []byte { return appendInt(b, tag, v) }

// FieldReader reads the fields of one message, in the order they were
// written: Next gives a field's tag, and then exactly one of ReadString,
// ReadUint, ReadInt or Skip reads its value. A value of the wrong wire
// type, like any malformed input, ends the reading with an error (Err).
type FieldReader struct {
	r  wireReader
	wt int
}

// NewFieldReader reads the fields in b, which it copies once: a ReadString
// returns part of that copy, not of b.
func NewFieldReader(b []byte) *FieldReader { return &FieldReader{r: wireReader{s: string(b)}} }

// Next returns the next field's tag; ok is false at the end of the message
// or on an error.
func (f *FieldReader) Next() (tag int, ok bool) {
	tag, f.wt, ok = f.r.next()
	return tag, ok
}

// ReadString reads a bytes field.
func (f *FieldReader) ReadString() string { return f.r.str(f.wt) }

// ReadUint reads an unsigned varint field.
func (f *FieldReader) ReadUint() uint64 { return f.r.uint(f.wt) }

// ReadInt reads a signed (zigzag) varint field.
func (f *FieldReader) ReadInt() int64 { return f.r.int64(f.wt) }

// Skip passes over a field of a tag the reader does not know.
func (f *FieldReader) Skip() { f.r.skip(f.wt) }

// Fail ends the reading with an error: a value the reader's own rules
// refuse (out of range) makes the message malformed.
func (f *FieldReader) Fail(what string) { f.r.fail(what) }

// Err is the first error the reading met, nil if none.
func (f *FieldReader) Err() error { return f.r.err }
