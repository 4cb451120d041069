// Package ctl is the control channel between the mpipause CLI and the mpid
// of its node: a unix socket (DefaultAddr, beside the rank socket) carrying
// one JSON request and a stream of JSON replies, one per line: progress
// lines while a pause or resume runs, then one final line. mpid learns who is
// asking from SO_PEERCRED, never from the request; the client likewise
// checks who answers (Do) before it trusts a byte.
package ctl

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/peercred"
)

// Version is the request format's version; mpid refuses others.
const Version = 1

// DefaultAddr is mpid's control socket unless MPIPAUSE_CTL_SOCKET says
// otherwise: a path in a directory only root may write, beside the rank
// socket.
const DefaultAddr = "/run/mpipause/ctl.sock"

// Addr is the control socket the CLI uses: $MPIPAUSE_CTL_SOCKET or DefaultAddr.
func Addr() string {
	if a := os.Getenv("MPIPAUSE_CTL_SOCKET"); a != "" {
		return a
	}
	return DefaultAddr
}

// TokenEnv is the variable a launcher hands each rank its job key in
// (mpid's authority.go: what the key is, and how mpid checks it).
const TokenEnv = "MPIPAUSE_JOBKEY"

// Operations.
const (
	OpPause  = "pause"
	OpResume = "resume"
	OpStatus = "status"
	OpList   = "list"
	// OpCreate makes a job owned by the caller, coordinated by this node,
	// and answers with its job key for the ranks (`mpipause run`).
	OpCreate = "create"
	// OpToken, root only, answers with the job key of job Job of user
	// Owner whose coordinator is the first host of Nodelist (the SPANK
	// plugin, in slurmstepd, for a step's tasks).
	OpToken = "token"
)

// MaxTimeout bounds a pause's drain timeout: a drain that has not emptied
// the job's connections in minutes is a rank that is not reading, and the
// pause holds the job's gates closed, its goroutines and its nodes' steps
// under way until then, whatever the caller asked.
const MaxTimeout = 10 * time.Minute

// Request is what the CLI asks.
type Request struct {
	Version int    `json:"version"`
	Op      string `json:"op"`
	Job     string `json:"job,omitempty"`
	// Timeout bounds the drain of a pause (the --timeout flag), at most
	// MaxTimeout; zero takes mpid's default.
	Timeout time.Duration `json:"timeout_ns,omitempty"`
	// Owner and Nodelist: OpToken's user and Slurm host list.
	Owner    *uint32 `json:"owner_uid,omitempty"`
	Nodelist string  `json:"nodelist,omitempty"`
}

// Job states as the CLI shows them.
const (
	StateRunning  = "running"
	StatePausing  = "pausing"
	StatePaused   = "paused"
	StateResuming = "resuming"
	StateFailed   = "failed"
)

// Phase is the cost of one protocol phase.
type Phase struct {
	Name   string  `json:"name"`
	Rounds int     `json:"rounds"`
	Ms     float64 `json:"ms"`
	Err    string  `json:"error,omitempty"`
}

// Conn is a job connection that held bytes when a report was read.
type Conn struct {
	Node      string `json:"node"`
	Local     string `json:"local"`
	Remote    string `json:"remote"`
	SendQueue uint64 `json:"send_queue"`
	Unread    uint64 `json:"unread"`
	// Rank owns the local end (-1: not known); Peer is the rank on the
	// remote end, which is the one not reading when SendQueue is stuck.
	Rank int `json:"rank"`
	Peer int `json:"peer_rank"`
}

// Failure says where and why a pause or resume failed.
type Failure struct {
	Phase  string `json:"phase"`
	Node   string `json:"node,omitempty"`
	Rank   int    `json:"rank"` // -1 when no single rank is to blame
	Reason string `json:"reason"`
	// Conns lists the connections still holding bytes (a drain timeout).
	Conns []Conn `json:"connections,omitempty"`
	// NotReading lists the ranks with unread bytes waiting for them.
	NotReading []int `json:"ranks_not_reading,omitempty"`
	// Violations counts the bytes the kernel saw the job's processes send
	// while their gates were closed, in the last round (a send path the
	// shim does not wrap).
	Violations uint64 `json:"violations,omitempty"`
	// Unconfirmed lists nodes the rollback could not confirm.
	Unconfirmed []string `json:"unconfirmed,omitempty"`
}

