package quiesce

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// ProtocolVersion is the version of the message envelope. A receiver refuses
// other versions rather than guessing, because a misread FREEZE or COMMIT
// breaks the consistency guarantee silently. Version 2 is the binary
// encoding of the TCP transport's frames (wire.go); 1 was JSON.
const ProtocolVersion = 2

// Kind names the step a message asks for.
type Kind string

// The kinds of request. Replies carry the kind of the request they answer.
const (
	KindPrepare Kind = "PREPARE" // close the ranks' send gates
	KindDrain   Kind = "DRAIN"   // report what still holds bytes
	KindFreeze  Kind = "FREEZE"  // freeze the job's ranks
	KindVerify  Kind = "VERIFY"  // kernel check after the freeze
	KindCommit  Kind = "COMMIT"  // every node verified: nodes record the pause, and wait for the decision
	// DECIDE goes to the pause's decider alone once every node has
	// acknowledged COMMIT: from then on the pause holds, whatever becomes
	// of the coordinator. COMMITTED then tells every node so (their leases
	// end); a node that hears neither asks the decider (OUTCOME).
	KindDecide    Kind = "DECIDE"
	KindCommitted Kind = "COMMITTED"
	KindOutcome   Kind = "OUTCOME" // a node asks the decider what became of a pause it committed
	KindThaw      Kind = "THAW"    // VERIFY found bytes: thaw, gates stay closed, drain again
	KindAbort     Kind = "ABORT"   // roll back: thaw, then reopen gates
	KindResume    Kind = "RESUME"  // thaw, then reopen gates
	// WARM is no step of a pause: each node forwards it down its subtree
	// and answers, so that every connection a pause's rounds over the same
	// nodes will take is made and authenticated before a pause needs it
	// (Coordinator.Warm). It touches no job state.
	KindWarm Kind = "WARM"
)

// Valid reports whether k is one of the protocol's kinds. A daemon may
// send messages of a kind of its own on the same port (with a Payload):
// an agent refuses them, so the daemon that serves the port answers them
// before its agent sees them.
func (k Kind) Valid() bool {
	switch k {
	case KindPrepare, KindDrain, KindFreeze, KindVerify, KindThaw, KindCommit, KindDecide, KindCommitted, KindOutcome, KindAbort, KindResume, KindWarm:
		return true
	}
	return false
}

// Message is the envelope of every request and reply. Nodes is the subtree the
// recipient is responsible for, with the recipient itself at index 0: a node
// needs no global view of the job, and a round moves O(N log N) names in total
// instead of N copies of the whole list.
type Message struct {
	Version int      `json:"version"`
	Job     string   `json:"job"`
	Epoch   uint64   `json:"epoch"`
	Seq     uint64   `json:"seq"`
	Kind    Kind     `json:"kind"`
	Reply   bool     `json:"reply,omitempty"`
	Nodes   []string `json:"nodes,omitempty"`
	// Report is the reduction of the subtree, set on replies.
	Report *Report `json:"report,omitempty"`
	// Err is set on a reply when the request itself was refused (bad version,
	// stale, malformed); per-node failures travel in Report instead.
	Err string `json:"err,omitempty"`
	// Payload is a daemon's own message, carried unread under a kind of
	// its own (Kind.Valid), written and read with the wire's tagged fields
	// (AppendStringField, FieldReader). Nil is no payload; an empty one
	// is sent as such.
	Payload []byte `json:"payload,omitempty"`
	// Wait, on a DRAIN request (and a PREPARE with Check), lets each node hold its answer until its
	// report is empty or Wait has passed, checking every DrainPoll: the
	// drain's end is then seen within a local check instead of a protocol
	// round. On FREEZE, a node first waits up to Wait for its queues to be
	// empty again (Agent.settle). 0: answer at once, freeze at once. A node
	// that does not know the field does so, which is still correct.
	Wait time.Duration `json:"wait_ns,omitempty"`
	// Fanout is how the recipient sends the request on to the rest of
	// Nodes; empty is the binomial tree. An agent that does not know the
	// field uses the tree, which changes what the round costs, not what it
	// finds.
	Fanout Fanout `json:"fanout,omitempty"`
	// Coordinator names the node whose coordinator sent the request (the
	// first of the whole job's Nodes; a subtree's Nodes start with its
	// recipient instead): a node refuses a step of a job it knows from
	// another coordinator (docs/security.md).
	Coordinator string `json:"coordinator,omitempty"`
	// Ports, on DRAIN, FREEZE and VERIFY, are the local ports of the job's
	// sockets on every node, as the pause's rounds so far reported them
	// (Peered).
	Ports Ports `json:"ports,omitempty"`
	// Check, on FREEZE, has each node run VERIFY's step right after its
	// freeze, in the same round. The coordinator asks for it only when
	// every node said in the drain round before that it counts the bytes
	// sent through closed gates (Report.Counted): that count is what lets
	// one node's check come before another node's freeze
	// (docs/guarantees.md, "FREEZE and VERIFY in one round"). On PREPARE,
	// each node answers with a DRAIN round's check, made once its gates
	// have closed (NodeReport.DrainChecked; "PREPARE and the first DRAIN
	// in one round").
	Check bool `json:"check,omitempty"`
	// Decider, on COMMIT, names the node that holds the pause's outcome
	// (the job's second node): the one a node asks (OUTCOME) when its
	// coordinator goes silent after COMMIT. Empty for a job of one node.
	Decider string `json:"decider,omitempty"`
}

