package quiesce

import (
	"errors"
	"testing"
)

// TestFields: what the Append functions write, a FieldReader reads back,
// skipping a tag it does not know; a value of the wrong wire type or cut
// short is malformed.
func TestFields(t *testing.T) {
	b := AppendStringField(nil, 1, "pause")
	b = AppendUintField(b, 2, 1<<32-1)
	b = AppendIntField(b, 3, -5)
	b = AppendStringField(b, 99, "from a newer daemon")
	b = AppendBytesField(b, 4, []byte(`{"a":1}`))
	b = AppendStringField(AppendUintField(AppendIntField(AppendBytesField(b, 5, nil), 6, 0), 7, 0), 8, "")
	var (
		s, raw string
		u      uint64
		i      int64
		seen   []int
	)
	r := NewFieldReader(b)
	for {
		tag, ok := r.Next()
		if !ok {
			break
		}
		seen = append(seen, tag)
		switch tag {
		case 1:
			s = r.ReadString()
		case 2:
			u = r.ReadUint()
		case 3:
			i = r.ReadInt()
		case 4:
			raw = r.ReadString()
		default:
			r.Skip()
		}
	}
	if r.Err() != nil || s != "pause" || u != 1<<32-1 || i != -5 || raw != `{"a":1}` || len(seen) != 5 {
		t.Fatalf("read %q %d %d %q, tags %v: %v", s, u, i, raw, seen, r.Err())
	}
	for name, in := range map[string][]byte{
		"string as varint": AppendUintField(nil, 1, 3),
		"varint as string": AppendStringField(nil, 2, "x"),
		"cut short":        b[:len(b)-1],
	} {
		r := NewFieldReader(in)
		for tag, ok := r.Next(); ok; tag, ok = r.Next() {
			switch tag {
			case 1:
				r.ReadString()
			case 2:
				r.ReadUint()
			default:
				r.Skip()
			}
		}
		if !errors.Is(r.Err(), errWire) {
			t.Errorf("%s: %v, want errWire", name, r.Err())
		}
	}
	r = NewFieldReader(AppendUintField(nil, 2, 1<<32))
	r.Next()
	r.ReadUint()
	if r.Fail("uid out of range"); !errors.Is(r.Err(), errWire) {
		t.Errorf("Fail: %v", r.Err())
	}
}