// Job is a job as mpid knows it: what status, list, pause and resume print.
type Job struct {
	ID    string `json:"job"`
	State string `json:"state"`
	Owner uint32 `json:"owner_uid"`
	// Ranks is the job's size; Nodes its nodes (on the coordinator: itself,
	// then every node whose mpid registered ranks of the job with it; on
	// another node only that node); LocalRanks the ranks registered on the
	// answering node.
	Ranks      int      `json:"ranks"`
	Nodes      []string `json:"nodes"`
	LocalRanks []int    `json:"local_ranks,omitempty"`
	// Node is the node that answered; Coordinator the node whose mpid runs
	// the job's pauses: the one its job key names, where `mpipause run`
	// made it or, under Slurm, the step's first node (empty if not known
	// there).
	Node        string `json:"node"`
	Coordinator string `json:"coordinator,omitempty"`
	// The last pause or resume: connections the final kernel snapshot
	// checked, the bytes it found queued (zero for a committed pause), the
	// bytes in flight when the drain began, and the times.
	Connections   int       `json:"connections"`
	InflightBytes uint64    `json:"inflight_bytes"`
	DrainedBytes  uint64    `json:"drained_bytes"`
	DrainMs       float64   `json:"drain_ms"`
	TotalMs       float64   `json:"total_ms"`
	Phases        []Phase   `json:"phases,omitempty"`
	Failure       *Failure  `json:"failure,omitempty"`
	Since         time.Time `json:"since,omitzero"`
	// Unpausable, when set, says why the job cannot be paused cleanly.
	Unpausable string `json:"unpausable,omitempty"`
	// Observer is the answering node's kernel observer: its mode, "full"
	// or "degraded" (what an older kernel weakens: mpid's log at start,
	// docs/guarantees.md), and the programs it runs.
	Observer string `json:"observer,omitempty"`
	// Cgroups are where the job's ranks are watched and frozen: on the
	// answering node, and on the coordinator every node's, as each node's
	// mpid last registered them (within sweep's 10 s).
	Cgroups []Cgroup `json:"cgroups,omitempty"`
}

// Cgroup is a cgroup holding ranks of a job on a node, and why mpid
// watches and freezes it: "own" (the rank's cgroup from its resource
// manager, holding nothing else), "inner" (one mpid made inside the rank's
// cgroup, shared with other processes), "created" (mpid's own, for ranks
// nobody placed) or "fixed" (mpid's --cgroup).
type Cgroup struct {
	Node   string `json:"node"`
	Dir    string `json:"dir"`
	Placed string `json:"placed"`
}

// Progress is one step of a running pause or resume.
type Progress struct {
	Phase string `json:"phase"`
	Round int    `json:"round"`
	Done  bool   `json:"done"`
	// Nodes is the job's node count, NodesClean how many of them reported
	// nothing pending in this round.
	Nodes         int     `json:"nodes"`
	NodesClean    int     `json:"nodes_clean"`
	Conns         int     `json:"connections_pending"`
	InflightBytes uint64  `json:"inflight_bytes"`
	Ms            float64 `json:"ms"`
	Err           string  `json:"error,omitempty"`
}

// Error codes; the CLI maps each to its own exit status.
const (
	CodeFailed      = "failed"      // the pause or resume ran and failed (rolled back)
	CodeBadRequest  = "bad-request" // malformed request or job id
	CodeUnknownJob  = "unknown-job" // no such job on this node
	CodePermission  = "permission"  // not sent for another user's job: a stranger gets CodeUnknownJob
	CodeState       = "state"       // paused job paused again, running job resumed, operation in progress
	CodeUnavailable = "unavailable" // mpid unreachable or cannot serve
	CodeUnpausable  = "unpausable"  // the job cannot be paused cleanly (ranks not under mpid's watch)
	CodeElsewhere   = "elsewhere"   // the job's coordinator is not known here
	CodeRankGone    = "rank-gone"   // a rank exited during the pause (rolled back)
)

// Error is a refusal or a failure.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	// Lost: mpid took the request and went away before answering; what it
	// had started may be under way (client side only).
	Lost bool `json:"-"`
}

func (e *Error) Error() string { return e.Message }

