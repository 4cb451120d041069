package loader

// One line per BPF object. Generated identifiers stay unexported; the
// hand-written types of this package wrap them. The flags are fixed (bpf2go
// adds -mcpu=v1, strips DWARF and maps source paths to relative ones) so
// that `go generate ./loader/` reproduces the committed *_bpfel.go and
// *_bpfel.o byte for byte with the same clang (Debian clang 14.0.6).

//go:generate go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror" sockops ../bpf/sockops.bpf.c -- -I../bpf/include
//go:generate go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror" sockstat ../bpf/sockstat.bpf.c -- -I../bpf/include
//go:generate go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror" tcpiter ../bpf/tcpiter.bpf.c -- -I../bpf/include
//go:generate go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror" conniter ../bpf/conniter.bpf.c -- -I../bpf/include
//go:generate go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror" signals ../bpf/signals.bpf.c -- -I../bpf/include
