// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/destination"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/loader/limits"
)

// LoopEnv is set in the environment of the load generator processes the
// connections drill starts, so a test binary can recognise that it was
// re-executed as one.
const LoopEnv = "FAIRSHARE_DRILL_CONNECT_LOOP"

// ErrNotRoot means the connections drill was started without root: it loads
// BPF programs and creates cgroups.
var ErrNotRoot = errors.New("the connections drill needs root (it loads BPF programs and creates cgroups); run it with sudo")

// loopSpec is what the drill tells a load generator process on its stdin.
type loopSpec struct {
	Addr       string        `json:"addr"`
	Writers    int           `json:"writers"`
	Sends      [][2]int64    `json:"sends_unix_ns"` // [from, to) intervals
	RetryPause time.Duration `json:"retry_pause"`
}

// loopResult is one connection as the load generator saw it: a result
// (its fields as there) on the wire.
type loopResult struct {
	Sent     int64  `json:"t"` // unix ns
	Latency  int64  `json:"l"` // ns
	Status   status `json:"s"`
	Refusals int    `json:"r,omitempty"`
}

// RunConnections runs the connections drill: the same phases as Run, but the
// pool is the kernel's connection pool. It loads the BPF limiter with a
// private pin directory and a private projects root, creates the two projects
// as cgroups, starts one load generator process in each (loopCmd, e.g. the
// fairshare binary with its hidden connect-loop subcommand) and removes all
// of it before returning. Latency is connect, a one-byte exchange the server
// answers after Config.ServiceTime, and close; a refusal is ECONNREFUSED from
// connect.
// With Config.ToDestination the pool is a destination pool (DestPoolName)
// whose destination is the drill's server, in a node pool destNodeFactor
// times its size: the same experiment through the destination pool's rule.
func RunConnections(ctx context.Context, cfg Config, loopCmd []string) (rep *Report, err error) {
	cfg = cfg.withDefaults()
	if cfg.Sample < 5*time.Millisecond {
		// A snapshot reads several maps; sampling faster only burns the
		// cores the connect loops need.
		cfg.Sample = 5 * time.Millisecond
	}
	if os.Geteuid() != 0 {
		return nil, ErrNotRoot
	}
	if len(loopCmd) == 0 {
		return nil, errors.New("no load generator command")
	}
	mnt, err := cgroup.FindMount()
	if err != nil {
		return nil, fmt.Errorf("finding cgroup2: %w", err)
	}
	mount := mnt.Point
	if removed, err := RemoveStale(bpffsDir, mount); err != nil {
		cfg.Log.Warn("could not remove what a killed drill left behind", "err", err)
	} else if len(removed) > 0 {
		cfg.Log.Warn("removed what a killed drill left behind", "paths", removed)
	}
	tag := stalePrefix + strconv.Itoa(os.Getpid())
	root := filepath.Join(mount, tag)
	pinDir := filepath.Join(bpffsDir, tag)
	// Cleanup in reverse order of setup, whatever failed: processes, then
	// cgroups, then the pinned programs.
	var cleanups []func() error
	defer func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			if cerr := cleanups[i](); cerr != nil && err == nil {
				err = fmt.Errorf("cleaning up: %w", cerr)
			}
		}
	}()
	cleanups = append(cleanups, func() error {
		if err := loader.Cleanup(pinDir); err != nil {
			return fmt.Errorf("unpinning %s: %w", pinDir, err)
		}
		return nil
	})
	cleanups = append(cleanups, func() error { return cgroup.RemoveTree(root) })
	if err := os.Mkdir(root, 0o755); err != nil {
		return nil, fmt.Errorf("creating the projects root: %w", err)
	}
	level, err := mnt.Level(root)
	if err != nil {
		return nil, err
	}
	// The projects are the root's children: the walk looks at that level only.
	nodeSize := cfg.PoolSize
	if cfg.ToDestination {
		if nodeSize > limits.MaxPoolSize/destNodeFactor {
			return nil, fmt.Errorf("destination pool of %d: the node's pool around it, %d times larger, holds at most %d permits", cfg.PoolSize, destNodeFactor, limits.MaxPoolSize)
		}
		nodeSize *= destNodeFactor
	}
	if nodeSize > limits.MaxPoolSize {
		return nil, fmt.Errorf("pool of %d: the kernel's connection pool holds at most %d permits", nodeSize, limits.MaxPoolSize)
	}
	lim, err := loader.Open(loader.Options{PinDir: pinDir, PoolSize: uint32(nodeSize), Logger: cfg.Log,
		BaseLevel: level + 1, MaxDepth: 1, MaxProjects: 16, MaxDestPools: 1})
	if err != nil {
		return nil, fmt.Errorf("loading the limiter: %w", err)
	}
	cleanups = append(cleanups, lim.Close)
	cgFDs := map[string]*os.File{}
	var members []loader.Member
	for _, p := range []string{Small, Big} {
		dir := filepath.Join(root, p)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return nil, fmt.Errorf("creating project cgroup: %w", err)
		}
		cleanups = append(cleanups, func() error { return cgroup.RemoveTree(dir) })
		fd, err := os.Open(dir)
		if err != nil {
			return nil, fmt.Errorf("opening project cgroup: %w", err)
		}
		cleanups = append(cleanups, fd.Close)
		cgFDs[p] = fd
		members = append(members, loader.Member{Project: p, Cgroup: dir})
	}
	if rep, err := lim.SetMembers(members); err != nil || len(rep.Refused) > 0 {
		return nil, fmt.Errorf("registering the projects: %v %v", rep.Refused, err)
	}

	// The server: outside the projects root, so only the clients count.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listening: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var bg sync.WaitGroup
	cleanups = append(cleanups, func() error { cancel(); l.Close(); bg.Wait(); return nil })
	bg.Add(1)
	go func() { defer bg.Done(); serveHold(ctx, l, cfg.ServiceTime, &bg) }()
	if cfg.ToDestination {
		// The server's address and port are the destination pool's one
		// destination: the pool the drill measures.
		d, err := destination.Parse(l.Addr().String())
		if err != nil {
			return nil, fmt.Errorf("the server's destination: %w", err)
		}
		if err := lim.SetDestPools([]loader.DestPool{{Name: DestPoolName, Size: uint32(cfg.PoolSize), Destinations: []destination.Destination{d}}}); err != nil {
			return nil, fmt.Errorf("configuring the destination pool: %w", err)
		}
	}

	// The kernel counts a newcomer into the active set at its first
	// connect, so the share follows big at once in every slice, as in the
	// requests pool: the floor is judged from the first sample.
	tl := newTimeline(time.Now().Add(200*time.Millisecond), cfg.Warmup, cfg.Phase, cfg.Slices)
	hold := newHoldings()
	// The maps are read entry by entry while the programs change them, and
	// a project's count is read before its permit is added: it may pass its
	// share by CPUs - 1 (bpf/limiter.c).
	hold.torn, hold.slack = true, runtime.NumCPU()-1
	if s, err := lim.Snapshot(); err == nil {
		hold.floor = s.Floor
		if cfg.ToDestination && len(s.Dests) == 1 {
			hold.floor = s.Dests[0].Floor
		}
	} else {
		return nil, fmt.Errorf("reading the limiter: %w", err)
	}
	type proc struct {
		cmd *exec.Cmd
		out []byte
		err error
		wg  sync.WaitGroup
	}
	procs := map[string]*proc{}
	start := func(project string, writers int) error {
		spec := loopSpec{Addr: l.Addr().String(), Writers: writers, RetryPause: cfg.RetryPause}
		for _, iv := range tl.sends(project) {
			spec.Sends = append(spec.Sends, [2]int64{iv.from.UnixNano(), iv.to.UnixNano()})
		}
		specJSON, _ := json.Marshal(spec)
		cmd := exec.CommandContext(ctx, loopCmd[0], loopCmd[1:]...)
		cmd.Env = append(os.Environ(), LoopEnv+"=1")
		cmd.Stdin = bytes.NewReader(specJSON)
		cmd.Stderr = os.Stderr
		// Born in the project's cgroup: its first connect already counts.
		// Pdeathsig: a drill killed outright does not leave its loops running.
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cgFDs[project].Fd()), Pdeathsig: syscall.SIGKILL}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			return fmt.Errorf("load generator pipe: %w", err)
		}
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("starting the %s load generator: %w", project, err)
		}
		p := &proc{cmd: cmd}
		procs[project] = p
		cleanups = append(cleanups, func() error {
			_ = cmd.Process.Kill()
			p.wg.Wait()
			return nil
		})
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.out, p.err = io.ReadAll(stdout)
			if werr := cmd.Wait(); p.err == nil {
				p.err = werr
			}
		}()
		return nil
	}
	if err := start(Small, cfg.SmallWriters); err != nil {
		return nil, err
	}
	if err := start(Big, cfg.BigWriters); err != nil {
		return nil, err
	}
	var tickErr error
	bg.Add(2)
	go func() {
		defer bg.Done()
		every(ctx, cfg.Recompute, tl.endAt.Add(time.Second), func() {
			if err := lim.Tick(time.Now()); err != nil && tickErr == nil {
				tickErr = err
			}
		})
	}()
	go func() {
		defer bg.Done()
		every(ctx, cfg.Sample, tl.endAt, func() {
			// The read's start and end: a snapshot takes tens of
			// microseconds, or milliseconds when it waits for a tick's
			// lock, and a read that crosses a slice's end counts in
			// neither slice (timeline.spanOf): stamped at its end it put
			// a both slice's last state into the next solo slice, at its
			// start a solo slice's last read returned the next both
			// slice's.
			at := time.Now()
			s, err := lim.Snapshot()
			if err != nil {
				return
			}
			held := make(map[string]int, len(s.Projects))
			admitted := make(map[string]uint64, len(s.Projects))
			inUse, projs := s.InUse, s.Projects
			if cfg.ToDestination && len(s.Dests) == 1 {
				inUse, projs = s.Dests[0].InUse, s.Dests[0].Projects
			}
			for _, p := range projs {
				held[p.Project] += p.InUse
				admitted[p.Project] += p.Admitted
			}
			hold.observe(at, time.Now(), inUse, held, admitted)
		})
	}()
	res := map[string][]result{}
	for _, project := range []string{Small, Big} {
		p := procs[project]
		p.wg.Wait()
		// Interrupted, the load generators are killed (or stop on the
		// signal themselves): that is the error, not how they ended.
		if ctx.Err() != nil {
			return nil, fmt.Errorf("drill interrupted: %w", context.Cause(ctx))
		}
		if p.err != nil {
			return nil, fmt.Errorf("%s load generator: %w", project, p.err)
		}
		var lr []loopResult
		if err := json.Unmarshal(p.out, &lr); err != nil {
			return nil, fmt.Errorf("%s load generator output: %w", project, err)
		}
		for _, r := range lr {
			res[project] = append(res[project], result{sent: time.Unix(0, r.Sent), latency: time.Duration(r.Latency),
				status: r.Status, refusals: r.Refusals})
		}
	}
	cancel()
	l.Close()
	bg.Wait()
	if tickErr != nil {
		return nil, fmt.Errorf("control loop: %w", tickErr)
	}
	rep = buildReport("connections", cfg, tl, hold, res)
	if cfg.ToDestination {
		rep.Destination = DestPoolName + " " + l.Addr().String()
	}
	return rep, nil
}