// DrainPoll is how often a node waiting on a DRAIN (Message.Wait) checks
// its queues: a kernel snapshot each time, so not much more often.
const DrainPoll = time.Millisecond

// Validate checks what a receiver needs before it acts on a request.
func (m *Message) Validate() error {
	switch {
	case m.Version != ProtocolVersion:
		return fmt.Errorf("%w: got %d, speak %d", ErrVersion, m.Version, ProtocolVersion)
	case !m.Kind.Valid():
		return fmt.Errorf("quiesce: unknown message kind %q", m.Kind)
	case m.Job == "":
		return errors.New("quiesce: message without job id")
	case len(m.Nodes) == 0:
		return errors.New("quiesce: message without node list")
	}
	return nil
}

// key orders requests: a node refuses anything older than what it executed.
type key struct{ epoch, seq uint64 }

func (a key) less(b key) bool {
	return a.epoch < b.epoch || (a.epoch == b.epoch && a.seq < b.seq)
}

// Conn is one connection that still holds bytes.
type Conn struct {
	Node   string `json:"node"`
	Local  string `json:"local"`
	Remote string `json:"remote"`
	// SendQueue is bytes written but not yet acknowledged by the peer.
	SendQueue uint64 `json:"send_queue"`
	// Unread is bytes received but not yet read by the rank.
	Unread uint64 `json:"unread"`
	// Rank owning the local end, -1 when not known.
	Rank int `json:"rank"`
}

// NodeReport is one node's answer to a step.
type NodeReport struct {
	Node string `json:"node"`
	// Empty is the node's claim that nothing of the job holds bytes. It is
	// only believed together with an empty Conns, zero Ungated and zero
	// Violations (see Clean).
	Empty bool   `json:"empty"`
	Conns []Conn `json:"conns,omitempty"`
	// Ungated counts sockets whose gate has not closed yet (a short send
	// still owes the rest of its frame).
	Ungated int `json:"ungated,omitempty"`
	// Violations counts bytes the kernel saw sent through a closed gate
	// on a socket for which the shim held bytes (or could not say), which
	// may have gone ahead of bytes written before them: every one a check
	// of this pause counted on the node, in each of its answers from then
	// on. They fail the pause.
	Violations uint64 `json:"violations,omitempty"`
	// Late counts bytes this check saw sent through a closed gate on
	// sockets for which nothing was held (a send call that read its gate
	// open just before it closed, reaching the kernel late): in order, and
	// drained again like any bytes in flight.
	Late uint64 `json:"late,omitempty"`
	// Err is set when the node failed the step or could not be reached.
	Err string `json:"err,omitempty"`
	// Fault, with Err, is what the node's failure blames on a rank of the
	// job (the first RankFault in its step's error).
	Fault *Fault `json:"fault,omitempty"`
	// Unreached is set, with Err, when the node's reply never arrived: the
	// node may be fine and the network not, which matters for retrying.
	Unreached bool `json:"unreached,omitempty"`
	// Refused is set, with Unreached, when the node turned the sender away
	// for good (another cluster key, another protocol version) or its name
	// does not resolve: asking it again within this operation will not help.
	Refused bool `json:"refused,omitempty"`
	// Checked counts the job connections the node examined, and Ranks the
	// job's ranks on the node: what a clean report vouches for.
	Checked int `json:"checked,omitempty"`
	Ranks   int `json:"ranks,omitempty"`
	// Drained, on a DRAIN answer, is what the node's connections held at
	// its first check of the round: with Message.Wait the answer comes once
	// they are empty, and this is what the wait drained.
	Drained uint64 `json:"drained,omitempty"`
	// Ports are the local ports of the job's sockets on the node (Peered),
	// and Own the remote ports of its connections to other hosts that hold
	// bytes and were left out of the report as a program's own because no
	// node had said that port was the job's. Report.Add folds both into the
	// subtree's report.
	Ports Ports `json:"-"`
	Own   Ports `json:"-"`
	// Counted, on a DRAIN answer, says that the node counts every byte its
	// job connections are handed after this report (the kernel's byte
	// counts, not sock_diag's queues): its next check reports any that
	// passed a closed gate as Violations. Report.Add counts it.
	Counted bool `json:"-"`
	// DrainChecked, on a PREPARE answer that Message.Check asked for, says
	// that the report is a DRAIN round's check, made after the node's
	// gates closed (Drained, Counted and the rest as on a DRAIN answer).
	// Report.Add counts it.
	DrainChecked bool `json:"-"`
}

