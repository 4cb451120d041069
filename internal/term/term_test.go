package term

import (
	"encoding/json"
	"testing"
)

func TestSafe(t *testing.T) {
	for in, want := range map[string]string{
		"node0":                     "node0",
		"job 7: lost node2 (reset)": "job 7: lost node2 (reset)",
		"naïve café ü":              "naïve café ü",
		"\x1b[2J\x1b]0;pwned\x07":   `\x1b[2J\x1b]0;pwned\a`,
		"a\nb\rc\td":                `a\nb\rc\td`,
		"del\x7f":                   `del\x7f`,
		"csi\u009b31m":              `csi\u009b31m`,
		"rtl\u202egnp.exe":          `rtl\u202egnp.exe`,
		"bad\xff\xfe utf8":          `bad\xff\xfe utf8`,
		"nul\x00":                   `nul\x00`,
		"tag\U000e0041":             `tag\U000e0041`,
		"repl \uFFFD ok":            "repl \uFFFD ok",
	} {
		if got := Safe(in); got != want {
			t.Errorf("Safe(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestSafeJSON: what encoding/json leaves raw (DEL, C1, format characters)
// is escaped, and the output is still JSON of the same value.
func TestSafeJSON(t *testing.T) {
	v := map[string]string{"host": "n\x1b[2J\x7f\u009b31m\u202e\U000e0041 é", "ok": "node0"}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	out := SafeJSON(b)
	for _, r := range string(out) {
		if r != '\n' && (r < ' ' || r == 0x7f || (r >= 0x80 && r <= 0x9f) || r == 0x202e || r == 0xe0041) {
			t.Fatalf("SafeJSON left %U in %s", r, out)
		}
	}
	var back map[string]string
	if err := json.Unmarshal(out, &back); err != nil || back["host"] != v["host"] || back["ok"] != "node0" {
		t.Errorf("SafeJSON(%s) = %s: %v, %q; want the same value", b, out, err, back)
	}
	plain := []byte("{\n  \"a\": \"b\"\n}\n")
	if got := SafeJSON(plain); string(got) != string(plain) {
		t.Errorf("SafeJSON changed plain JSON: %s", got)
	}
}
