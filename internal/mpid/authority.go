package mpid

import (
	"crypto/hmac"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/quiesce"
)

// Job authority (docs/security.md). A job is the pair (owner uid, id): the
// owner is the uid the kernel reported for whoever created it (the caller
// of `mpipause run`, or the Slurm step's user as slurmstepd tells root's
// SPANK plugin), and ids chosen by users live in the owner's namespace
// (ranks.JobKey). A rank joins a job only with the job key its launcher was
// given (TokenEnv): the job's coordinator node and an HMAC over the owner,
// the id and the coordinator under the cluster key, so any node of the
// cluster checks it without state, nobody without the cluster key can make
// one, and one job's key says nothing about another's. The node list of a
// job is the set of nodes whose mpid registered ranks of it with the
// coordinator, over the authenticated peer port.

// TokenEnv is the variable the launcher hands each rank its job key in.
const TokenEnv = ctl.TokenEnv

// tokenLabel separates job keys from anything else derived from the
// cluster key.
const tokenLabel = "mpipause job key v1"

// JobToken is the job key of job id of uid, coordinated by coord: what
// `mpipause run` and the SPANK plugin hand to the ranks. Exported for tests
// that start ranks without a launcher.
func JobToken(k *quiesce.Key, uid uint32, id, coord string) string {
	mac := k.Derive(tokenLabel, strconv.FormatUint(uint64(uid), 10), id, coord)
	return coord + ":" + hex.EncodeToString(mac)
}

// errBadToken is every refusal of a job key: which part was wrong is not
// told to a process that may be guessing.
var errBadToken = errors.New("the job key is not this job's (it must come from `mpipause run` or Slurm for this job, this user and this cluster; every node needs the same cluster key file)")

// checkToken verifies that token is the key of job id of uid under one of
// the cluster's keys (a node that has moved to the next key made it, or
// one that has not yet) and returns the job's coordinator.
func checkToken(keys *quiesce.Keyring, uid uint32, id, token string) (string, error) {
	i := strings.LastIndexByte(token, ':')
	if i <= 0 {
		return "", errBadToken
	}
	coord := token[:i]
	if !jobid.ValidHostName(coord) {
		return "", errBadToken
	}
	for _, k := range keys.All() {
		if hmac.Equal([]byte(JobToken(k, uid, id, coord)), []byte(token)) {
			return coord, nil
		}
	}
	return "", errBadToken
}

// firstHost is the first host of a Slurm host list ("node[0-2],login",
// "n[01-04]", "a,b"): the node of task 0 of a step, which coordinates it.
func firstHost(list string) (string, error) {
	depth, end := 0, len(list)
	for i := 0; i < len(list); i++ {
		switch list[i] {
		case '[':
			depth++
		case ']':
			depth--
		case ',':
			if depth == 0 && end == len(list) {
				end = i
			}
		}
	}
	item := list[:end]
	var b strings.Builder
	for item != "" {
		open := strings.IndexByte(item, '[')
		if open < 0 {
			b.WriteString(item)
			break
		}
		b.WriteString(item[:open])
		close := strings.IndexByte(item[open:], ']')
		if close < 0 {
			return "", fmt.Errorf("host list %q: unclosed '['", list)
		}
		r := item[open+1 : open+close]
		r, _, _ = strings.Cut(r, ",")
		r, _, _ = strings.Cut(r, "-")
		b.WriteString(r)
		item = item[open+close+1:]
	}
	h := b.String()
	if !jobid.ValidHostName(h) {
		return "", fmt.Errorf("host list %q: the first host %q is not a host name", list, h)
	}
	return h, nil
}
