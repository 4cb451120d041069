package mpid

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"

	"github.com/mpipause/mpipause/quiesce"
)

// kindControl is the kind of mpid's own messages on the peer port: a
// user's pause or resume passed on to the job's coordinator, and a node's
// registration with it. It is not a protocol step: the agent refuses it
// (quiesce.Kind.Valid), so peer.handle answers it first.
const kindControl quiesce.Kind = "CONTROL"

// peerControl is a kindControl request and its answer, carried in the
// message's Payload.
type peerControl struct {
	Op      string
	UID     uint32
	Timeout time.Duration
	// Token is the job key a rank presented (a node registering with the
	// coordinator); Node the node that registers.
	// Size is the job's size as the registering node's ranks told it.
	Token string
	Node  string
	Size  int
	// Cgroups are where the registering node placed the job's ranks, for
	// the coordinator's status (shown, never acted on); at most
	// maxRemoteCgroups.
	Cgroups []ctl.Cgroup
	// Answer: Result is the coordinator's view of the job (a ctl.Job in
	// JSON); Code and Message a refusal.
	Result  json.RawMessage
	Code    string
	Message string
}

// The fields of a peerControl. The numbers are on the wire: never reuse
// one for another meaning; add new ones.
const (
	tagCtlOp      = 1
	tagCtlUID     = 2
	tagCtlTimeout = 3
	tagCtlResult  = 4
	tagCtlCode    = 5
	tagCtlMessage = 6
	tagCtlToken   = 7
	tagCtlNode    = 8
	tagCtlSize    = 9
	tagCtlCgroup  = 10 // repeated: "placed dir"
)

// maxRemoteCgroups bounds what a node's registration makes the coordinator
// keep: as many as one observer watches (loader's MAX_WATCHED).
const maxRemoteCgroups = 64

// message is a kindControl message of job to node to, carrying c.
func (c *peerControl) message(job, to string) quiesce.Message {
	return quiesce.Message{Version: quiesce.ProtocolVersion, Job: job, Kind: kindControl, Nodes: []string{to}, Payload: c.encode()}
}

func (c *peerControl) encode() []byte {
	// Not nil even when every field is empty: a message without a payload
	// carries no control message at all.
	b := quiesce.AppendStringField([]byte{}, tagCtlOp, c.Op)
	b = quiesce.AppendUintField(b, tagCtlUID, uint64(c.UID))
	b = quiesce.AppendIntField(b, tagCtlTimeout, int64(c.Timeout))
	b = quiesce.AppendBytesField(b, tagCtlResult, c.Result)
	b = quiesce.AppendStringField(b, tagCtlCode, c.Code)
	b = quiesce.AppendStringField(b, tagCtlToken, c.Token)
	b = quiesce.AppendStringField(b, tagCtlNode, c.Node)
	b = quiesce.AppendIntField(b, tagCtlSize, int64(c.Size))
	for _, cg := range c.Cgroups {
		b = quiesce.AppendStringField(b, tagCtlCgroup, cg.Placed+" "+cg.Dir)
	}
	return quiesce.AppendStringField(b, tagCtlMessage, c.Message)
}

// errNoControl: a kindControl message without a payload.
var errNoControl = errors.New("no control message")

// decodeControl reads the peerControl in m's payload.
func decodeControl(m quiesce.Message) (*peerControl, error) {
	if m.Payload == nil {
		return nil, errNoControl
	}
	c := new(peerControl)
	r := quiesce.NewFieldReader(m.Payload)
	for {
		tag, ok := r.Next()
		if !ok {
			break
		}
		switch tag {
		case tagCtlOp:
			c.Op = r.ReadString()
		case tagCtlUID:
			v := r.ReadUint()
			if v > 1<<32-1 {
				r.Fail("uid out of range")
			}
			c.UID = uint32(v)
		case tagCtlTimeout:
			c.Timeout = time.Duration(r.ReadInt())
		case tagCtlResult:
			if s := r.ReadString(); s != "" {
				c.Result = []byte(s)
			}
		case tagCtlCode:
			c.Code = r.ReadString()
		case tagCtlMessage:
			c.Message = r.ReadString()
		case tagCtlToken:
			c.Token = r.ReadString()
		case tagCtlNode:
			c.Node = r.ReadString()
		case tagCtlSize:
			v := r.ReadInt()
			if v < 0 || v > 1<<31-1 {
				r.Fail("size out of range")
			}
			c.Size = int(v)
		case tagCtlCgroup:
			placed, dir, ok := strings.Cut(r.ReadString(), " ")
			if !ok || !validPlace(placed) || !filepath.IsAbs(dir) || len(dir) > 4096 || len(c.Cgroups) == maxRemoteCgroups {
				r.Fail("bad cgroup")
			}
			c.Cgroups = append(c.Cgroups, ctl.Cgroup{Node: c.Node, Dir: dir, Placed: placed})
		default:
			r.Skip()
		}
	}
	if err := r.Err(); err != nil {
		return nil, err
	}
	for i := range c.Cgroups {
		c.Cgroups[i].Node = c.Node // the node field may come after them
	}
	return c, nil
}

// ControlRequest is the message a node's mpid sends to pass a user's op
// (ctl.OpPause, ctl.OpResume) of job on to the mpid on node, for uid: for
// tests that speak to the peer port themselves.
func ControlRequest(job, node, op string, uid uint32) quiesce.Message {
	return (&peerControl{Op: op, UID: uid}).message(job, node)
}

// ControlRefusal returns the code of the refusal in rep, an answer to
// ControlRequest, "" if it was done; an error if rep is no such answer.
func ControlRefusal(rep quiesce.Message) (string, error) {
	if rep.Err != "" {
		return "", errors.New(rep.Err)
	}
	c, err := decodeControl(rep)
	if err != nil {
		return "", err
	}
	return c.Code, nil
}
