// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/btf"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/destination"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"golang.org/x/sys/unix"
)

// kubeLayout lays out a kubelet's cgroupfs tree below root with mkdir:
// kubepods, its QoS children, and the given pods' container cgroups
// (relative to kubepods), and opens a limiter that walks from root's
// children down, as the daemon's does from the cgroup2 root's.
func kubeLayout(t *testing.T, root, pin string, pool uint32, lapse time.Duration) (*Limiter, string) {
	t.Helper()
	return kubeLayoutWith(t, root, pin, Options{PoolSize: pool, LapseAfter: lapse})
}

// kubeLayoutWith is kubeLayout with more of the options (o's PinDir and
// BaseLevel are set here).
//
// The tests' pods are cgroups whose processes run in the test's own network
// namespace, the host's: LimitHostNetwork puts them under the weak members
// as pods in namespaces of their own are (TestHostNetworkPodsCountOnceClassified
// has the default).
func kubeLayoutWith(t *testing.T, root, pin string, o Options) (*Limiter, string) {
	t.Helper()
	o.LimitHostNetwork = true
	return kubeLayoutOpts(t, root, pin, o)
}

// kubeLayoutOpts is kubeLayoutWith with o as given.
func kubeLayoutOpts(t *testing.T, root, pin string, o Options) (*Limiter, string) {
	t.Helper()
	kp := mkdirs(t, root, "kubepods", "kubepods/burstable", "kubepods/besteffort")[0]
	mnt, err := cgroup.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	level, err := mnt.Level(root)
	if err != nil {
		t.Fatal(err)
	}
	o.PinDir, o.BaseLevel = pin, level+1
	l, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, kp
}

// podRoots are the weak members the daemon registers for kubepods.
func podRoots(kp string) []Member {
	return []Member{{Project: Unclassified, Cgroup: kp}, {Project: Unclassified, Cgroup: filepath.Join(kp, "burstable")},
		{Project: Unclassified, Cgroup: filepath.Join(kp, "besteffort")}}
}

func setMembers(t *testing.T, l *Limiter, ms []Member) {
	t.Helper()
	rep, err := l.SetMembers(ms)
	if err != nil || len(rep.Refused) > 0 {
		t.Fatalf("SetMembers: %+v %v", rep, err)
	}
}

// TestUnclassifiedPods lays out kubepods with mkdir: a pod no member names
// is under the rule as the reserved Unclassified project from its first
// connect, while the limiter is open and after it is closed (no daemon: the
// pins enforce); a classified pod's own cgroup, deeper, wins; a pod of no
// project (a system namespace's, the daemon's own) is neither counted nor
// refused; and in_use never passes POOL.
func TestUnclassifiedPods(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const pool = 12
	l, kp := kubeLayout(t, root, pin, pool, 0)
	dirs := mkdirs(t, kp, "burstable/podA", "burstable/podA/ctr", "burstable/podB", "burstable/podB/ctr",
		"besteffort/podSys", "besteffort/podSys/ctr", "podG", "podG/ctr")
	podA, podACtr, podB, podBCtr, podSys, podSysCtr, podGCtr := dirs[0], dirs[1], dirs[2], dirs[3], dirs[4], dirs[5], dirs[7]
	setMembers(t, l, append(podRoots(kp),
		Member{Project: "team-a", Cgroup: podA}, Member{Project: NoProject, Cgroup: podSys}))
	floor := snap(t, l).Floor
	ln := sink(t, "tcp4", "127.0.0.1:0")
	dst := ln.Addr().String()
	atMostPool := func(what string) {
		t.Helper()
		if s := snap(t, l); s.InUse > pool {
			t.Fatalf("%s: in_use %d past POOL %d: %+v", what, s.InUse, pool, s)
		}
	}

	// team-a holds half the pool.
	a := startHelper(t, podACtr)
	if r := a.dial("tcp4", dst, pool/2); r.ok != pool/2 {
		t.Fatalf("team-a: %+v", r)
	}
	// A pod nobody classified opens 100 connections at once: it is the
	// Unclassified project, and takes what the rule gives a newcomer.
	b := startHelper(t, podBCtr)
	rb := b.dial("tcp4", dst, 100)
	s := snap(t, l)
	share := pool / 2 // two projects active
	if rb.ok > share+floor || rb.ok == 0 || project(s, Unclassified).InUse != rb.ok || s.InUse > pool {
		t.Fatalf("unclassified pod admitted %+v (share %d, floor %d): %+v", rb, share, floor, s)
	}
	// team-a keeps at least its floor: it holds its share already.
	if project(s, "team-a").InUse < floor {
		t.Fatalf("team-a lost its floor: %+v", s)
	}
	// A guaranteed pod straight below kubepods is unclassified too.
	g := startHelper(t, podGCtr)
	g.dial("tcp4", dst, 20)
	atMostPool("guaranteed pod")

	// A pod of no project is neither counted nor refused.
	before := snap(t, l).InUse
	sys := startHelper(t, podSysCtr)
	sys.dialOK("tcp4", dst, 20, "system pod refused")
	if s := snap(t, l); s.InUse != before {
		t.Fatalf("system pod counted: in_use %d, was %d", s.InUse, before)
	}

	// Classified: podB's own cgroup, deeper than kubepods, wins; the
	// permits taken as Unclassified stay with it until a Reconcile moves them.
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA},
		Member{Project: NoProject, Cgroup: podSys}, Member{Project: "team-b", Cgroup: podB}))
	unclassified := project(snap(t, l), Unclassified).InUse
	b.dial("tcp4", dst, 10)
	s = snap(t, l)
	if project(s, Unclassified).InUse != unclassified || s.InUse > pool {
		t.Fatalf("after classification: %+v (unclassified held %d)", s, unclassified)
	}
	b.do("close")
	g.do("close")
	waitInUse(t, l, pool/2, map[string]int{"team-a": pool / 2, Unclassified: 0, "team-b": 0})

	// No daemon: the limiter is closed, the pins go on. A pod made now,
	// which no daemon will ever classify, is under the rule.
	l.Close()
	podC := mkdirs(t, kp, "besteffort/podC", "besteffort/podC/ctr")[1]
	c := startHelper(t, podC)
	rc := c.dial("tcp4", dst, 100)
	ro, err := OpenReadOnly(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	s, err = ro.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if rc.ok > share+floor || rc.ok == 0 || s.InUse > pool || project(s, Unclassified).InUse != rc.ok {
		t.Fatalf("with no daemon the new pod got %+v: %+v", rc, s)
	}
}

