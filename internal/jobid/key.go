package jobid

import (
	"strconv"
	"strings"
)

// Key is where a job lives in mpid: a user's job ids are that user's
// namespace, so uid 1001's "4243.0" is another job than uid 1002's and
// neither can name the other's (docs/security.md).
func Key(uid uint32, id string) string { return strconv.FormatUint(uint64(uid), 10) + ":" + id }

// SplitKey is Key's inverse.
func SplitKey(key string) (uid uint32, id string, ok bool) {
	u, id, ok := strings.Cut(key, ":")
	n, err := strconv.ParseUint(u, 10, 32)
	if !ok || err != nil || u == "" || (len(u) > 1 && u[0] == '0') || !Valid(id) {
		return 0, "", false
	}
	return uint32(n), id, true
}

// HostNameRule says what ValidHostName accepts, for error messages.
const HostNameRule = "want a host name (RFC 1123): labels of 1 to 63 letters, digits and '-', not starting or ending with '-', joined by dots, 253 characters at most"

// ValidHostName is the one rule for the names of nodes (HELLO's host=,
// root= and hosts=, mpid's --node): an RFC 1123 host name.
func ValidHostName(s string) bool {
	if len(s) == 0 || len(s) > 253 {
		return false
	}
	for _, l := range strings.Split(s, ".") {
		if len(l) == 0 || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
			return false
		}
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}
