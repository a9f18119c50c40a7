// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
)

// CheckReport is what Check found.
type CheckReport struct {
	// Pinned says whether PinDir holds a limiter (a running or a stopped
	// daemon's); the fields below up to Links describe it.
	Pinned bool
	// Pool, Floor, InUse and Projects are the pinned maps' values.
	Pool, Floor, InUse, Projects int
	// Capacity is the largest POOL the pinned permit tables hold.
	Capacity int
	// Exempt is the number of cgroups in the pinned exempt set, ExemptMax
	// its budget (0 while the set is empty).
	Exempt, ExemptMax int
	// Links maps each pinned link to the tag of the program it runs.
	Links map[string]string
	// Current says whether every pinned link runs the programs of this
	// binary; if not, the next Open (a daemon restart) moves them.
	Current bool
	// Attached lists the hooks the probe attached and detached again.
	Attached []string
	// Migrate says why the next Open migrates the pins to this version's
	// layout (doc.go, "Upgrades"), "" when it reuses them as they are.
	// The pinned maps' values above are then not read (their layout is
	// not this version's).
	Migrate string
}

// Check verifies, without disturbing a running limiter, that Open would
// work: the programs pass the kernel verifier; when PinDir holds a limiter,
// its maps have this version's layout (else Migrate says why Open will
// migrate them) and its permit tables hold PoolSize, and its links are in place; and every hook
// attaches. The attach test uses fresh, unpinned maps and a temporary empty
// cgroup (removed again), so no pinned map is written, no link is replaced
// and nothing is reconciled: the counts, the config and the exempt set of a
// running daemon stay as they are. Options.Exempt and ExemptMax are not
// looked at (the daemon applies them when it starts).
func Check(opts Options) (CheckReport, error) {
	var rep CheckReport
	opts, err := opts.normalize()
	if err != nil {
		return rep, err
	}
	if err := needRoot(); err != nil {
		return rep, err
	}
	mi, err := cgroup.FindMount()
	if err != nil {
		return rep, err
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return rep, fmt.Errorf("raising RLIMIT_MEMLOCK: %w", err)
	}
	l := &Limiter{root: mi.Point, mnt: mi, base: opts.BaseLevel, depth: opts.MaxDepth, maxProj: opts.MaxProjects,
		maxMemb: opts.MaxMembers, pinDir: opts.PinDir, size: opts.PoolSize, floor: opts.Floor, capacity: opts.PoolCapacity, log: opts.Logger, maxDest: opts.MaxDestPools,
		noDest: opts.NoDestPools, abortPast: opts.AbortMovedPast}
	// An interrupted cleanup's leftovers (no fs_config) are migrated by
	// Open, and said so (incompatible).
	left, err := leftoverPins(opts.PinDir)
	if err != nil {
		return rep, err
	}
	if len(left) > 0 {
		rep.Pinned = true
		if err := l.checkPinned(&rep); err != nil {
			return rep, err
		}
	}
	if err := l.probeAttach(mi, &rep); err != nil {
		return rep, err
	}
	return rep, nil
}