// TestUnclassifiedPermitsMoveAtReconcile: permits taken as Unclassified
// by a pod classified since move, at the next Reconcile, to its project:
// a pod below a QoS child (weak members at kubepods and at burstable) and a
// Guaranteed pod straight below kubepods. The counts move exactly (the
// node's in_use does not change), a second pass moves nothing and repairs
// nothing, and the sockets' releases give back to the project they moved
// to. A move past the rule is counted all the same, reported in MovedPast,
// and the project is refused further.
func TestUnclassifiedPermitsMoveAtReconcile(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const pool = 12
	l, kp := kubeLayout(t, root, pin, pool, 0)
	dirs := mkdirs(t, kp, "burstable/podA", "burstable/podA/ctr", "burstable/podB", "burstable/podB/ctr", "podG", "podG/ctr")
	podA, podACtr, podB, podBCtr, podG, podGCtr := dirs[0], dirs[1], dirs[2], dirs[3], dirs[4], dirs[5]
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}))
	dst := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	// A destination pool over dst: its permits move with the node's.
	if err := l.SetDestPools([]DestPool{destPoolOf(t, "db", 100, 1, strings.Replace(dst, ":", "/32:", 1))}); err != nil {
		t.Fatal(err)
	}
	reconcile := func() ReconcileReport { return reconcileOK(t, l) }

	a := startHelper(t, podACtr)
	a.dialOK("tcp4", dst, 4, "team-a")
	b := startHelper(t, podBCtr)
	b.dialOK("tcp4", dst, 3, "unclassified podB")
	g := startHelper(t, podGCtr)
	g.dialOK("tcp4", dst, 2, "unclassified podG")
	waitInUse(t, l, 9, map[string]int{"team-a": 4, Unclassified: 5})

	// podB is classified: its 3 permits move to team-b, podG's stay.
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}, Member{Project: "team-b", Cgroup: podB}))
	rep := reconcile()
	if rep.Moved["team-b"] != 3 || len(rep.Moved) != 1 || len(rep.MovedPast) != 0 || len(rep.MovedPastIn) != 0 || rep.Adopted != 0 || len(rep.DestRepaired) != 0 {
		t.Fatalf("reconcile after podB's classification: moved %v past %v adopted %d, destination counts repaired %v",
			rep.Moved, rep.MovedPast, rep.Adopted, rep.DestRepaired)
	}
	s := snap(t, l)
	if s.InUse != 9 || project(s, Unclassified).InUse != 2 || project(s, "team-b").InUse != 3 || project(s, "team-a").InUse != 4 {
		t.Fatalf("after the move: %+v", s)
	}
	if d := destSnap(t, l, "db"); d.InUse != 9 || destProj(d, Unclassified).InUse != 2 || destProj(d, "team-b").InUse != 3 || destProj(d, "team-a").InUse != 4 {
		t.Fatalf("the destination pool after the move: %+v", d)
	}
	if rep := reconcile(); len(rep.Moved) != 0 || len(rep.Repaired) != 0 || rep.Orphans != 0 || rep.Held["team-b"] != 3 || rep.Held[Unclassified] != 2 {
		t.Fatalf("a second pass: moved %v repaired %v orphans %d held %v", rep.Moved, rep.Repaired, rep.Orphans, rep.Held)
	}
	// Released where they moved to: team-b's count, not Unclassified's.
	b.do("close")
	waitInUse(t, l, 6, map[string]int{"team-a": 4, Unclassified: 2, "team-b": 0})
	waitDest(t, l, "db", 6, map[string]int{"team-a": 4, Unclassified: 2, "team-b": 0})

	// team-a takes what the rule lets it, then podG becomes team-a's: its
	// 2 permits move past the rule, counted, reported, and team-a is
	// refused further; in_use does not move.
	if r := a.dial("tcp4", dst, pool); r.ok == pool || r.refused == 0 {
		t.Fatalf("team-a was not refused: %+v", r)
	}
	held := project(snap(t, l), "team-a").InUse
	before := snap(t, l).InUse
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}, Member{Project: "team-b", Cgroup: podB},
		Member{Project: "team-a", Cgroup: podG}))
	rep = reconcile()
	if rep.Moved["team-a"] != 2 || rep.MovedPast["team-a"] != 2 || len(rep.DestRepaired) != 0 {
		t.Fatalf("podG's move into team-a past the rule: moved %v past %v", rep.Moved, rep.MovedPast)
	}
	if in := rep.MovedPastIn; len(in) != 1 || !maps.Equal(in[ConnectionsPool], map[string]int{"team-a": 2}) {
		t.Fatalf("moved past the rule by pool %v; want the node's only (db's 100 are far from full)", in)
	}
	s = snap(t, l)
	if s.InUse != before || project(s, "team-a").InUse != held+2 || project(s, Unclassified).InUse != 0 || s.InUse > pool {
		t.Fatalf("after the move past the rule (team-a held %d, in_use %d): %+v", held, before, s)
	}
	if r := a.dial("tcp4", dst, 1); r.ok != 0 {
		t.Fatalf("team-a admitted past the rule after the move: %+v", r)
	}
	if d := destSnap(t, l, "db"); destProj(d, "team-a").InUse != held+2 || destProj(d, Unclassified).InUse != 0 {
		t.Fatalf("the destination pool after the move past the rule: %+v", d)
	}
	g.do("close")
	a.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0, Unclassified: 0, "team-b": 0})
	waitDest(t, l, "db", 0, map[string]int{"team-a": 0, Unclassified: 0, "team-b": 0})
}

