// Package term renders text that others supplied (job ids, node names,
// reasons that quote what a rank or another node said) for a terminal:
// a control character or an escape sequence in it must reach the screen
// as text, never as a command to the terminal.
package term

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// Safe returns s with every rune that is not printable (control
// characters, C1 codes, DEL, format characters such as bidi overrides, and
// invalid UTF-8) written as its Go escape (\x1b, \n, \u202e, \xff), and
// everything else, ordinary text included, as it is: no quotes around it.
func Safe(s string) string {
	if printableASCII(s) {
		return s
	}
	var b strings.Builder
	for i, r := range s {
		switch {
		case r == utf8.RuneError && !strings.HasPrefix(s[i:], "\uFFFD"):
			b.WriteString(`\x` + strconv.FormatUint(uint64(s[i])|0x100, 16)[1:])
		case unicode.IsPrint(r):
			b.WriteRune(r)
		default:
			q := strconv.QuoteRuneToASCII(r)
			b.WriteString(q[1 : len(q)-1])
		}
	}
	return b.String()
}

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < ' ' || s[i] > '~' {
			return false
		}
	}
	return true
}

// SafeJSON escapes, in JSON that encoding/json wrote, the runes it leaves
// as they are but a terminal may act on (DEL, C1 codes, format characters
// such as bidi overrides), as \uXXXX: outside its strings such JSON holds
// only ASCII and newlines, so the result is the same JSON value.
func SafeJSON(b []byte) []byte {
	s := string(b)
	if printableASCII(strings.ReplaceAll(s, "\n", "")) {
		return b
	}
	var out strings.Builder
	for _, r := range s {
		switch {
		case r == '\n' || unicode.IsPrint(r):
			out.WriteRune(r)
		case r > 0xffff:
			r1, r2 := utf16.EncodeRune(r)
			out.WriteString(`\u` + hex4(r1) + `\u` + hex4(r2))
		default:
			out.WriteString(`\u` + hex4(r))
		}
	}
	return []byte(out.String())
}

func hex4(r rune) string {
	return strconv.FormatUint(uint64(r)|0x10000, 16)[1:]
}