// checkPinned loads the programs against the pinned maps (the verifier and
// the layout check of Open) without pinning or writing anything, and reads
// the pinned config and links.
func (l *Limiter) checkPinned(rep *CheckReport) error {
	for dir, what := range map[string]string{readyDir: "an interrupted migration, which it finishes",
		stagingDir: "an interrupted migration, which it undoes and does again"} {
		if _, err := os.Stat(filepath.Join(l.pinDir, dir)); err == nil {
			rep.Migrate = what
			return nil
		}
	}
	spec, err := l.spec()
	if err != nil {
		return err
	}
	why, err := l.incompatible(spec)
	if err != nil {
		return err
	}
	if why != "" {
		rep.Migrate = "maps of another layout (" + why + ")"
		return nil
	}
	repl := map[string]*ebpf.Map{}
	defer func() {
		for _, m := range repl {
			m.Close()
		}
	}()
	for name, ms := range spec.Maps {
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(l.pinDir, name), nil)
		if errors.Is(err, os.ErrNotExist) && addedMaps[name] {
			ms.Pinning = ebpf.PinNone // Open creates it (see addedMaps)
			continue
		}
		if err != nil {
			return fmt.Errorf("pinned map %s in %s: %w (the pin directory is incomplete: "+
				"stop the daemon and run 'fairshare cleanup --pin-dir %s')", name, l.pinDir, err, l.pinDir)
		}
		repl[name] = m
	}
	var objs limiterObjects
	err = spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		return l.loadError(err)
	}
	defer objs.Close()

	var cfg limiterFsSettings
	if err := objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("reading config map: %w", err)
	}
	var node limiterFsPool
	if err := objs.FsNode.Lookup(uint32(0), &node); err != nil {
		return fmt.Errorf("reading node map: %w", err)
	}
	rep.Pool, rep.Floor, rep.InUse = int(cfg.Pool), int(cfg.Floor), int(node.InUse)
	rep.Capacity, rep.ExemptMax = int(l.held), int(cfg.ExemptMax)
	var id uint64
	var pv limiterFsProject
	for it := objs.FsProjects.Iterate(); it.Next(&id, &pv); {
		rep.Projects++
	}
	var one uint32
	for it := objs.FsExempt.Iterate(); it.Next(&id, &one); {
		rep.Exempt++
	}

	rep.Links = map[string]string{}
	rep.Current = true
	var missing []error
	for _, a := range l.attachments(l.root, &objs) {
		path := filepath.Join(l.pinDir, a.name)
		lk, err := link.LoadPinnedLink(path, nil)
		if err != nil {
			missing = append(missing, fmt.Errorf("pinned link %s: %w", path, err))
			continue
		}
		tag, err := linkTag(lk)
		lk.Close()
		if err != nil {
			return fmt.Errorf("reading pinned link %s: %w", path, err)
		}
		rep.Links[a.name] = tag
		if info, err := a.prog.Info(); err != nil || info.Tag != tag {
			rep.Current = false
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w (Open attaches what is missing)", errors.Join(missing...))
	}
	return nil
}

func linkTag(lk link.Link) (string, error) {
	info, err := lk.Info()
	if err != nil {
		return "", err
	}
	p, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return "", err
	}
	defer p.Close()
	pi, err := p.Info()
	if err != nil {
		return "", err
	}
	return pi.Tag, nil
}

// probeAttach loads the programs with fresh unpinned maps, configured for a
// temporary empty cgroup, attaches every hook (the cgroup hooks to that
// cgroup) and detaches again. The probe's programs see no project (the
// tracing ones run for every socket of the host, but no socket is in a
// cgroup below the probe) and admit every SYN (their port map is empty).
func (l *Limiter) probeAttach(mi cgroup.Mount, rep *CheckReport) error {
	dir, err := os.MkdirTemp(mi.Point, "fairshare-check-")
	if err != nil {
		return fmt.Errorf("creating the probe cgroup: %w", err)
	}
	defer os.Remove(dir)
	if err := cgroup.OnCgroup2(dir); err != nil {
		return fmt.Errorf("probe cgroup %w", err)
	}
	p := &Limiter{root: dir, mnt: mi, base: l.base, depth: l.depth, maxProj: l.maxProj, maxMemb: l.maxMemb,
		pinDir: filepath.Join(os.TempDir(), "fairshare-no-pins"), size: l.size, floor: l.floor, capacity: l.capacity, maxDest: l.maxDest, noDest: l.noDest,
		abortPast: l.abortPast}
	spec, err := p.spec()
	if err != nil {
		return err
	}
	for _, ms := range spec.Maps {
		ms.Pinning = ebpf.PinNone
	}
	var objs limiterObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return l.loadError(err)
	}
	defer objs.Close()
	for _, a := range p.attachments(dir, &objs) {
		lk, err := a.attach()
		if err != nil {
			if errors.Is(err, ebpf.ErrNotSupported) {
				return fmt.Errorf("attaching %s: the kernel does not support this hook: %w", a.name, err)
			}
			return fmt.Errorf("attaching %s: %w", a.name, err)
		}
		lk.Close()
		rep.Attached = append(rep.Attached, a.name)
	}
	return nil
}