// TestUnclassifiedMovedPastAborted: with AbortMovedPast, the sockets a pod
// connected before it was classified whose permits move to its project
// past the rule are aborted (their permits given back as they close), as if
// their connects had been refused: the project holds no more than the rule
// let it take, however many pods it starts. Those the rule has room for
// move and stay open.
func TestUnclassifiedMovedPastAborted(t *testing.T) {
	testutil.RequireRoot(t)
	for _, dry := range []bool{false, true} {
		t.Run(fmt.Sprintf("dry-run=%v", dry), func(t *testing.T) { movedPastAborted(t, dry) })
	}
}

// TestLapseAdmittedNotAborted: connections a pod opened while unclassified
// and while enforcement lapsed (no daemon), the first within the rule, the
// rest past it, are moved to the pod's project when the daemon is back and
// classifies it, past the rule, and kept: nothing refused them when they
// were made, so the daemon's return resets none of them. The same pod's connections made once the
// daemon is back, in the unclassified share, are still aborted when the move
// takes them past the rule (TestUnclassifiedMovedPastAborted).
func TestLapseAdmittedNotAborted(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const pool, lapse, long = 6, 2 * time.Second, time.Hour
	l, kp := kubeLayoutWith(t, root, pin, Options{PoolSize: pool, AbortMovedPast: true, LapseAfter: long})
	dirs := mkdirs(t, kp, "burstable/podA", "burstable/podA/ctr", "burstable/podB", "burstable/podB/ctr")
	podA, podACtr, podB, podBCtr := dirs[0], dirs[1], dirs[2], dirs[3]
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}))
	dst := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	a := startHelper(t, podACtr)
	a.dialOK("tcp4", dst, 2, "team-a")
	// The daemon goes: its last heartbeat with a short lapse, then none.
	if err := RenewHeartbeat(pin, lapse); err != nil {
		t.Fatal(err)
	}
	eventually(t, "lapsed", func() (bool, string) {
		lp, err := l.Lapse()
		return err == nil && lp.Lapsed, "not lapsed"
	})
	b := startHelper(t, podBCtr)
	b.dialOK("tcp4", dst, pool, "unclassified podB in a lapse")
	// The daemon is back: the heartbeat first, then podB is team-a's.
	if err := RenewHeartbeat(pin, long); err != nil {
		t.Fatal(err)
	}
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}, Member{Project: "team-a", Cgroup: podB}))
	rep := reconcileOK(t, l)
	if rep.Moved["team-a"] == 0 || rep.MovedPast["team-a"] == 0 || len(rep.Aborted) != 0 {
		t.Fatalf("podB's lapse-admitted connections moved into team-a: moved %v past %v aborted %v", rep.Moved, rep.MovedPast, rep.Aborted)
	}
	if r := b.dial("tcp4", dst, 1); r.refused != 1 {
		t.Fatalf("team-a admitted past the rule once the daemon was back: %+v", r)
	}
	if rep := reconcileOK(t, l); len(rep.Aborted) != 0 {
		t.Fatalf("a second pass aborted %v", rep.Aborted)
	}
	a.do("close")
	b.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0, Unclassified: 0})
}

