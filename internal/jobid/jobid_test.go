package jobid

import (
	"strings"
	"testing"
)

func TestValid(t *testing.T) {
	for _, tc := range []struct {
		name string
		id   string
		want bool
	}{
		{"one character", "j", true},
		{"slurm step", "12345.0", true},
		{"punctuation", "a-b_c:d@e", true},
		{"longest", strings.Repeat("x", MaxLen), true},
		{"empty", "", false},
		{"dot", ".", false},
		{"dot dot", "..", false},
		{"slash", "a/b", false},
		{"space", "a b", false},
		{"equals", "a=b", false},
		{"comma", "a,b", false},
		{"newline", "a\n", false},
		{"DEL", "a\x7f", false},
		{"too long", strings.Repeat("x", MaxLen+1), false},
		{"not ASCII", "café", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Valid(tc.id); got != tc.want {
				t.Errorf("Valid(%q) = %v, want %v", tc.id, got, tc.want)
			}
		})
	}
}