// Fault is what a node's failed step blames on one rank of the job, beside
// the step's Err text, so that the coordinator's caller need not read it
// out of that text: Code is the node daemon's word for what happened,
// which the protocol passes on unread.
type Fault struct {
	Code string `json:"code"`
	Rank int    `json:"rank"`
}

// RankFault is an error of a Node's step that blames a rank of the job.
// The agent sends the first one it finds in a failed step's error
// (errors.As) in the node's report (NodeReport.Fault).
type RankFault interface {
	error
	Fault() Fault
}

// Clean reports whether the node has nothing pending and no error. A node
// that says Empty but lists a connection is not clean: the protocol trusts
// the evidence over the flag.
func (r NodeReport) Clean() bool {
	return r.Err == "" && r.Empty && len(r.Conns) == 0 && r.Ungated == 0 && r.Violations == 0 && r.Late == 0
}

// Report is the reduction of node reports over a subtree. Clean nodes are only
// counted, so a reply from 5000 idle nodes stays small; the rest are listed.
type Report struct {
	// Nodes counts the nodes the report accounts for, clean or not.
	Nodes int `json:"nodes"`
	// Pending lists the nodes that are not clean, sorted by node name.
	Pending []NodeReport `json:"pending,omitempty"`
	// Checked, Ranks and Drained sum the nodes' counts.
	Checked int    `json:"checked,omitempty"`
	Ranks   int    `json:"ranks,omitempty"`
	Drained uint64 `json:"drained,omitempty"`
	// Ports and Own are the unions of the nodes' (NodeReport.Ports, .Own).
	// A port in both is a connection a node left out that another node
	// says ends in the job: the pause must not commit on that report.
	Ports Ports `json:"-"`
	Own   Ports `json:"-"`
	// Counted counts the nodes that said NodeReport.Counted, and
	// DrainChecked those that said NodeReport.DrainChecked. A node that
	// does not know a field never adds to it.
	Counted      int `json:"counted,omitempty"`
	DrainChecked int `json:"drain_checked,omitempty"`
}

// Add accounts for one node's report.
func (r *Report) Add(n NodeReport) {
	r.Nodes++
	if n.Counted {
		r.Counted++
	}
	if n.DrainChecked {
		r.DrainChecked++
	}
	r.Checked += n.Checked
	r.Ranks += n.Ranks
	r.Drained += n.Drained
	r.Ports, r.Own = r.Ports.Union(n.Ports), r.Own.Union(n.Own)
	n.Ports, n.Own = nil, nil
	if !n.Clean() {
		r.Pending = append(r.Pending, n)
	}
}

// Merge folds another subtree's report into r. Merging is associative and
// commutative (Pending is kept sorted), so the order in which children answer
// does not change the result.
func (r *Report) Merge(o Report) {
	r.Nodes += o.Nodes
	r.Counted += o.Counted
	r.DrainChecked += o.DrainChecked
	r.Checked += o.Checked
	r.Ranks += o.Ranks
	r.Drained += o.Drained
	r.Ports, r.Own = r.Ports.Union(o.Ports), r.Own.Union(o.Own)
	r.Pending = append(r.Pending, o.Pending...)
	slices.SortStableFunc(r.Pending, func(a, b NodeReport) int { return strings.Compare(a.Node, b.Node) })
}

// Empty reports whether no accounted node holds bytes or failed. It says
// nothing about nodes the report does not account for; see Complete.
func (r Report) Empty() bool { return len(r.Pending) == 0 }

// Complete reports whether the report accounts for all n nodes of the job: a
// node that did not answer must never count as empty.
func (r Report) Complete(n int) bool { return r.Nodes == n }

// violations sums the bytes the nodes saw sent through closed gates.
func (r Report) violations() uint64 {
	var v uint64
	for _, n := range r.Pending {
		v += n.Violations
	}
	return v
}

// InflightBytes sums the bytes the pending connections hold.
func (r Report) InflightBytes() uint64 {
	var s uint64
	for _, n := range r.Pending {
		for _, c := range n.Conns {
			s += c.SendQueue + c.Unread
		}
	}
	return s
}