// movedPastAborted is TestUnclassifiedMovedPastAborted, team-a in dry-run
// from its classification if dry: then nothing is aborted (it would not be
// refused either).
func movedPastAborted(t *testing.T, dry bool) {
	root, pin := newRoot(t), newPinDir(t)
	const pool = 12
	l, kp := kubeLayoutWith(t, root, pin, Options{PoolSize: pool, AbortMovedPast: true})
	dirs := mkdirs(t, kp, "burstable/podA", "burstable/podA/ctr", "burstable/podB", "burstable/podB/ctr", "podC", "podC/ctr",
		"podD", "podD/ctr")
	podA, podACtr, podB, podBCtr, podC, podCCtr, podD, podDCtr := dirs[0], dirs[1], dirs[2], dirs[3], dirs[4], dirs[5], dirs[6], dirs[7]
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}, Member{Project: "team-d", Cgroup: podD}))
	dst := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	reconcile := func() ReconcileReport { return reconcileOK(t, l) }
	// podC, unclassified, then classified into team-c, which has room:
	// moved, not aborted.
	c := startHelper(t, podCCtr)
	c.dialOK("tcp4", dst, 2, "unclassified podC")
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}, Member{Project: "team-d", Cgroup: podD},
		Member{Project: "team-c", Cgroup: podC}))
	if rep := reconcile(); rep.Moved["team-c"] != 2 || len(rep.MovedPast) != 0 || len(rep.Aborted) != 0 {
		t.Fatalf("podC's move into team-c, under its share: moved %v past %v aborted %v", rep.Moved, rep.MovedPast, rep.Aborted)
	}
	// podB connects while unclassified; team-a then takes what the rule
	// lets it (the pool to POOL - FLOOR, over its share), and team-d,
	// under its share, the last permit.
	b := startHelper(t, podBCtr)
	b.dialOK("tcp4", dst, 3, "unclassified podB")
	a := startHelper(t, podACtr)
	if r := a.dial("tcp4", dst, pool); r.refused == 0 {
		t.Fatalf("team-a was not refused: %+v", r)
	}
	d := startHelper(t, podDCtr)
	d.dialOK("tcp4", dst, 1, "team-d")
	held := project(snap(t, l), "team-a").InUse
	before := snap(t, l).InUse
	if before != pool {
		t.Fatalf("in_use %d, want the pool full", before)
	}
	// podB becomes team-a's. The first permit moved finds the pool full,
	// past team-a's limit (POOL - FLOOR) even without itself: aborted.
	// Its close leaves the pool at the limit, where each of the other two,
	// itself not counted, would be admitted: moved, reported past the rule
	// (team-a is refused from then on), and kept.
	if dry {
		if err := l.SetDryRunProjects(map[string]bool{"team-a": true}); err != nil {
			t.Fatal(err)
		}
	}
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}, Member{Project: "team-d", Cgroup: podD},
		Member{Project: "team-c", Cgroup: podC}, Member{Project: "team-a", Cgroup: podB}))
	rep := reconcile()
	aborted, want := rep.Aborted["team-a"], 1
	if dry {
		want = 0
	}
	if rep.Moved["team-a"] != 3 || aborted != want || rep.MovedPast["team-a"] < 1 {
		t.Fatalf("podB's move into team-a past the rule: moved %v past %v aborted %v", rep.Moved, rep.MovedPast, rep.Aborted)
	}
	// Aborted: given back as they close.
	waitInUse(t, l, before-aborted, map[string]int{"team-a": held + 3 - aborted, Unclassified: 0, "team-c": 2, "team-d": 1})
	if s := snap(t, l); !dry && s.InUse > pool-1 {
		t.Fatalf("after the pass in_use %d, past POOL - FLOOR", s.InUse)
	}
	if rep := reconcile(); len(rep.Moved) != 0 || len(rep.Aborted) != 0 || rep.Held["team-a"] != held+3-aborted {
		t.Fatalf("a second pass: moved %v aborted %v held %v", rep.Moved, rep.Aborted, rep.Held)
	}
	a.do("close")
	b.do("close")
	c.do("close")
	d.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0, Unclassified: 0, "team-c": 0, "team-d": 0})
}

// A move past a destination pool's rule, the node's pool far from full, is
// reported as one past the node's rule: team-a holds 2 of db's 4 and
// podB's 2, taken unclassified, move to it with db full.
func TestUnclassifiedMoveReportsDestPast(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, kp := kubeLayout(t, root, pin, 100, 0)
	dirs := mkdirs(t, kp, "burstable/podA", "burstable/podA/ctr", "burstable/podB", "burstable/podB/ctr")
	podA, podACtr, podB, podBCtr := dirs[0], dirs[1], dirs[2], dirs[3]
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}))
	dst := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	if err := l.SetDestPools([]DestPool{destPoolOf(t, "db", 4, 0, strings.Replace(dst, ":", "/32:", 1))}); err != nil {
		t.Fatal(err)
	}
	a := startHelper(t, podACtr)
	a.dialOK("tcp4", dst, 2, "team-a")
	b := startHelper(t, podBCtr)
	b.dialOK("tcp4", dst, 2, "unclassified podB")
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}, Member{Project: "team-a", Cgroup: podB}))
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Moved["team-a"] != 2 || rep.MovedPast["team-a"] != 2 || len(rep.DestRepaired) != 0 {
		t.Fatalf("podB's move into team-a, db full: moved %v past %v, repaired %v", rep.Moved, rep.MovedPast, rep.DestRepaired)
	}
	if in := rep.MovedPastIn; len(in) != 1 || !maps.Equal(in["db"], map[string]int{"team-a": 2}) {
		t.Fatalf("moved past the rule by pool %v; want db's only (the node's pool of 100 is far from full)", in)
	}
	if d := destSnap(t, l, "db"); d.InUse != 4 || destProj(d, "team-a").InUse != 4 || destProj(d, Unclassified).InUse != 0 {
		t.Fatalf("db after the move: %+v", d)
	}
	a.do("close")
	b.do("close")
	waitDest(t, l, "db", 0, map[string]int{"team-a": 0, Unclassified: 0})
}

