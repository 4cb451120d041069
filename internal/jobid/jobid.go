// Package jobid holds the rules for job ids, job keys and node names,
// shared by the CLI's channel (internal/ctl), the rank channel
// (internal/ranks), mpid and, for job ids, the shim in C (libmpi-shim's
// mpp_valid_jobid): each reaches all of them, and each must accept exactly
// what the others accept.
package jobid

// MaxLen is the longest job id.
const MaxLen = 128

// Rule says what Valid accepts, for error messages.
const Rule = "want 1 to 128 printable ASCII characters without spaces, '=', ',' or '/', and not . or .."

// Valid reports whether s is a job id: '=' and spaces would break the rank
// channel's line protocol, the shim's HELLO turns ',' into '_' (so JOIN and
// HELLO would disagree), and '/' and the dot names would escape the job's
// cgroup directory.
func Valid(s string) bool {
	if len(s) == 0 || len(s) > MaxLen || s == "." || s == ".." {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c > '~' || c == '=' || c == ',' || c == '/' {
			return false
		}
	}
	return true
}