// Failed returns the nodes that failed the step or were not reached.
func (r Report) Failed() []NodeReport {
	var out []NodeReport
	for _, n := range r.Pending {
		if n.Err != "" {
			out = append(out, n)
		}
	}
	return out
}

// split counts the nodes that failed their step, that were not reached, and
// that hold bytes (whose last answer listed bytes, even if not reached since).
func (r Report) split() (failed, unreached, holding int) {
	for _, n := range r.Pending {
		switch {
		case n.Unreached:
			unreached++
		case n.Err != "":
			failed++
		}
		if len(n.Conns) > 0 || n.Ungated > 0 || n.Violations > 0 || n.Late > 0 {
			holding++
		}
	}
	return
}

// carryOver returns cur, except that a node not reached this time keeps the
// connections it listed in prev. A round that loses messages near the drain
// deadline must not erase what the report is for: which connection still
// held bytes, and whose.
//
// A node near the deadline may miss several rounds in a row (each round's
// forward gets a shrinking share of the time left), so what was carried
// once is carried again; only a node's own error report has nothing worth
// keeping.
func carryOver(prev, cur Report) Report {
	held := make(map[string]NodeReport)
	for _, n := range prev.Pending {
		if n.Err == "" || (n.Unreached && len(n.Conns) > 0) {
			held[n.Node] = n
		}
	}
	if len(held) == 0 {
		return cur
	}
	out := Report{Nodes: cur.Nodes, Checked: cur.Checked, Ranks: cur.Ranks, Drained: cur.Drained, Ports: cur.Ports, Own: cur.Own, Pending: make([]NodeReport, len(cur.Pending))}
	for i, n := range cur.Pending {
		if p, ok := held[n.Node]; ok && n.Unreached {
			p.Unreached, p.Err = true, strings.TrimSuffix(n.Err, carriedNote)+carriedNote
			n = p
		}
		out.Pending[i] = n
	}
	return out
}

const carriedNote = " (connections as last reported)"

// String is a one-line summary for error messages.
func (r Report) String() string {
	if r.Empty() {
		return fmt.Sprintf("%d nodes, all empty", r.Nodes)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d nodes, %d pending", r.Nodes, len(r.Pending))
	// Nodes holding bytes first: they are what the user has to act on, and
	// a long list of unreachable nodes must not push them out of the line.
	list := slices.Clone(r.Pending)
	holds := func(n NodeReport) bool { return len(n.Conns) > 0 || n.Ungated > 0 || n.Violations > 0 || n.Late > 0 }
	slices.SortStableFunc(list, func(a, b NodeReport) int {
		switch {
		case holds(a) && !holds(b):
			return -1
		case holds(b) && !holds(a):
			return 1
		}
		return 0
	})
	const max = 5
	for i, n := range list {
		if i == max {
			fmt.Fprintf(&b, "; …%d more", len(list)-max)
			break
		}
		b.WriteString("; ")
		b.WriteString(n.Node)
		if n.Err != "" {
			b.WriteString(": " + n.Err)
		}
		for j, c := range n.Conns {
			if j == 2 {
				fmt.Fprintf(&b, " …%d more conns", len(n.Conns)-2)
				break
			}
			fmt.Fprintf(&b, " %s->%s rank %d sendq %d unread %d", c.Local, c.Remote, c.Rank, c.SendQueue, c.Unread)
		}
		if n.Ungated > 0 {
			fmt.Fprintf(&b, " ungated %d", n.Ungated)
		}
		if n.Violations > 0 {
			fmt.Fprintf(&b, " violations %d", n.Violations)
		}
		if n.Late > 0 {
			fmt.Fprintf(&b, " late %d", n.Late)
		}
	}
	return b.String()
}

// Errors a caller can test for with errors.Is.
var (
	// ErrVersion: the peer speaks another protocol version.
	ErrVersion = errors.New("quiesce: protocol version mismatch")
	// ErrStale: the request is older than one the node already executed.
	ErrStale = errors.New("quiesce: stale request")
	// ErrNotEmpty: a node still holds bytes (after the drain deadline, or in
	// the kernel check after the freeze).
	ErrNotEmpty = errors.New("quiesce: job not empty")
	// ErrThroughGates: a drain check counted bytes sent through closed
	// gates that may have gone ahead of held bytes (NodeReport.Violations).
	ErrThroughGates = errors.New("quiesce: bytes sent through closed gates")
	// ErrNodeFailed: a node failed a step or could not be reached.
	ErrNodeFailed = errors.New("quiesce: node failed")
	// ErrNotPrepared: a later step of a pause reached a node that did not
	// run its PREPARE.
	ErrNotPrepared = errors.New("quiesce: pause not prepared here")
	// ErrIncomplete: a round's reply does not account for every node.
	ErrIncomplete = errors.New("quiesce: incomplete round")
)