// DestPoolName names the drill's destination pool (Config.ToDestination).
const DestPoolName = "drill"

// destNodeFactor is how much larger than the destination pool the node's
// pool is in a drill to a destination pool: never what refuses.
const destNodeFactor = 16

// serveHold answers each connection's byte after hold, then closes it.
func serveHold(ctx context.Context, l net.Listener, hold time.Duration, bg *sync.WaitGroup) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		bg.Add(1)
		go func() {
			defer bg.Done()
			defer c.Close()
			var b [1]byte
			if _, err := c.Read(b[:]); err != nil {
				return
			}
			t := time.NewTimer(hold)
			defer t.Stop()
			select {
			case <-t.C:
			case <-ctx.Done():
				return
			}
			_, _ = c.Write(b[:])
		}()
	}
}

// bpffsDir is where the connections drill pins its programs.
const bpffsDir = "/sys/fs/bpf"

// stalePrefix starts the names of the drill's pin directory and cgroup; the
// drill's pid follows.
const stalePrefix = "fairshare-drill-"

// RemoveStale removes the pin directories under bpffs and the cgroups under
// cgroupMount that a connections drill killed outright (SIGKILL: none of its
// cleanup ran) left behind: those named after a pid that no longer runs
// (load generators of that drill still running in its cgroups are killed).
// A drill that is still running is left alone. It returns what it removed.
func RemoveStale(bpffs, cgroupMount string) (removed []string, err error) {
	var errs []error
	for _, dir := range []string{bpffs, cgroupMount} {
		ents, err := os.ReadDir(dir)
		if err != nil {
			errs = append(errs, fmt.Errorf("listing %s: %w", dir, err))
			continue
		}
		for _, e := range ents {
			rest, ok := strings.CutPrefix(e.Name(), stalePrefix)
			if !ok || !e.IsDir() {
				continue
			}
			pid, err := strconv.Atoi(rest)
			if err != nil || pid <= 0 || processAlive(pid) {
				continue
			}
			path := filepath.Join(dir, e.Name())
			if dir == bpffs {
				err = loader.Cleanup(path)
			} else {
				err = cgroup.RemoveTree(path)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("removing stale %s: %w", path, err))
				continue
			}
			removed = append(removed, path)
		}
	}
	return removed, errors.Join(errs...)
}