// TestMemberNesting: what may nest below what, and what the walk then
// finds (bpf/lib/project.h).
func TestMemberNesting(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, kp := kubeLayout(t, root, pin, 8, 0)
	dirs := mkdirs(t, root, "team", "team/sub", "team/sub2", "kubepods/podX", "kubepods/podX/deeper")
	team, sub, sub2, podX, deeper := dirs[0], dirs[1], dirs[2], dirs[3], dirs[4]
	rep, err := l.SetMembers([]Member{
		{Project: Unclassified, Cgroup: kp},
		{Project: "p", Cgroup: team},
		{Project: NoProject, Cgroup: sub},     // below a project: never found, refused
		{Project: Unclassified, Cgroup: sub2}, // likewise
		{Project: NoProject, Cgroup: podX},    // below a weak member: fine
		{Project: "q", Cgroup: deeper},        // below no project: refused
	})
	if err != nil {
		t.Fatal(err)
	}
	refused := map[string]bool{}
	for _, r := range rep.Refused {
		refused[r.Member.Cgroup] = true
	}
	if len(rep.Refused) != 3 || !refused[sub] || !refused[sub2] || !refused[deeper] {
		t.Fatalf("refused %+v", rep.Refused)
	}
	ms, err := l.Members()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]string{}
	for _, m := range ms {
		names[m.Cgroup] = m.Project
	}
	if len(ms) != 3 || names[kp] != Unclassified || names[team] != "p" || names[podX] != NoProject {
		t.Fatalf("members %v", names)
	}
}

// TestLapse: with the heartbeat older than LapseAfter (the limiter closed,
// as a daemon SIGKILLed), a project past the pool is admitted and counted,
// its refusal reported as lapsed; a limiter opened again refuses at once.
func TestLapse(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	// Enforced phases run with a lapse of an hour, so that a loaded
	// machine's stalls cannot lapse them; the lapse of the 3s is
	// written as the daemon goes away (RenewHeartbeat, as a last tick).
	const lapse, long = 3 * time.Second, time.Hour
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 2, LapseAfter: long})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.SetEvents(100, false); err != nil {
		t.Fatal(err)
	}
	ln := sink(t, "tcp4", "127.0.0.1:0")
	dst := ln.Addr().String()
	a := startHelper(t, mkProject(t, root, "alpha"))
	if r := a.dial("tcp4", dst, 3); r.ok != 2 || r.refused != 1 {
		t.Fatalf("enforced: %+v", r)
	}
	if lp, err := l.Lapse(); err != nil || lp.Lapsed || lp.Never || lp.After != long {
		t.Fatalf("lapse %+v %v", lp, err)
	}
	// The daemon's last heartbeat, with lapse_after 3s; no Tick from here
	// on: the heartbeat ages.
	if err := RenewHeartbeat(pin, lapse); err != nil {
		t.Fatal(err)
	}
	l.Close()
	ro, err := OpenReadOnly(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	eventually(t, "lapsed", func() (bool, string) {
		lp, err := ro.Lapse()
		return err == nil && lp.Lapsed, "not lapsed"
	})
	a.dialOK("tcp4", dst, 3, "lapsed")
	s, err := ro.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	lp, _ := ro.Lapse()
	if s.InUse != 5 || project(s, "alpha").InUse != 5 || lp.Admitted != 3 || s.Events.LapsedAdmitted != 3 {
		t.Fatalf("lapsed admissions not counted: %+v %+v", s, lp)
	}
	// A daemon that comes back renews the heartbeat first thing
	// (RenewHeartbeat, before loading anything): refused again at once.
	if err := RenewHeartbeat(pin, long); err != nil {
		t.Fatal(err)
	}
	if lp, err := ro.Lapse(); err != nil || lp.Lapsed {
		t.Fatalf("renewed: %+v %v", lp, err)
	}
	if r := a.dial("tcp4", dst, 1); r.refused != 1 {
		t.Fatalf("after the heartbeat was renewed: %+v", r)
	}
	if err := RenewHeartbeat(t.TempDir(), long); err != nil {
		t.Errorf("no pins: %v", err)
	}
	// Its Open refuses too, and it reads the lapsed admissions' events
	// the ring buffer kept.
	l2, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 2, LapseAfter: long})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if r := a.dial("tcp4", dst, 1); r.refused != 1 {
		t.Fatalf("after the daemon came back: %+v", r)
	}
	ch := refusals(t, l2)
	lapsed := 0
	for range 5 {
		if e := nextRefusal(t, ch); e.Lapsed && e.Would {
			lapsed++
		}
	}
	if lapsed != 3 {
		t.Fatalf("%d lapsed events, want 3", lapsed)
	}
}

