// SPDX-License-Identifier: Apache-2.0

package fairshare

// The BPF objects are generated into loader/ and committed, so that go build
// and go test need no clang. `make generate` reruns this; CI reruns it and
// fails when the committed output differs.
