// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/pools"
)

// Ops of fs_rate_set (enum rate_op in bpf/lib/rate.h).
const (
	rateOpSet    = 1
	rateOpDelete = 2
)

// rateParams is the bucket of a rate: the refill time of one token and
// burst x that, the burst one second's worth of tokens and at least one
// (as package pools' buckets). perSec is taken as pools.ClampRate takes it;
// 0 is unbounded (0, 0).
func rateParams(perSec float64) (interval, burst uint64) {
	r := pools.ClampRate(perSec)
	if r == 0 {
		return 0, 0
	}
	interval = max(uint64(math.Round(float64(time.Second)/r)), 1)
	burst = uint64(math.Round(math.Max(r, 1) * float64(interval)))
	return interval, max(burst, interval)
}

// Rates are a project's rates of new connections per second, each from a
// bucket of its own (0 is unbounded): Out the connections it opens
// (connect), In those its listeners accept (at the SYN). Apart, because the
// SYNs come from clients the project does not control, which must not spend
// its outbound budget.
type Rates struct{ Out, In float64 }

// params is the buckets of r (rateParams of each).
func (r Rates) params() (iv, burst, ivIn, burstIn uint64) {
	iv, burst = rateParams(r.Out)
	ivIn, burstIn = rateParams(r.In)
	return iv, burst, ivIn, burstIn
}

// args is fs_rate_set's context setting project id's buckets to r.
func (r Rates) args(id uint64) limiterFsRateArgs {
	iv, burst, ivIn, burstIn := r.params()
	return limiterFsRateArgs{Op: rateOpSet, Project: id, IntervalNs: iv, BurstNs: burst, IntervalInNs: ivIn, BurstInNs: burstIn}
}

// unbounded says whether r limits nothing.
func (r Rates) unbounded() bool {
	iv, _, ivIn, _ := r.params()
	return iv == 0 && ivIn == 0
}

// SetRate sets project's rate of new connections per second, opened and
// accepted alike (each from its own bucket; 0 is unbounded): SetRates with
// Out and In both perSec.
func (l *Limiter) SetRate(project string, perSec float64) error {
	return l.SetRates(project, Rates{Out: perSec, In: perSec})
}

// SetRates sets project's rates of new connections. They are in force in
// the kernel when SetRates returns if the project's cgroup exists, and from
// the next Tick after it appears otherwise; a rate removed (0) stops
// limiting at once. The Limiter keeps the rates and writes them again at
// every Tick, so a project's cgroup made again is limited again.
func (l *Limiter) SetRates(project string, r Rates) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	if l.rates == nil {
		l.rates = map[string]Rates{}
	}
	if r.unbounded() {
		delete(l.rates, project)
	} else {
		l.rates[project] = r
	}
	id, err := l.projectID(project)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("setting the connection rate of %s: %w", project, err)
	}
	if r.unbounded() {
		var cur limiterFsRate
		if err := l.objs.FsRates.Lookup(id, &cur); errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
	}
	if _, err := l.rateSetLocked(r.args(id)); err != nil {
		return fmt.Errorf("setting the connection rate of %s: %w", project, err)
	}
	return nil
}

// rateSetLocked runs fs_rate_set, which changes a bucket's rate in place
// (a map update from user space would overwrite the tokens the hooks take
// and the refusals they count). l.mu serialises it.
func (l *Limiter) rateSetLocked(a limiterFsRateArgs) (int64, error) {
	buf, err := binary.Append(nil, binary.NativeEndian, &a)
	if err != nil {
		return 0, fmt.Errorf("encoding fs_rate_set context: %w", err)
	}
	out := make([]byte, len(buf))
	if _, err := l.objs.FsRateSet.Run(&ebpf.RunOptions{Context: buf, ContextOut: out}); err != nil {
		return 0, fmt.Errorf("running fs_rate_set: %w", err)
	}
	var res limiterFsRateArgs
	if _, err := binary.Decode(out, binary.NativeEndian, &res); err != nil {
		return 0, fmt.Errorf("decoding fs_rate_set context: %w", err)
	}
	if res.Result != 1 && a.Op == rateOpSet {
		return 0, fmt.Errorf("the rate map is full (%d projects with a rate)", l.objs.FsRates.MaxEntries())
	}
	return res.Result, nil
}