// Errorf makes an *Error.
func Errorf(code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// Reply is one line from mpid. Exactly one of its fields is set; every reply
// but Progress ends the exchange.
type Reply struct {
	Progress *Progress `json:"progress,omitempty"`
	Job      *Job      `json:"job,omitempty"`
	Jobs     []Job     `json:"jobs,omitempty"`
	Err      *Error    `json:"error,omitempty"`
	// Token is the job key OpCreate and OpToken answer with: a secret, for
	// the ranks' environment only.
	Token string `json:"token,omitempty"`
	// Final marks the last line (a list of zero jobs is final too).
	Final bool `json:"final,omitempty"`
}

// MaxLine bounds one request or reply line: a report naming every pending
// connection of a big job is long, a request is not.
const (
	MaxRequest = 4 << 10
	MaxReply   = 16 << 20
)

// Validate checks a request's shape (not whether the job exists).
func (r *Request) Validate() error {
	if r.Version != Version {
		return Errorf(CodeBadRequest, "control request version %d, this mpid speaks %d: use the mpipause of the same release", r.Version, Version)
	}
	switch r.Op {
	case OpPause, OpResume, OpCreate:
		if err := ValidJobID(r.Job); err != nil {
			return err
		}
	case OpToken:
		if err := ValidJobID(r.Job); err != nil {
			return err
		}
		if r.Owner == nil || r.Nodelist == "" {
			return Errorf(CodeBadRequest, "a token request names the owner and the step's node list")
		}
	case OpStatus:
		if r.Job != "" {
			if err := ValidJobID(r.Job); err != nil {
				return err
			}
		}
	case OpList:
	default:
		return Errorf(CodeBadRequest, "unknown operation %q", r.Op)
	}
	if r.Timeout < 0 {
		return Errorf(CodeBadRequest, "negative timeout %v", r.Timeout)
	}
	if r.Timeout > MaxTimeout {
		return Errorf(CodeBadRequest, "timeout %v: at most %v", r.Timeout, MaxTimeout)
	}
	return nil
}

// ValidJobID checks a job id as the shim and mpid accept it (jobid.Valid).
func ValidJobID(id string) error {
	if !jobid.Valid(id) {
		return Errorf(CodeBadRequest, "job id %q: %s", id, jobid.Rule)
	}
	return nil
}

// Do sends req to the mpid at addr and returns the final reply, calling
// progress (if not nil) for every progress line on the way. A refusal or
// failure comes back as an *Error. ctx bounds the whole exchange.
func Do(ctx context.Context, addr string, req Request, progress func(Progress)) (*Reply, error) {
	req.Version = Version
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", addr)
	if err != nil {
		return nil, Errorf(CodeUnavailable, "no mpid at %s: %v (is mpid running on this node? see mpid --help)", addr, unwrapOp(err))
	}
	defer c.Close()
	if err := checkServer(c, addr); err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if _, err := c.Write(append(b, '\n')); err != nil {
		return nil, Errorf(CodeUnavailable, "mpid at %s: %v", addr, unwrapOp(err))
	}
	br := bufio.NewReaderSize(c, 64<<10)
	for {
		line, err := readLine(br, MaxReply)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if errors.Is(err, io.EOF) {
				e := Errorf(CodeUnavailable, "mpid at %s closed the connection without an answer (see its log)", addr)
				e.Lost = true
				return nil, e
			}
			return nil, Errorf(CodeUnavailable, "mpid at %s: %v", addr, unwrapOp(err))
		}
		r, err := decodeReply(line)
		if err != nil {
			return nil, Errorf(CodeUnavailable, "mpid at %s sent a malformed reply: %v", addr, err)
		}
		switch {
		case r.Progress != nil:
			if progress != nil {
				progress(*r.Progress)
			}
		case r.Err != nil:
			return &r, r.Err
		default:
			return &r, nil
		}
	}
}

// checkServer refuses a control socket served by anyone but root (mpid) or
// the caller's own user, from the kernel's word (SO_PEERCRED), before a
// byte is sent or read: whoever else holds the address (an abstract name
// any user can bind while mpid is down) must not answer root's questions
// about its jobs. The caller's own user is the shim's rule too: a server
// of theirs can mislead no one but them.
func checkServer(c net.Conn, addr string) error {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return Errorf(CodeUnavailable, "%s is not a unix socket", addr)
	}
	cred, err := peercred.Of(uc)
	if err != nil {
		return Errorf(CodeUnavailable, "cannot tell who serves %s: %v", addr, err)
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return Errorf(CodeUnavailable, "%s is served by uid %d, not by root: not mpid, not trusted (pid %d holds it; mpid runs as root)", addr, cred.Uid, cred.Pid)
	}
	return nil
}

// decodeReply decodes one reply line: a progress line (not final), or a
// final answer with a job, a list of jobs, or an error (with the job's
// report, if a pause ran). Anything else is malformed rather than read in
// some order.
func decodeReply(line []byte) (Reply, error) {
	var r Reply
	if err := json.Unmarshal(line, &r); err != nil {
		return r, err
	}
	answer := r.Job != nil || r.Jobs != nil || r.Err != nil || r.Token != ""
	if (r.Progress != nil && (answer || r.Final)) || (r.Progress == nil && !r.Final) || (r.Job != nil && r.Jobs != nil) {
		return r, errors.New("not one progress line or one final answer")
	}
	if r.Err != nil && r.Err.Code == "" {
		return r, errors.New("an error without a code")
	}
	return r, nil
}

// ReadRequest reads one request line, at most MaxRequest bytes.
func ReadRequest(br *bufio.Reader) (Request, error) {
	var req Request
	line, err := readLine(br, MaxRequest)
	if err != nil {
		return req, err
	}
	dec := json.NewDecoder(strings.NewReader(string(line)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return req, Errorf(CodeBadRequest, "malformed control request: %v", err)
	}
	return req, req.Validate()
}

// Write sends one reply line.
func Write(w io.Writer, r Reply) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

func readLine(br *bufio.Reader, max int) ([]byte, error) {
	var line []byte
	for {
		chunk, isPrefix, err := br.ReadLine()
		if err != nil {
			return nil, err
		}
		line = append(line, chunk...)
		if len(line) > max {
			return nil, Errorf(CodeBadRequest, "line longer than %d bytes", max)
		}
		if !isPrefix {
			return line, nil
		}
	}
}

func unwrapOp(err error) error {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Err
	}
	return err
}

// RankList writes ranks as "0,1,5", or "none", for messages and reports.
func RankList(ranks []int) string {
	if len(ranks) == 0 {
		return "none"
	}
	s := make([]string, len(ranks))
	for i, r := range ranks {
		s[i] = strconv.Itoa(r)
	}
	return strings.Join(s, ",")
}
