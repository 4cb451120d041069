package node

import (
	"errors"
	"fmt"

	"github.com/mpipause/mpipause/quiesce"
)

// The faults a node's step blames on a rank: each an error the node role
// returns and a quiesce.Fault the coordinator reads from the report.

// ErrStashFull: a rank's shim holds as much as its cap lets it
// (MPIPAUSE_STASH_MAX_MB) and drains no more.
var ErrStashFull = errors.New("stash is full")

// StashFullError is ErrStashFull of one rank, on node Node: Bytes held,
// cap Max.
type StashFullError struct {
	Rank, Pid  int
	Node       string
	Bytes, Max uint64
}

func (e *StashFullError) Error() string {
	return fmt.Sprintf("rank %d (pid %d) on %s: its shim's %v (%d bytes; cap %d MiB, MPIPAUSE_STASH_MAX_MB): the drain takes no more and the rest of what was sent to it stays in the kernel (the rank does not read: busy outside MPI?)",
		e.Rank, e.Pid, e.Node, ErrStashFull, e.Bytes, e.Max>>20)
}

func (e *StashFullError) Is(target error) bool { return target == ErrStashFull }

// Fault is quiesce.RankFault's: the coordinator names the rank.
func (e *StashFullError) Fault() quiesce.Fault {
	return quiesce.Fault{Code: FaultStashFull, Rank: e.Rank}
}

// ErrUnheld: a rank sent on a job connection, under its closed gate, with
// a call that cannot be held without changing its meaning.
var ErrUnheld = errors.New("sent through the closed gate with a call that cannot be held")

// UnheldError is ErrUnheld of one rank, on node Node: Call on descriptor
// Fd, of the job connection with socket cookie Cookie.
type UnheldError struct {
	Rank, Pid int
	Node      string
	Call      string
	Fd        int
	Cookie    uint64
}

func (e *UnheldError) Error() string {
	return fmt.Sprintf("rank %d (pid %d) on %s %v: %s on fd %d (a job connection, socket cookie %#x), which means something at the moment of the call (a timestamp, a completion for the caller's buffer), so the shim passed it and the stream is not at rest; nothing was reordered, and the pause rolls back (a pause of this job must come when its ranks do not make that call)",
		e.Rank, e.Pid, e.Node, ErrUnheld, e.Call, e.Fd, e.Cookie)
}

func (e *UnheldError) Is(target error) bool { return target == ErrUnheld }

// Fault is quiesce.RankFault's: the coordinator names the rank.
func (e *UnheldError) Fault() quiesce.Fault {
	return quiesce.Fault{Code: FaultUnheld, Rank: e.Rank}
}

// ErrHeld: something other than the pause holds a rank still, so it reads
// nothing that was sent to it until that lets it go.
var ErrHeld = errors.New("held still by something other than the pause")

// HeldError is ErrHeld of one rank, on node Node; How says what holds it.
type HeldError struct {
	Rank, Pid int
	Node, How string
}

func (e *HeldError) Error() string {
	return fmt.Sprintf("rank %d (pid %d) on %s is %s, with bytes sent to it unread or a message of its own half sent: no drain can finish until it runs again, so the pause rolls back now",
		e.Rank, e.Pid, e.Node, e.How)
}

func (e *HeldError) Is(target error) bool { return target == ErrHeld }

// Fault is quiesce.RankFault's: the coordinator names the rank.
func (e *HeldError) Fault() quiesce.Fault {
	return quiesce.Fault{Code: FaultHeld, Rank: e.Rank}
}

// The codes of the faults a node's failed step blames on a rank
// (quiesce.Fault.Code), read by the coordinator's mpid: FaultRankGone makes
// a pause's failure ctl.CodeRankGone.
const (
	FaultRankGone  = "rank-gone"
	FaultStashFull = "stash-full"
	FaultHeld      = "held"
	FaultUnheld    = "unheld"
)

// ErrRankGone: a rank of the job exited (or was killed) during the pause.
var ErrRankGone = errors.New("exited during the pause")

// RankGoneError is ErrRankGone of one rank, seen at step At (empty: found
// missing, or dying, rather than by a step of its own). Before: its
// channel to mpid had closed before this node's PREPARE.
type RankGoneError struct {
	Rank, Pid int
	At        string
	Before    bool
}

func (e *RankGoneError) Error() string {
	if e.Before {
		return fmt.Sprintf("rank %d (pid %d) left the job before the pause reached its node (it exited, was killed, or called MPI_Finalize)", e.Rank, e.Pid)
	}
	if e.At == "" {
		return fmt.Sprintf("rank %d (pid %d) %v", e.Rank, e.Pid, ErrRankGone)
	}
	return fmt.Sprintf("rank %d (pid %d) %v (at %s)", e.Rank, e.Pid, ErrRankGone, e.At)
}

func (e *RankGoneError) Is(target error) bool { return target == ErrRankGone }

// Fault is quiesce.RankFault's: the coordinator names the rank, and tells
// the user the pause was rolled back for the others (ctl.CodeRankGone).
func (e *RankGoneError) Fault() quiesce.Fault {
	return quiesce.Fault{Code: FaultRankGone, Rank: e.Rank}
}

// ErrNoRanks: no rank of the job is registered on this node.
var ErrNoRanks = errors.New("no rank of the job is registered here")

// NotReadyError: the job's ranks here cannot all be gated yet, for Why.
type NotReadyError struct{ Why string }

func (e *NotReadyError) Error() string { return "not ready: " + e.Why }