// readRates reads every bucket, by project id.
func (l *Limiter) readRates() (map[uint64]limiterFsRate, error) {
	out := map[uint64]limiterFsRate{}
	if l.objs.FsRates == nil { // pins of a version without rates (ReadOnly)
		return out, nil
	}
	var id uint64
	var v limiterFsRate
	it := l.objs.FsRates.Iterate()
	for it.Next(&id, &v) {
		out[id] = v
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("reading the rate map: %w", err)
	}
	return out, nil
}

// syncRatesLocked makes the buckets those of l.rates: the rate of every
// project with one whose cgroup exists, unbounded for the others. A bucket
// of a removed cgroup without a project entry (forgotten, see forgetLocked)
// is deleted; its refusals stay in the node-wide counters. projs are the
// project entries.
func (l *Limiter) syncRatesLocked(projs []projectEntry) error {
	have, err := l.readRates()
	if err != nil {
		return err
	}
	if len(have) == 0 && len(l.rates) == 0 {
		return nil
	}
	names, err := l.projectNames()
	if err != nil {
		return err
	}
	ids := make(map[string]uint64, len(names))
	for id, n := range names {
		ids[n] = id
	}
	want := map[uint64]Rates{}
	for n, r := range l.rates {
		if id, ok := ids[n]; ok {
			want[id] = r
		}
	}
	for id, r := range want {
		iv, burst, ivIn, burstIn := r.params()
		if cur, ok := have[id]; ok && cur.IntervalNs == iv && cur.BurstNs == max(burst, iv) &&
			cur.IntervalInNs == ivIn && cur.BurstInNs == max(burstIn, ivIn) {
			continue
		}
		if _, err := l.rateSetLocked(r.args(id)); err != nil {
			return fmt.Errorf("setting the connection rate of %s: %w", names[id], err)
		}
	}
	entry := make(map[uint64]bool, len(projs))
	for _, p := range projs {
		entry[p.id] = true
	}
	for id, cur := range have {
		if _, ok := want[id]; ok {
			continue
		}
		if _, live := names[id]; !live && !entry[id] {
			if _, err := l.rateSetLocked(limiterFsRateArgs{Op: rateOpDelete, Project: id}); err != nil {
				return fmt.Errorf("forgetting the connection rate of project %d: %w", id, err)
			}
			continue
		}
		if cur.IntervalNs != 0 || cur.IntervalInNs != 0 {
			if _, err := l.rateSetLocked(limiterFsRateArgs{Op: rateOpSet, Project: id}); err != nil {
				return fmt.Errorf("removing the connection rate of project %d: %w", id, err)
			}
		}
	}
	return nil
}

// readRateStats sums the node-wide refusals by rate over the CPUs.
func (l *Limiter) readRateStats() (out, in uint64, err error) {
	if l.objs.FsRateStats == nil {
		return 0, 0, nil
	}
	var per []limiterFsRateCounters
	if err := l.objs.FsRateStats.Lookup(uint32(0), &per); err != nil {
		return 0, 0, fmt.Errorf("reading rate counters: %w", err)
	}
	for _, c := range per {
		out += c.LimitedOut
		in += c.LimitedIn
	}
	return out, in, nil
}

// rateView is what Snapshot says of one project's outbound bucket.
func rateView(v limiterFsRate, mono uint64) (perSec, tokens float64) {
	return bucketView(v.Tat, v.IntervalNs, v.BurstNs, mono)
}

// rateViewIn is rateView of the inbound bucket.
func rateViewIn(v limiterFsRate, mono uint64) (perSec, tokens float64) {
	return bucketView(v.TatIn, v.IntervalInNs, v.BurstInNs, mono)
}

func bucketView(tat, interval, burst, mono uint64) (perSec, tokens float64) {
	if interval == 0 {
		return 0, 0
	}
	perSec = float64(time.Second) / float64(interval)
	deficit := uint64(0)
	if tat > mono {
		deficit = tat - mono
	}
	if deficit < burst {
		tokens = float64(burst-deficit) / float64(interval)
	}
	return perSec, tokens
}
