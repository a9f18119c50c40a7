// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf/btf"

	"github.com/fairshare-dev/fairshare/loader/limits"
)

// The Go structs used to read and write the maps must match the C structs
// byte for byte: compare them with the BTF of the embedded object.
func TestGoCLayoutsAgree(t *testing.T) {
	spec, err := loadLimiter()
	if err != nil {
		t.Fatal(err)
	}
	for c, goVal := range map[string]any{
		"fs_settings":      limiterFsSettings{},
		"fs_pool":          limiterFsPool{},
		"fs_project":       limiterFsProject{},
		"fs_counters":      limiterFsCounters{},
		"fs_sock":          limiterFsSock{},
		"fs_slot":          limiterFsSlot{},
		"fs_listen_key":    limiterFsListenKey{},
		"fs_listener":      limiterFsListener{},
		"fs_port":          limiterFsPort{},
		"fs_resv_key":      limiterFsResvKey{},
		"fs_resv":          limiterFsResv{},
		"fs_resv_slot":     limiterFsResvSlot{},
		"fs_adjust_args":   limiterFsAdjustArgs{},
		"fs_sock_record":   limiterFsSockRecord{},
		"fs_event":         limiterFsEvent{},
		"fs_evcfg":         limiterFsEvcfg{},
		"fs_evproj":        limiterFsEvproj{},
		"fs_evstats":       limiterFsEvstats{},
		"fs_rate":          limiterFsRate{},
		"fs_rated":         limiterFsRated{},
		"fs_rate_counters": limiterFsRateCounters{},
		"fs_rate_args":     limiterFsRateArgs{},
	} {
		var st *btf.Struct
		if err := spec.Types.TypeByName(c, &st); err != nil {
			t.Fatalf("%s: %v", c, err)
		}
		gt := reflect.TypeOf(goVal)
		if uintptr(st.Size) != gt.Size() {
			t.Errorf("%s: C size %d, Go size %d", c, st.Size, gt.Size())
		}
		var fields []reflect.StructField
		for i := range gt.NumField() {
			if f := gt.Field(i); f.Name != "_" {
				fields = append(fields, f)
			}
		}
		if len(fields) != len(st.Members) {
			t.Errorf("%s: C has %d members, Go %d fields", c, len(st.Members), len(fields))
			continue
		}
		for i, m := range st.Members {
			f := fields[i]
			if uintptr(m.Offset.Bytes()) != f.Offset {
				t.Errorf("%s.%s: C offset %d, Go %s offset %d", c, m.Name, m.Offset.Bytes(), f.Name, f.Offset)
			}
			want := strings.ReplaceAll(m.Name, "_", "")
			if !strings.EqualFold(want, f.Name) {
				t.Errorf("%s: member %d is %s in C, %s in Go", c, i, m.Name, f.Name)
			}
		}
	}
	var rec *btf.Struct
	if err := spec.Types.TypeByName("fs_sock_record", &rec); err != nil {
		t.Fatal(err)
	}
	if rec.Size != sockRecordSize {
		t.Errorf("sockRecordSize %d, C %d", sockRecordSize, rec.Size)
	}
}

// The listener tables have the size MaxListeners says (the daemon's
// warning of a full table names it).
func TestListenerTablesSize(t *testing.T) {
	spec, err := loadLimiter()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"fs_listen_socks", "fs_listeners"} {
		if n := spec.Maps[name].MaxEntries; n != MaxListeners {
			t.Errorf("%s has %d entries, MaxListeners is %d", name, n, MaxListeners)
		}
	}
}

// asProjects finds the maps bpf/lib sizes "as fs_projects": their
// max_entries comment says so.
var asProjects = regexp.MustCompile(`struct \{\n[^{}]*__uint\(max_entries, \d+\); /\*[^*]*\bas fs_projects\b[^{}]*\n\} (\w+) SEC\("\.maps"\);`)

// Every map the headers size "as fs_projects" (an entry per project id) has
// fs_projects' entries in the spec Open loads, at the default and at other
// counts of projects. (The rates, the dry-run projects and the refusal
// events' projects kept the headers' 4096 whatever the projects table
// held: past 4096 projects, SetRates failed for the others, their rates
// unenforced, and SetDryRunProjects failed at each tick.)
func TestPerProjectMapsSizedAsProjects(t *testing.T) {
	files, err := filepath.Glob("../bpf/lib/*.h")
	if err != nil || len(files) == 0 {
		t.Fatalf("no headers: %v", err)
	}
	var names []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range asProjects.FindAllStringSubmatch(string(b), -1) {
			names = append(names, m[1])
		}
	}
	for _, want := range []string{"fs_names", "fs_rates", "fs_dryrun", "fs_ev_projects"} {
		if !slices.Contains(names, want) {
			t.Errorf("%s not found sized as fs_projects in bpf/lib (found %v)", want, names)
		}
	}
	for _, n := range []uint32{0, 2, 5000, 1 << 20} {
		o, err := Options{PinDir: t.TempDir(), PoolSize: 100, MaxProjects: n}.normalize()
		if err != nil {
			t.Fatal(err)
		}
		l := &Limiter{base: o.BaseLevel, depth: o.MaxDepth, maxProj: o.MaxProjects, maxMemb: o.MaxMembers, pinDir: o.PinDir,
			capacity: o.PoolCapacity, maxDest: o.MaxDestPools}
		spec, err := l.spec()
		if err != nil {
			t.Fatal(err)
		}
		want := spec.Maps["fs_projects"].MaxEntries
		if want != o.MaxProjects {
			t.Fatalf("MaxProjects %d: fs_projects of %d entries", o.MaxProjects, want)
		}
		for _, name := range names {
			if got := spec.Maps[name].MaxEntries; got != want {
				t.Errorf("MaxProjects %d: %s of %d entries, fs_projects of %d", o.MaxProjects, name, got, want)
			}
		}
	}
}

func TestHeldCapacity(t *testing.T) {
	for _, c := range []struct{ pool, want uint32 }{
		{1, 1024}, {512, 1024}, {513, 2048}, {5000, 16384}, {limits.MaxPoolSize, 2 * limits.MaxPoolSize},
	} {
		if got := heldCapacity(c.pool); got != c.want {
			t.Errorf("heldCapacity(%d) = %d, want %d", c.pool, got, c.want)
		}
	}
}

// The slot protocols read a slot's fields after its tag with plain loads,
// which only x86 keeps in order (bpf/limiter.c, "Memory order"): the object
// is generated for x86 alone, and adding another target has to come with
// acquire loads there first.
func TestObjectIsX86Only(t *testing.T) {
	gen, err := os.ReadFile("../gen.go")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(gen), " -target amd64 ") {
		t.Errorf("gen.go does not generate for amd64 alone")
	}
	objs, err := filepath.Glob("limiter_*_bpf*.go")
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) != 1 || objs[0] != "limiter_x86_bpfel.go" {
		t.Fatalf("generated bindings %v, want limiter_x86_bpfel.go alone", objs)
	}
	b, err := os.ReadFile(objs[0])
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "\n//go:build (386 || amd64) && linux\n") {
		t.Errorf("%s builds for more than x86", objs[0])
	}
}