// TestPastByPool: the dump's records past the rule, broken down by the
// pools whose rule they were past (a record past both in each; a removed
// destination pool by its id), each (pool, project) one warning.
func TestPastByPool(t *testing.T) {
	in := map[destPair]int{}
	for _, r := range []limiterFsSockRecord{
		{Project: 1, Past: pastNode},
		{Project: 1, Past: pastNode | pastDest, Dest: 2},
		{Project: 2, Past: pastDest, Dest: 3},
		{Project: 2, Past: pastDest, Dest: 2},
		{Project: 3, Past: pastDest}, // names no pool: counted, not dropped
	} {
		countPast(in, r)
	}
	name := func(id uint64) string { return fmt.Sprintf("p%d", id) }
	got := pastByPool(in, map[uint32]string{2: "db"}, name)
	want := map[string]map[string]int{ConnectionsPool: {"p1": 2}, "db": {"p1": 1, "p2": 1}, "destination_pool_3": {"p2": 1},
		"destination_pool_0": {"p3": 1}}
	if !maps.EqualFunc(got, want, maps.Equal) {
		t.Fatalf("by pool %v, want %v", got, want)
	}
	if pastByPool(map[destPair]int{}, nil, name) != nil {
		t.Fatal("no record past the rule: want nil")
	}
	var logged bytes.Buffer
	l := &Limiter{log: slog.New(slog.NewTextHandler(&logged, nil))}
	l.warnPast("past", got)
	var lines []string
	for _, line := range strings.Split(strings.TrimSpace(logged.String()), "\n") {
		_, rest, _ := strings.Cut(line, "msg=")
		lines = append(lines, rest)
	}
	if w := []string{"past pool=connections project=p1 count=2", "past pool=db project=p1 count=1",
		"past pool=db project=p2 count=1", "past pool=destination_pool_0 project=p3 count=1",
		"past pool=destination_pool_3 project=p2 count=1"}; !slices.Equal(lines, w) {
		t.Fatalf("warnings\n%s\nwant\n%s", strings.Join(lines, "\n"), strings.Join(w, "\n"))
	}
}

// TestPassAddFound: a second read's adoptions and moves add to the
// first's, by project and by pool.
func TestPassAddFound(t *testing.T) {
	p := pass{adopted: 2, past: map[uint64]int{1: 1}, moved: map[uint64]int{2: 3}, movedPast: map[uint64]int{},
		pastIn: map[destPair]int{{0, 1}: 1}, movedPastIn: map[destPair]int{}}
	p.addFound(pass{adopted: 3, past: map[uint64]int{1: 1, 4: 2}, moved: map[uint64]int{2: 1}, movedPast: map[uint64]int{2: 1},
		pastIn: map[destPair]int{{0, 1}: 1, {5, 4}: 2}, movedPastIn: map[destPair]int{{5, 2}: 1}})
	if p.adopted != 5 || !maps.Equal(p.past, map[uint64]int{1: 2, 4: 2}) || !maps.Equal(p.moved, map[uint64]int{2: 4}) ||
		!maps.Equal(p.movedPast, map[uint64]int{2: 1}) || !maps.Equal(p.pastIn, map[destPair]int{{0, 1}: 2, {5, 4}: 2}) ||
		!maps.Equal(p.movedPastIn, map[destPair]int{{5, 2}: 1}) {
		t.Fatalf("after the second read: %+v", p)
	}
}

// TestReportAddRepairs: a migration's report is its second pass's with the
// first's repairs added (addRepairs), by project and by pool, and what the
// second says of the maps and sockets kept.
func TestReportAddRepairs(t *testing.T) {
	r := ReconcileReport{Adopted: 1, AdoptedPast: map[string]int{"a": 1}, Held: map[string]int{"a": 7},
		Unadopted: map[string]int{"b": 2}, AdoptedPastIn: map[string]map[string]int{"db": {"a": 1}}}
	r.addRepairs(ReconcileReport{Adopted: 6, Orphans: 2, StaleListeners: 1, ExemptRepaired: -1,
		AdoptedPast: map[string]int{"a": 2, "c": 1}, Moved: map[string]int{"b": 3}, MovedPast: map[string]int{"b": 1},
		Repaired: map[string]int{"c": -4}, Held: map[string]int{"a": 3}, Unadopted: map[string]int{"b": 9},
		AdoptedPastIn: map[string]map[string]int{"db": {"a": 2}, ConnectionsPool: {"c": 1}},
		MovedPastIn:   map[string]map[string]int{"db": {"b": 1}}, DestRepaired: map[string]map[string]int{"db": {"c": 1}}})
	want := ReconcileReport{Adopted: 7, Orphans: 2, StaleListeners: 1, ExemptRepaired: -1,
		AdoptedPast: map[string]int{"a": 3, "c": 1}, Moved: map[string]int{"b": 3}, MovedPast: map[string]int{"b": 1},
		Repaired: map[string]int{"c": -4}, Held: map[string]int{"a": 7}, Unadopted: map[string]int{"b": 2},
		AdoptedPastIn: map[string]map[string]int{"db": {"a": 3}, ConnectionsPool: {"c": 1}},
		MovedPastIn:   map[string]map[string]int{"db": {"b": 1}}, DestRepaired: map[string]map[string]int{"db": {"c": 1}}}
	if !reflect.DeepEqual(r, want) {
		t.Fatalf("merged %+v\nwant   %+v", r, want)
	}
	var empty ReconcileReport
	empty.addRepairs(ReconcileReport{})
	if !reflect.DeepEqual(empty, ReconcileReport{}) {
		t.Fatalf("two empty reports merged into %+v", empty)
	}
}