// processAlive reports whether pid is a running process (signal 0 checks
// without sending anything; EPERM still means it exists).
func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// ConnectLoop is the load generator of the connections drill, run in a
// project's cgroup: it reads a spec from in, runs the writers' connect loops
// and writes every connection's result to out as JSON.
func ConnectLoop(ctx context.Context, in io.Reader, out io.Writer) error {
	var spec loopSpec
	if err := json.NewDecoder(in).Decode(&spec); err != nil {
		return fmt.Errorf("reading the loop spec: %w", err)
	}
	var (
		mu  sync.Mutex // guards all
		all []loopResult
		wg  sync.WaitGroup
	)
	d := net.Dialer{Timeout: 5 * time.Second}
	for range spec.Writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []loopResult
			defer func() { mu.Lock(); all = append(all, mine...); mu.Unlock() }()
			for _, iv := range spec.Sends {
				if !sleepUntil(ctx, time.Unix(0, iv[0])) {
					return
				}
				stop := time.Unix(0, iv[1])
				var ch chain // as in startWriters
				for ctx.Err() == nil && time.Now().Before(stop) {
					t0 := time.Now()
					st := exchange(ctx, &d, spec.Addr)
					r := ch.record(t0, time.Since(t0), st)
					mine = append(mine, loopResult{Sent: r.sent.UnixNano(), Latency: int64(r.latency), Status: r.status, Refusals: r.refusals})
					if st != statusOK {
						sleepUntil(ctx, time.Now().Add(spec.RetryPause))
					}
				}
				if r, ok := ch.cut(time.Now()); ok {
					mine = append(mine, loopResult{Sent: r.sent.UnixNano(), Latency: int64(r.latency), Status: r.status, Refusals: r.refusals})
				}
			}
		}()
	}
	wg.Wait()
	if ctx.Err() != nil {
		// Stopped before its intervals ended: what it has is no run.
		return fmt.Errorf("interrupted: %w", context.Cause(ctx))
	}
	bw := bufio.NewWriter(out)
	if err := json.NewEncoder(bw).Encode(all); err != nil {
		return fmt.Errorf("writing results: %w", err)
	}
	return bw.Flush()
}

// exchange connects, sends a byte, reads the server's answer and closes.
func exchange(ctx context.Context, d *net.Dialer, addr string) status {
	c, err := d.DialContext(ctx, "tcp", addr)
	if errors.Is(err, syscall.ECONNREFUSED) {
		return statusRefused
	}
	if err != nil {
		return statusError
	}
	defer c.Close()
	var b [1]byte
	if _, err := c.Write(b[:]); err != nil {
		return statusError
	}
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return statusError
	}
	return statusOK
}
