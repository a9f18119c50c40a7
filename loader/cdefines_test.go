// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestGoMirrorsCDefines: the constants the loader copies from the BPF
// headers (#define and enum values the programs and the loader must agree
// on, and bpf2go does not generate) have the headers' values. A value the
// programs change and the loader does not would misread what they write:
// a dump's record, an adjust op, a table's size.
func TestGoMirrorsCDefines(t *testing.T) {
	c := cValues(t, "../bpf/lib/*.h")
	for name, goValue := range map[string]uint64{
		"DEST_NET_BITS":       destNetBits,
		"DEST_NETS":           destNets,
		"DEST_NET_PROBES":     destNetProbes,
		"DEST_LENS":           destLens,
		"MAX_DEPTH":           MaxDepth,
		"SLOT_BUSY":           slotBusy,
		"ADOPTED_PAST":        adoptedPast,
		"MOVED":               moved,
		"MOVED_PAST":          movedPast,
		"NOT_ADOPTED":         notAdopted,
		"MOVED_ABORTED":       movedAborted,
		"PAST_NODE":           pastNode,
		"PAST_DEST":           pastDest,
		"KIND_EXEMPT_OUT":     kindExemptOut,
		"KIND_EXEMPT_ADOPTED": kindExemptAdopted,
		"OP_EXPIRE":           opExpire,
		"OP_ADD":              opAdd,
		"OP_DROP":             opDrop,
		"OP_ACTIVE":           opActive,
		"OP_EXEMPT":           opExempt,
		"OP_UNLISTEN":         opUnlisten,
		"OP_MEMBER_GEN":       opMemberGen,
		"OP_DEST_ACTIVE":      opDestActive,
		"OP_DEST_ADD":         opDestAdd,
		"OP_DEST_CONF":        opDestConf,
	} {
		v, ok := c[name]
		if !ok {
			t.Errorf("%s: not found as a #define or an enum value of a number in bpf/lib", name)
			continue
		}
		if v != goValue {
			t.Errorf("%s is %d in bpf/lib, %d in the loader", name, v, goValue)
		}
	}
}

var (
	cDefine = regexp.MustCompile(`(?m)^#define ([A-Z][A-Z0-9_]*) (.+?)\s*(?:/\*.*)?$`)
	cEnum   = regexp.MustCompile(`(?m)^\s*([A-Z][A-Z0-9_]*) = (.+?),\s*(?:/\*.*)?$`)
	cShift  = regexp.MustCompile(`^\((\w+) << (\w+)\)$`)
)

// cValues reads the #define and enum values of the headers glob names
// that are numbers, or a number or a value read before shifted by another.
func cValues(t *testing.T, glob string) map[string]uint64 {
	t.Helper()
	files, err := filepath.Glob(glob)
	if err != nil || len(files) == 0 {
		t.Fatalf("no headers at %s: %v", glob, err)
	}
	vals := map[string]uint64{}
	num := func(s string) (uint64, bool) {
		if v, ok := vals[s]; ok {
			return v, true
		}
		v, err := strconv.ParseUint(strings.TrimRight(s, "ULul"), 0, 64)
		return v, err == nil
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, re := range []*regexp.Regexp{cDefine, cEnum} {
			for _, m := range re.FindAllStringSubmatch(string(b), -1) {
				name, expr := m[1], strings.TrimSpace(m[2])
				if v, ok := num(expr); ok {
					vals[name] = v
				} else if s := cShift.FindStringSubmatch(expr); s != nil {
					a, okA := num(s[1])
					n, okN := num(s[2])
					if okA && okN {
						vals[name] = a << n
					}
				}
			}
		}
	}
	return vals
}