// TestAdoptedPastRule: sockets adopted past the rule are counted and
// reported per project, not hidden.
func TestAdoptedPastRule(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ln := sink(t, "tcp4", "127.0.0.1:0")
	// Connections made while the cgroup is in no project: adopted when it
	// becomes one.
	dir := filepath.Join(root, "late")
	mkdirs(t, root, "late")
	h := startHelper(t, dir)
	if r := h.dial("tcp4", ln.Addr().String(), 5); r.ok != 5 {
		t.Fatalf("dials %+v", r)
	}
	setMembers(t, l, []Member{{Project: "late", Cgroup: dir}})
	rep, err := l.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	s := snap(t, l)
	if rep.Adopted != 5 || rep.AdoptedPast["late"] != 3 || s.InUse != 5 || s.Events.AdoptedPast != 3 {
		t.Fatalf("adopted %d past %v, in_use %d, events %+v", rep.Adopted, rep.AdoptedPast, s.InUse, s.Events)
	}
	if in := rep.AdoptedPastIn; len(in) != 1 || !maps.Equal(in[ConnectionsPool], map[string]int{"late": 3}) {
		t.Fatalf("past the rule by pool %v; want the node's, late 3", in)
	}
}

// TestUnclassifiedListener: a listener opened while its pod was
// unclassified counts its connections for (unclassified); once the pod is
// classified the next reconcile counts it under the pod's project (and
// moves its accepted connections' permits there), and a pod classified as
// no project's listener is uncounted (and its held connections' permits
// released, as a gone socket's).
func TestUnclassifiedListener(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, kp := kubeLayout(t, root, pin, 12, 0)
	dirs := mkdirs(t, kp, "burstable/podB", "burstable/podB/ctr", "besteffort/podS", "besteffort/podS/ctr")
	podB, podBCtr, podS, podSCtr := dirs[0], dirs[1], dirs[2], dirs[3]
	setMembers(t, l, podRoots(kp))
	b, s := startHelper(t, podBCtr), startHelper(t, podSCtr)
	addrB, addrS := listenAddr(t, b.do("listen 127.0.0.1:0")), listenAddr(t, s.do("listen 127.0.0.1:0"))
	dial := func(addr string) {
		t.Helper()
		c, err := dialOutside(addr)
		if err != nil {
			t.Fatalf("dial %s: %v", addr, err)
		}
		t.Cleanup(func() { c.Close() })
	}
	dial(addrB)
	dial(addrS)
	waitInUse(t, l, 2, map[string]int{Unclassified: 2})

	setMembers(t, l, append(podRoots(kp), Member{Project: "team-b", Cgroup: podB}, Member{Project: NoProject, Cgroup: podS}))
	if _, err := l.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	// podS's first connection is in no project now: the reconcile's dump
	// does not list it, and its permit is released as a gone socket's.
	// podB's moves to team-b (an accepted connection's permit moves as a
	// connect's does, TestUnclassifiedPermitsMoveAtReconcile).
	dial(addrB)
	dial(addrS)
	waitInUse(t, l, 2, map[string]int{Unclassified: 0, "team-b": 2})
}

