package ctl

import (
	"bufio"
	"bytes"
	"testing"
)

// FuzzReadRequest: a control request comes from any local user. What
// ReadRequest accepts is a request mpid can act on: a known op, a valid job
// id where one is needed, no negative timeout.
func FuzzReadRequest(f *testing.F) {
	f.Add([]byte(`{"version":1,"op":"pause","job":"j1","timeout_ns":1000000000}` + "\n"))
	f.Add([]byte(`{"version":1,"op":"status"}` + "\n"))
	f.Add([]byte(`{"version":1,"op":"list","extra":1}` + "\n"))
	f.Add([]byte(`{"version":1,"op":"resume","job":"../etc"}`))
	f.Add(bytes.Repeat([]byte("x"), MaxRequest+10))
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := ReadRequest(bufio.NewReader(bytes.NewReader(b)))
		if err != nil {
			return
		}
		if req.Version != Version || req.Timeout < 0 {
			t.Fatalf("accepted %q as %+v", b, req)
		}
		switch req.Op {
		case OpPause, OpResume:
			if ValidJobID(req.Job) != nil {
				t.Fatalf("accepted job id %q", req.Job)
			}
		case OpStatus, OpList:
		default:
			t.Fatalf("accepted op %q", req.Op)
		}
	})
}

// FuzzDecodeReply: what the CLI takes from the control socket.
func FuzzDecodeReply(f *testing.F) {
	f.Add([]byte(`{"progress":{"phase":"DRAIN","round":1,"nodes":3}}`))
	f.Add([]byte(`{"job":{"job":"j1","state":"paused"},"final":true}`))
	f.Add([]byte(`{"error":{"code":"unknown-job","message":"no job"},"final":true}`))
	f.Add([]byte(`{"jobs":[],"final":true}`))
	f.Add([]byte(`{"progress":{},"job":{},"final":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeReply(b)
		if err != nil {
			return
		}
		if r.Progress != nil && r.Final {
			t.Fatalf("a final progress line: %q", b)
		}
		if r.Progress == nil && !r.Final {
			t.Fatalf("neither progress nor final: %q", b)
		}
		if r.Err != nil && r.Err.Code == "" {
			t.Fatalf("an error without a code: %q", b)
		}
	})
}
