package ranks

import "testing"

// TestSyscallAt: the instruction pointer is the last field of
// /proc/PID/task/TID/syscall, in a syscall or not; a running thread has
// none.
func TestSyscallAt(t *testing.T) {
	const entry = 0x5614c873a289
	for _, c := range []struct {
		text string
		want bool
	}{
		{"230 0x14 0x7ffd48b0f930 0x7ffd48b0f800 0x0 0x0 0x64 0x7ffd48b0f7f8 0x5614c873a289\n", true},
		{"-1 0x7ffd48b0f7f8 0x5614c873a289\n", true},
		{"-1 0x7ffd48b0f7f8 0x5614c873a28a\n", false},
		{"230 0x14 0x7ffd48b0f930 0x7ffd48b0f800 0x0 0x0 0x64 0x5614c873a289 0x7f00aa\n", false},
		{"running\n", false},
		{"", false},
		{"-1 0x1 zz\n", false},
	} {
		if got := syscallAt(c.text, entry); got != c.want {
			t.Errorf("syscallAt(%q) = %v, want %v", c.text, got, c.want)
		}
	}
}