// TestHostNetworkPodsCountOnceClassified: by default (no LimitHostNetwork)
// a pod in the host's network namespace is never refused while it is
// unclassified: with the pool full, its connects go through, counted for
// (unclassified) past the rule, and the SYNs to its listener go through,
// uncounted, while the daemon runs and while none does. A pod with a
// network namespace of its own is refused as before. Once classified, a
// system namespace's pod's permits are released, and a tenant's move to its
// project, where a move past the rule aborts them as any unclassified
// connect's.
func TestHostNetworkPodsCountOnceClassified(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const pool = 4
	l, kp := kubeLayoutOpts(t, root, pin, Options{PoolSize: pool})
	dirs := mkdirs(t, kp, "burstable/podA", "burstable/podA/ctr", "burstable/podS", "burstable/podS/ctr",
		"besteffort/podT", "besteffort/podT/ctr", "besteffort/podO", "besteffort/podO/ctr")
	podA, podACtr, podS, podSCtr, podT, podTCtr := dirs[0], dirs[1], dirs[2], dirs[3], dirs[4], dirs[5]
	ownCtr := dirs[7]
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}))
	dst := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	a := startHelper(t, podACtr)
	if r := a.dial("tcp4", dst, pool+1); r.ok != pool || r.refused != 1 {
		t.Fatalf("team-a: %+v, want the pool and one refused", r)
	}
	// A new system pod (the API server, say) with the pool full.
	sp := startHelper(t, podSCtr)
	sp.dialOK("tcp4", dst, 3, "an unclassified pod of the host's network namespace")
	addrS := listenAddr(t, sp.do("listen 127.0.0.1:0"))
	for range 3 {
		c, err := dialOutside(addrS)
		if err != nil {
			t.Fatalf("a SYN to its listener, the pool full: %v", err)
		}
		t.Cleanup(func() { c.Close() })
	}
	waitInUse(t, l, pool+3, map[string]int{"team-a": pool, Unclassified: 3})
	// Passes keep them while the pod is unclassified (a gone socket's
	// permit goes at the second read).
	for range 2 {
		if rep := reconcileOK(t, l); rep.Adopted != 0 || len(rep.Moved) != 0 {
			t.Fatalf("a pass before the pod is classified: adopted %d, moved %v", rep.Adopted, rep.Moved)
		}
	}
	waitInUse(t, l, pool+3, map[string]int{"team-a": pool, Unclassified: 3})
	// A pod with a network namespace of its own is under the rule as
	// before: nothing past the full pool (it dials its own loopback).
	own := startHelperNS(t, ownCtr, true)
	addrOwn := listenAddr(t, own.do("listen 127.0.0.1:0"))
	if r := own.dial("tcp4", addrOwn, 1); r.refused != 1 {
		t.Fatalf("an unclassified pod of its own network namespace, the pool full: %+v, want refused", r)
	}
	own.do("close")
	// And while no daemon runs (the limiter closed, the programs pinned).
	l.Close()
	tp := startHelper(t, podTCtr)
	tp.dialOK("tcp4", dst, 2, "an unclassified pod of the host's network namespace, no daemon")
	o := rootOptions(t, root, Options{PinDir: pin, PoolSize: pool, AbortMovedPast: true})
	o.MaxDepth = 0 // kubeLayoutOpts's
	l, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	// podS is kube-system's, podT team-t's: podS's three are released,
	// podT's two move to team-t, past the rule (the pool is full), and are
	// aborted.
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}, Member{Project: NoProject, Cgroup: podS},
		Member{Project: "team-t", Cgroup: podT}))
	rep := reconcileOK(t, l)
	if rep.Moved["team-t"] != 2 || rep.Aborted["team-t"] == 0 || rep.Adopted != 0 {
		t.Fatalf("moved %v, aborted %v, adopted %d; want podT's 2 moved into team-t and aborted", rep.Moved, rep.Aborted, rep.Adopted)
	}
	reconcileOK(t, l) // a gone socket's permit goes at the second read
	reconcileOK(t, l)
	waitInUse(t, l, pool+2-rep.Aborted["team-t"], map[string]int{"team-a": pool, "team-t": 2 - rep.Aborted["team-t"], Unclassified: 0})
	if r := tp.dial("tcp4", dst, 1); r.refused != 1 {
		t.Fatalf("team-t once classified, past its share: %+v, want refused", r)
	}
	a.do("close")
	sp.do("close")
	tp.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0, "team-t": 0, Unclassified: 0})
}

// TestHostNetworkPodPastDestPool: a destination pool does not refuse an
// unclassified pod of the host's network namespace either (its connect
// takes the pool's permit past the rule), while it refuses the project
// that filled it, and a pod of its own namespace would be refused there as
// in the node's pool (TestHostNetworkPodsCountOnceClassified).
func TestHostNetworkPodPastDestPool(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, kp := kubeLayoutOpts(t, root, pin, Options{PoolSize: 16})
	dirs := mkdirs(t, kp, "burstable/podA", "burstable/podA/ctr", "burstable/podS", "burstable/podS/ctr")
	podA, podACtr, podSCtr := dirs[0], dirs[1], dirs[3]
	setMembers(t, l, append(podRoots(kp), Member{Project: "team-a", Cgroup: podA}))
	dst := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	ds, err := destination.ParseAll([]string{"127.0.0.1/32:" + dst[strings.LastIndex(dst, ":")+1:]})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.SetDestPools([]DestPool{{Name: "db", Size: 2, Destinations: ds}}); err != nil {
		t.Fatal(err)
	}
	a := startHelper(t, podACtr)
	if r := a.dial("tcp4", dst, 3); r.ok != 2 || r.refused != 1 {
		t.Fatalf("team-a: %+v, want the destination pool's 2 and one refused", r)
	}
	sp := startHelper(t, podSCtr)
	sp.dialOK("tcp4", dst, 2, "an unclassified pod of the host's network namespace, the destination pool full")
	a.do("close")
	sp.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0, Unclassified: 0})
	s := snap(t, l)
	for _, d := range s.Dests {
		if d.InUse != 0 {
			t.Errorf("destination pool %s holds %d once every connection closed", d.Name, d.InUse)
		}
	}
}

// reconcileOK is a Reconcile pass of l that must not fail.
func reconcileOK(t *testing.T, l *Limiter) ReconcileReport {
	t.Helper()
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// The programs' abort needs bpf_sock_destroy: this kernel has it (a
// kernel without it would log that nothing is aborted, and load).
func TestKernelHasSockDestroy(t *testing.T) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	var major, minor int
	fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &major, &minor)
	if major < 6 || major == 6 && minor < 5 {
		t.Skipf("Linux %d.%d: bpf_sock_destroy came with 6.5", major, minor)
	}
	if !kernelHasFunc(btf.NewCache(), "bpf_sock_destroy") {
		t.Fatal("bpf_sock_destroy not found in the kernel's BTF (Linux 6.5 has it)")
	}
	if kernelHasFunc(btf.NewCache(), "fairshare_no_such_function") {
		t.Fatal("a function that is not there was found")
	}
}
