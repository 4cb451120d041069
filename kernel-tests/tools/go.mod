module github.com/mpipause/mpipause/kernel-tests/tools

go 1.26.8

require github.com/google/go-cmp v0.7.0
