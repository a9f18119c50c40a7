// SPDX-License-Identifier: Apache-2.0

package fairshare

// The BPF objects are generated into loader/ and committed, so that go build
// and go test need no clang. `make generate` reruns this; CI reruns it and
// fails when the committed output differs. -mcpu=v3 is needed for the atomics
// that return a value (fetch-add, compare-and-swap).
//
// Another clang version builds other bytes from the same C, so the second
// step records the first line of `clang --version` (the compiler bpf2go ran:
// $BPF2GO_CC, else clang) in loader/clang.version, committed with the
// objects; `make check-generated` rebuilds and compares them only with that
// clang. ($DOLLAR is go generate's "$": it expands $NAME in a directive.)
//
// This file sits at the root, as the design card's layout has it, rather
// than in loader/ next to its output: go generate runs bpf2go in the
// directory of the file that names it, and from the root both the C
// (bpf/limiter.c, bpf/lib, bpf/headers) and the output (loader/) are paths
// below it, with bpf2go pinned as a tool in the go.mod beside it. It is the
// one file to look at for what is generated and how.
//go:generate go tool bpf2go -tags linux -target amd64 -output-dir loader -go-package loader -type fs_settings -type fs_pool -type fs_project -type fs_member -type fs_name -type fs_counters -type fs_sock -type fs_slot -type fs_listen_key -type fs_listener -type fs_port -type fs_resv_key -type fs_resv -type fs_resv_slot -type fs_adjust_args -type fs_selftest_args -type fs_event -type fs_evcfg -type fs_evproj -type fs_evstats -type fs_lapse -type fs_rate -type fs_rated -type fs_rate_counters -type fs_rate_args -type fs_dest_key -type fs_dest_conf -type fs_dest_state -type fs_dest_filter -type fs_dest_net limiter bpf/limiter.c -- -I bpf/headers -mcpu=v3 -Wall -Werror
//go:generate sh -c "${DOLLAR}{BPF2GO_CC:-clang} --version | head -n 1 > loader/clang.version"
