// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/loader/limits"
	"github.com/fairshare-dev/fairshare/pools"
)

// MinKernel is the oldest Linux whose BPF has everything the programs use
// (bpf_rdonly_cast, sockops with bpf_get_netns_cookie, bpf_set_retval,
// sk_lookup, tp_btf and iter/tcp). Developed and tested on 6.18.
const MinKernel = "6.2"

// DefaultPinDir is where the maps and links are pinned when Options.PinDir
// is empty.
const DefaultPinDir = "/sys/fs/bpf/fairshare"

// heldCapacity sizes the preallocated map of held permits (fs_held) for a
// pool: room for twice the pool (adopted connections can take in_use past
// POOL), as a power of two, at least 1024. A smaller table is a faster one
// (its cost is its cache footprint), hence no fixed maximum.
func heldCapacity(pool uint32) uint32 {
	c := uint32(1024)
	for c < 2*pool {
		c <<= 1
	}
	return c
}

// forgetAfter is how long an idle, empty project of a removed cgroup keeps
// its map entry (and counters) before Tick deletes it.
const forgetAfter = time.Minute

// pinLayout is what the pinned maps' bytes mean, written to
// fs_settings.layout at every start: a start on pins of another layout
// migrates them (migrate.go), and OpenReadOnly refuses them. Raise it with
// any change of what a pinned map's values mean that leaves their sizes and
// flags as they were (a field's meaning, a packing: the programs and the
// loader would read the old bytes the new way, silently); a change of size
// or flags is caught without it.
//
//	1: destination pools' project entries pack held and admitted in one word
//	2: fs_settings holds the destination filter's quick words where it held
//	   copies of the netns cookie, base level and depth
//	3: the quick words hold ports and first bytes in lanes, not hashed bits
//	4: the second quick word holds IPv4 /16s in three lanes, IPv6 first
//	   bytes in two (fs_dfilter's IPv4 bits, per /16, changed size)
//	5: the first quick word's lanes may hold a host's fingerprint (its
//	   address and port, dest_fp) in place of its port: programs of
//	   layout 4 reading it would stop every connect to such a host
//	6: held permits may be of kinds KIND_OUT_LAX (7) and KIND_OUT_HOST
//	   (8), past the exempt ones: programs of layout 5 took them for
//	   exempt permits (KIND_IS_EXEMPT was k >= 4) and gave them back to
//	   the exempt budget, never to the pool
const pinLayout = 6

// addedMaps are pinned maps a pin directory of an earlier version lacks and
// that the programs may find empty beside the others (they hold nothing the
// other maps must agree with): Open creates them in a used directory. The
// rates (bpf/lib/rate.h) are written again at the next Tick; the refusal
// events' settings (bpf/lib/events.h) at start and the dry-run projects
// every tick. The members' generation (bpf/lib/project.h) starts at 0 with
// the memo it guards, which is not pinned: new programs bring an empty one.
var addedMaps = map[string]bool{
	"fs_rates": true, "fs_rate_node": true, "fs_rate_stats": true,
	"fs_events": true, "fs_ev_config": true, "fs_dryrun": true, "fs_ev_projects": true, "fs_ev_stats": true,
	"fs_member_gen": true, "fs_lapses": true,
	"fs_dests": true, "fs_dpool_conf": true, "fs_dpool_state": true, "fs_dpool_proj": true, "fs_dnets": true,
	"fs_caps": true,
}

// Sentinel errors callers may branch on.
var (
	// ErrNoCgroup2 means no cgroup2 file system is mounted.
	ErrNoCgroup2 = cgroup.ErrNoCgroup2
	// ErrNotCgroup2 means the projects root is not a directory on cgroup2.
	ErrNotCgroup2 = cgroup.ErrNotCgroup2
	// ErrPinnedMismatch means the pinned maps were of another layout when
	// the programs were loaded against them although Open had found them
	// reusable a moment before: another process changed the pins
	// meanwhile (pins of another layout found at the start are migrated,
	// doc.go "Upgrades"); each error wrapping it names the remedy.
	ErrPinnedMismatch = errors.New("the pinned maps do not match this version's programs")
	// ErrInvalidOptions reports options Open cannot work with.
	ErrInvalidOptions = errors.New("invalid loader options")
	// ErrClosed is returned by methods of a closed Limiter.
	ErrClosed = errors.New("limiter is closed")
	// ErrNetnsFull is returned by AttachNetns with Options.MaxNetns
	// namespaces attached.
	ErrNetnsFull = errors.New("too many network namespaces attached")
	// ErrKernelTooOld means the kernel lacks a BPF helper, kfunc or hook
	// the programs use: fairshare needs Linux MinKernel or later with BTF.
	// It wraps ebpf.ErrNotSupported.
	ErrKernelTooOld = fmt.Errorf("the kernel is too old for fairshare's BPF programs (Linux %s or later with BTF is needed): %w",
		MinKernel, ebpf.ErrNotSupported)
	// ErrBadExempt reports an exempt set SetExempt (or Open) cannot use: a
	// path that is missing, not a cgroup below the projects root, or more
	// paths than limits.ExemptCap.
	ErrBadExempt = errors.New("invalid exempt set")
)

// Defaults and bounds of the membership options.
const (
	DefaultMaxProjects = 16384
	DefaultMaxMembers  = 65536
	DefaultMaxDepth    = 8
	// DefaultMaxNetns bounds the namespaces AttachNetns attaches
	// (limits.DefaultMaxNetns).
	DefaultMaxNetns = limits.DefaultMaxNetns
	// MaxDepth bounds Options.MaxDepth (MAX_DEPTH in bpf/lib/project.h).
	MaxDepth = 16
	// MaxListeners is the entries of the listener tables (fs_listen_socks,
	// fs_listeners in bpf/lib/maps.h), which no option sizes: the project
	// listening sockets the programs count at most. One more is left
	// uncounted and counted as Events.MapFull.
	MaxListeners = 16384
)

// Options configures Open.
type Options struct {
	// MaxProjects sizes the projects table: ids 1..MaxProjects-1; 0 means
	// DefaultMaxProjects. A pinned table keeps its size, and the tables of
	// an entry per project (rates, dry-run, refused projects) take it.
	MaxProjects uint32
	// MaxMembers sizes the membership table (registered cgroups); 0 means
	// DefaultMaxMembers. A pinned table keeps its size.
	MaxMembers uint32
	// BaseLevel is the cgroup level where the programs start looking for a
	// socket's registered cgroup (1: the children of the cgroup2 root; 0
	// means 1), and MaxDepth the number of levels they look at from there
	// (0 means DefaultMaxDepth, at most MaxDepth): a registration must be
	// at a level in BaseLevel..BaseLevel+MaxDepth-1 (SetMembers refuses the
	// others), and each level above it costs every connection of its
	// project one map lookup.
	BaseLevel, MaxDepth uint32
	// MaxNetns is the most network namespaces AttachNetns attaches besides
	// the daemon's own; 0 means DefaultMaxNetns.
	MaxNetns int
	// PinDir is the bpffs directory for maps and links; default DefaultPinDir.
	PinDir string
	// PinLock is the caller's open file of PinDir holding an exclusive
	// flock on it (the daemon's, held for its life), or nil. Open changes
	// the layout of the pins (a migration, doc.go "Upgrades") only under
	// that lock: with this one, or with one it takes itself; while another
	// process holds it, Open fails with ErrPinsLocked instead.
	PinLock *os.File
	// PoolSize is POOL, the node-wide number of connection permits, in
	// 1..limits.MaxPoolSize (0 only below a PoolCapacity: admit nobody).
	PoolSize uint32
	// PoolCapacity is the largest POOL SetPool may set later: it sizes the
	// permit tables, so a pool that starts small and grows (a fleet pool,
	// opened at its safe slice and raised to its allotment) need not
	// start at its largest size. 0 means PoolSize; at least PoolSize.
	PoolCapacity uint32
	// Floor is FLOOR; 0 means pools.DefaultFloor(PoolSize).
	Floor uint32
	// Logger receives what Open and Reconcile did; nil discards.
	Logger *slog.Logger

	// Window is the active window; 0 means one second.
	Window time.Duration
	// ReservationTTL is how old a reservation (an inbound handshake's
	// permit) must be before Tick gives it back if its request socket is
	// gone, within limits.MinReservationTTL..MaxReservationTTL; 0 means
	// limits.DefaultReservationTTL.
	ReservationTTL time.Duration
	// Clock stamps Snapshot.LastSeen; nil is the system clock.
	Clock clock.Clock
	// Monotonic reads the clock the programs stamp with (CLOCK_MONOTONIC,
	// bpf_ktime_get_ns), as time since boot; nil reads the kernel's. Tick
	// measures the active window and the reservation TTL with it, so a test
	// can move it on instead of sleeping.
	Monotonic func() time.Duration
	// eventWindow is the refusal events' window (a second; tests make it
	// shorter to see many windows begin).
	eventWindow time.Duration

	// Exempt lists cgroups (absolute, or relative to the cgroup2 mount)
	// whose sockets take exempt permits instead of pool permits: they are
	// not refused by the rule and not counted in in_use, up to ExemptMax at
	// a time node-wide. Beyond that they are treated like any other socket
	// of their project. At most limits.ExemptCap. See SetExempt.
	Exempt []string
	// ExemptMax is the exempt budget; 0 means FLOOR.
	ExemptMax uint32
	// LapseAfter is how old the daemon's heartbeat (renewed by Open and
	// every Tick) may grow before the programs stop refusing (they keep
	// counting; see Lapse); 0 never lapses.
	LapseAfter time.Duration
	// AbortMovedPast aborts the sockets whose permits a reconcile pass
	// moves from Unclassified to their pod's project past its rule
	// (ReconcileReport.Aborted): as if their connects, made before the pod
	// was classified, had been refused then. Off, they are counted past the
	// rule and the project is refused until it is back under its limit.
	AbortMovedPast bool
	// LimitHostNetwork puts the sockets of the host's network namespace
	// (the daemon's own) under a weak member's rule too. Off, a pod there
	// (hostNetwork: kube-proxy, a CNI agent, the control plane's static
	// pods) is never refused while unclassified, nor while no daemon runs:
	// its connects count for Unclassified, past the rule if need be, and
	// its listeners only once it is classified. Its classification then
	// releases those permits (a system pod's) or moves them to its project
	// (a tenant's), where AbortMovedPast aborts those past the rule.
	LimitHostNetwork bool

	// MaxDestPools sizes the destination pool tables (dest.go): pools
	// configured at once, removed ones still holding permits included; 0
	// means DefaultMaxDestPools, at most MaxDestPools. Their per-project
	// table takes 32 bytes per pool and project (MaxProjects). A pinned
	// table keeps its size.
	MaxDestPools uint32
	// NoDestPools sizes the destination pool tables for none (a node whose
	// configuration has no destination pool): one entry each instead of
	// MaxDestPools x MaxProjects x 32 bytes (8 MiB at the defaults).
	// SetDestPools then refuses any pool (ErrDestPoolsFull, saying so)
	// until a start without NoDestPools, which grows the tables if they
	// were pinned so: tables for no pool hold nothing to keep.
	NoDestPools bool
	// DestPools are the destination pools Open applies (SetDestPools).
	DestPools []DestPool
	// Events, if not nil, are the refusal events' bound and the pool's
	// dry-run, which Open writes (SetEvents) before the programs are
	// attached: they admit what the configuration says from their first
	// connect, and nothing the start could still fail on comes after
	// Open's heartbeat. nil leaves them as the pins hold them (a
	// migration's: as the old pins held them).
	Events *EventSettings
}

// Limiter is a loaded, attached connection limiter. Its maps and links are
// pinned, so closing it (or killing the process) leaves enforcement running.
type Limiter struct {
	root     string // the cgroup the cgroup programs attach to: the cgroup2 mount
	mnt      cgroup.Mount
	base     uint32 // Options.BaseLevel
	depth    uint32 // Options.MaxDepth
	maxProj  uint32 // Options.MaxProjects
	maxMemb  uint32 // Options.MaxMembers
	maxNetns int    // Options.MaxNetns
	pinDir   string
	log      *slog.Logger
	window   time.Duration
	evWindow time.Duration // Options.eventWindow, 0: a second
	ttl      time.Duration
	lapse    time.Duration // Options.LapseAfter
	// abortPast: Options.AbortMovedPast
	abortPast bool
	// hostLax: not Options.LimitHostNetwork
	hostLax bool
	// btf caches the kernel's BTF for Open's check and load (nil: the
	// load decodes its own).
	btf      *btf.Cache
	clock    clock.Clock
	mono     func() uint64 // CLOCK_MONOTONIC in ns (Options.Monotonic)
	objs     limiterObjects
	links    []link.Link
	netns    uint64 // the cookie of the daemon's own network namespace
	netnsIno uint64 // and its inode
	reused   bool
	pinLock  *os.File   // Options.PinLock
	unlock   func()     // releases the lock taken for a migration; nil: none taken
	mig      *migration // the pins of another layout Open replaces; nil: none
	// prior is what Open's setUp overwrote of reused pins' configuration,
	// put back if the start fails (prior.go); nil: nothing to put back.
	prior *priorConfig
	// migNetns are, during a migration, the network namespaces of the
	// host's processes other than the daemon's, by inode (otherNetns):
	// the migration's passes count their connections too.
	migNetns map[uint64]dumpTarget
	held     uint32     // entries of fs_slots (a power of two): the largest POOL they hold
	outgrown uint32     // the pinned fs_slots' entries when fewer than the capacity (spec); 0: none
	adjustM  sync.Mutex // serialises BPF_PROG_RUN of fs_adjust (one context buffer)
	// passM serialises reconcile passes: a repair needs the same finding
	// in two consecutive reads, and two passes at once would each make it.
	passM sync.Mutex

	mu        sync.Mutex // guards the fields below
	size      uint32
	floor     uint32
	capacity  uint32            // Options.PoolCapacity: what the permit tables are sized for
	exempt    []string          // the exempt set, absolute paths, sorted
	exemptIDs map[uint64]string // its cgroup ids
	exemptMax uint32            // its budget
	// exemptWant is the set as given (SetExempt's paths), exemptMissing
	// the absolute paths of it where no cgroup exists yet (sorted).
	exemptWant, exemptMissing []string
	// adoptedPast counts the sockets reconcile passes adopted past the
	// rule (ReconcileReport.AdoptedPast), since Open.
	adoptedPast uint64
	// started is what Open's own reconcile found (StartReport).
	started ReconcileReport
	// rates are the projects' rates of new connections (SetRates), by
	// project name; a project without one is unbounded.
	rates  map[string]Rates
	closed bool
	// nameMap is the projects' names by id for the readers that do not
	// hold mu (the event reader): what allocIDs and freeLocked wrote.
	namesMu  sync.Mutex
	nameMap  map[uint64]string
	readOnly bool             // OpenReadOnly's: names are read from the pins
	memb     kernelMembership // what SetMembers wrote (members.go)
	// genOwed: fs_members changed and fs_member_gen is not bumped yet
	// (membersChanged); genFault fails the bump (tests).
	genOwed  bool
	genFault func() error
	nets     map[uint64]*netnsLink // per-netns sk_lookup instances by cookie (netns.go)
	maxDest  uint32                // Options.MaxDestPools, or the pinned tables'
	noDest   bool                  // Options.NoDestPools
	dests    map[string]*destPool  // destination pools by name, removed ones still holding permits included (dest.go)
	caps     map[uint32]*capRow    // the fleet caps by pool row (caps.go); nil: none
	// What the heartbeat carries of the fleet pools (fleetsafe.go): their
	// leases' ends by pool ("" the connections pool), the fleet's
	// lease_ttl, and the connections pool's safe slice plus one (0: not a
	// fleet pool).
	fleetEnd map[string]time.Time
	fleetTTL time.Duration
	nodeSafe uint32
	// fleetFlag: this limiter set capsFleet (SetFleetSafe), which Open
	// clears: the programs read nodeSafe only once it is set.
	fleetFlag bool
	// projHigh is the highest project id given since Open (or named, or
	// counting, in the pins at Open): the ids above it have never been
	// used, so their entries are zero and readProjects reads up to it.
	projHigh uint32
	// The sk_lookup program alone and the maps it shares, made once;
	// attachM serialises AttachNetns and guards them after Open.
	attachM     sync.Mutex
	lookupCache *ebpf.CollectionSpec
	lookupReps  map[string]*ebpf.Map
}

// ensureBPFFS makes sure dir can hold pins: /sys/fs/bpf is mounted if it is
// not yet, and dir is created.
func ensureBPFFS(dir string) error {
	parent := filepath.Dir(dir)
	var st unix.Statfs_t
	if err := unix.Statfs(parent, &st); err != nil || st.Type != unix.BPF_FS_MAGIC {
		if parent != "/sys/fs/bpf" && !strings.HasPrefix(parent, "/sys/fs/bpf/") {
			return fmt.Errorf("pin directory %s is not on a bpf file system (mount -t bpf bpf %s)", dir, parent)
		}
		if err := unix.Statfs("/sys/fs/bpf", &st); err != nil || st.Type != unix.BPF_FS_MAGIC {
			if err := unix.Mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700"); err != nil {
				return fmt.Errorf("mounting bpffs at /sys/fs/bpf (needs CAP_SYS_ADMIN): %w", err)
			}
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating pin directory: %w", err)
	}
	return nil
}

// netnsCookie is the cookie of the calling thread's network namespace, the
// value the kernel stores in struct net and sk_lookup keys use.
func netnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("opening a socket for the netns cookie: %w", err)
	}
	defer unix.Close(fd)
	v, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("reading SO_NETNS_COOKIE (kernel 5.14+): %w", err)
	}
	return v, nil
}

// normalize checks the options Open and Check share and fills in their
// defaults.
func (o Options) normalize() (Options, error) {
	if o.PoolCapacity == 0 {
		o.PoolCapacity = o.PoolSize
	}
	if o.PoolCapacity == 0 || o.PoolCapacity > limits.MaxPoolSize || o.PoolSize > o.PoolCapacity {
		return o, fmt.Errorf("pool size %d, capacity %d: not in 1..%d, or the size above the capacity: %w",
			o.PoolSize, o.PoolCapacity, limits.MaxPoolSize, ErrInvalidOptions)
	}
	if o.PoolSize == 0 {
		o.Floor = 0
	} else {
		o.Floor = uint32(pools.EffectiveFloor(int(o.PoolSize), int(o.Floor)))
	}
	if o.Floor > o.PoolSize {
		return o, fmt.Errorf("floor %d above pool %d: %w", o.Floor, o.PoolSize, ErrInvalidOptions)
	}
	if o.MaxProjects == 0 {
		o.MaxProjects = DefaultMaxProjects
	}
	if o.MaxMembers == 0 {
		o.MaxMembers = DefaultMaxMembers
	}
	if o.MaxProjects < 2 || o.MaxProjects > 1<<20 || o.MaxMembers > 1<<22 {
		return o, fmt.Errorf("max projects %d (2..%d), max members %d (..%d): %w", o.MaxProjects, 1<<20, o.MaxMembers, 1<<22, ErrInvalidOptions)
	}
	if o.BaseLevel == 0 {
		o.BaseLevel = 1
	}
	if o.MaxDepth == 0 {
		o.MaxDepth = DefaultMaxDepth
	}
	if o.MaxNetns <= 0 {
		o.MaxNetns = DefaultMaxNetns
	}
	if o.NoDestPools {
		o.MaxDestPools = 0
	} else if o.MaxDestPools == 0 {
		o.MaxDestPools = DefaultMaxDestPools
	}
	if o.MaxDestPools > MaxDestPools {
		return o, fmt.Errorf("max destination pools %d, at most %d: %w", o.MaxDestPools, MaxDestPools, ErrInvalidOptions)
	}
	if o.MaxDepth > MaxDepth || o.BaseLevel > 255 {
		return o, fmt.Errorf("max depth %d (at most %d), base level %d: %w", o.MaxDepth, MaxDepth, o.BaseLevel, ErrInvalidOptions)
	}
	if o.PinDir == "" {
		o.PinDir = DefaultPinDir
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Window <= 0 {
		o.Window = pools.DefaultWindow
	}
	if o.LapseAfter < 0 {
		return o, fmt.Errorf("lapse after %v, negative: %w", o.LapseAfter, ErrInvalidOptions)
	}
	if o.ReservationTTL == 0 {
		o.ReservationTTL = limits.DefaultReservationTTL
	}
	if o.ReservationTTL < limits.MinReservationTTL || o.ReservationTTL > limits.MaxReservationTTL {
		return o, fmt.Errorf("reservation TTL %s not in %s..%s: %w", o.ReservationTTL,
			limits.MinReservationTTL, limits.MaxReservationTTL, ErrInvalidOptions)
	}
	o.Clock = clock.Or(o.Clock)
	return o, nil
}

// needRoot says why the process cannot load BPF programs, if it cannot.
func needRoot() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("loading BPF programs needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN): %w", os.ErrPermission)
	}
	return nil
}

// Open loads the programs (or reuses the ones pinned in PinDir by an earlier
// run), attaches them to the cgroup2 root and the current network namespace
// (and again to the namespaces an earlier run attached with AttachNetns),
// and reconciles the maps with the kernel's socket table once. The
// membership is what the pins hold (none at first): SetMembers sets it.
func Open(opts Options) (*Limiter, error) {
	opts, err := opts.normalize()
	if err != nil {
		return nil, err
	}
	mono := monoNow
	if f := opts.Monotonic; f != nil {
		mono = func() uint64 { return uint64(f()) }
	}
	if err := needRoot(); err != nil {
		return nil, err
	}

	mnt, err := cgroup.FindMount()
	if err != nil {
		return nil, err
	}
	root := mnt.Point
	if err := ensureBPFFS(opts.PinDir); err != nil {
		return nil, err
	}
	cookie, err := netnsCookie()
	if err != nil {
		return nil, err
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("raising RLIMIT_MEMLOCK: %w", err)
	}

	l := &Limiter{
		root: root, mnt: mnt, base: opts.BaseLevel, depth: opts.MaxDepth,
		maxProj: opts.MaxProjects, maxMemb: opts.MaxMembers, maxNetns: opts.MaxNetns, pinDir: opts.PinDir,
		log: opts.Logger, window: opts.Window, evWindow: opts.eventWindow, ttl: opts.ReservationTTL, clock: opts.Clock, mono: mono,
		netns: cookie, size: opts.PoolSize, floor: opts.Floor, capacity: opts.PoolCapacity, lapse: opts.LapseAfter, abortPast: opts.AbortMovedPast, hostLax: !opts.LimitHostNetwork, maxDest: opts.MaxDestPools, noDest: opts.NoDestPools,
		pinLock: opts.PinLock,
	}
	defer func() {
		if l.unlock != nil {
			l.unlock()
		}
	}()
	l.btf = btf.NewCache()
	if l.abortPast && !kernelHasFunc(l.btf, "bpf_sock_destroy") {
		l.log.Warn("connections.abort_moved_past is on, but this kernel has no bpf_sock_destroy (Linux 6.5): connections a pod opened before it was classified are counted past the rule, not aborted")
	}
	if err := l.load(); err != nil {
		l.closeFDs()
		l.discardStaged()
		return nil, err
	}
	rep, err := l.setUp(opts)
	if err != nil {
		l.restorePrior()
		l.closeFDs()
		// Before its commit a failed migration leaves the old pins as
		// they were, enforcing; after it, the next Open installs the new.
		if l.mig != nil && !l.mig.committed {
			l.discardStaged()
		}
		return nil, err
	}
	// The active counts as the pins hold them are the last daemon's: a
	// project that left its window since (no Tick took it out) is still
	// in them, and its next ask would count it again, as a newcomer's,
	// until the first Tick. Recounted now, after the first pass (its
	// adoptions stamp their projects).
	if err := l.recountActiveLocked(); err != nil {
		l.restorePrior()
		l.closeFDs()
		return nil, err
	}
	// The connections pool's safe slice as the last daemon set it is kept
	// until this one sets its own (SetFleetSafe): a daemon that stops
	// before then leaves it for the next start (PinnedFleetSafes).
	if l.objs.FsLapses != nil {
		var v limiterFsLapse
		if l.objs.FsLapses.Lookup(lapseSlot, &v) == nil {
			l.nodeSafe = v.NodeSafe
		}
	}
	// Once nothing can fail: a daemon that comes back after enforcement
	// lapsed makes the programs refuse again from here, and an Open that
	// fails (a start refused, a crash loop that never gets this far) leaves
	// the heartbeat as it was, so such a node still lapses.
	if err := l.heartbeat(); err != nil {
		l.restorePrior()
		l.closeFDs()
		return nil, err
	}
	l.prior = nil
	l.started = rep
	if l.mig != nil {
		past := 0
		for _, n := range rep.AdoptedPast {
			past += n
		}
		l.log.Warn("migrated from pins of another layout: the kernel's counts were rebuilt from the live sockets; "+
			"not recoverable from them and lost: rate tokens (the rates apply again from the next tick), unread refusal events, per-project admitted and refused counters, "+
			"and inbound handshakes in progress",
			"pin_dir", l.pinDir, "adopted", rep.Adopted, "adopted_past_rule", past, "reason", l.mig.reason)
	}
	l.log.Info("connection limiter ready", "cgroup2", root, "base_level", l.base, "max_depth", l.depth,
		"members", len(l.memb.members), "projects", len(l.memb.ids), "netns", len(l.nets), "pin_dir", l.pinDir, "reused", l.reused,
		"pool", l.size, "floor", l.floor, "adopted", rep.Adopted, "exempt", l.exempt, "exempt_max", l.exemptMax)
	return l, nil
}

// setUp configures the loaded maps as Options say, attaches the programs and
// reconciles once. In a migration the new programs are attached beside the
// old and count the live sockets before the old ones are detached (see
// migrate.go). On reused pins, what it overwrites of the configuration the
// running programs enforce is kept in l.prior, for Open to put back if the
// start fails (prior.go).
func (l *Limiter) setUp(opts Options) (ReconcileReport, error) {
	var rep ReconcileReport
	if err := l.loadMembership(); err != nil {
		return rep, err
	}
	if err := l.loadDestsLocked(); err != nil {
		return rep, err
	}
	if err := l.syncDestConfsLocked(); err != nil {
		return rep, err
	}
	// What can be refused without writing first: the exempt set.
	l.mu.Lock()
	exempt, xerr := l.resolveExemptLocked(opts.Exempt, opts.ExemptMax)
	l.mu.Unlock()
	if xerr != nil {
		return rep, xerr
	}
	// On reused pins the programs that run go on with what is written
	// below: what they enforce now is read first, and put back if the
	// start fails past here (Open), so that they go on enforcing the last
	// daemon's configuration, not half of the refused one's.
	if l.reused && l.mig == nil {
		prior, err := l.readPrior()
		if err != nil {
			return rep, err
		}
		l.prior = prior
	}
	// The destination pools before the node pool's settings: a change of
	// them the pins cannot take (ErrDestPoolsFull) refuses the start with
	// nothing written, and the programs go on enforcing what the last
	// daemon left, not this one's pool size beside its old pools.
	if err := l.setDestPoolsLocked(opts.DestPools); err != nil {
		return rep, err
	}
	if err := l.checkAndWriteConfig(); err != nil {
		return rep, err
	}
	if opts.Events != nil {
		if err := l.setEvents(*opts.Events); err != nil {
			return rep, err
		}
	}
	// Before attaching: a reused pin keeps enforcing the old set until now.
	l.mu.Lock()
	xerr = l.setExemptLocked(exempt)
	l.mu.Unlock()
	if xerr != nil {
		return rep, xerr
	}
	if err := l.startLapse(); err != nil {
		return rep, err
	}
	if l.mig == nil {
		if err := l.attach(); err != nil {
			return rep, err
		}
		if err := l.reattachNetns(); err != nil {
			return rep, err
		}
		rep, err := l.reconcile()
		if err != nil {
			return rep, fmt.Errorf("first reconcile: %w", err)
		}
		return rep, nil
	}
	// A migration: both programs run from here, the new ones counting
	// every new connection; the pass counts the connections that exist.
	if err := l.attachStaged(); err != nil {
		return rep, err
	}
	// Every namespace with a process in it, not only the daemon's: the
	// pods' connections are counted before the old programs go, not once
	// the daemon attaches their namespaces.
	l.migNetns = l.otherNetns()
	defer func() { l.migNetns = nil }()
	rep, err := l.reconcile()
	if err != nil {
		return rep, fmt.Errorf("counting the live connections into the migrated maps: %w", err)
	}
	if err := migrateFault("counted"); err != nil {
		return rep, err
	}
	if err := l.commit(); err != nil {
		return rep, err
	}
	if err := migrateFault("committed"); err != nil {
		return rep, err
	}
	// The other namespaces' sk_lookup links are moved to instances that
	// read the new maps (one BPF_LINK_UPDATE each: no moment without a
	// program), then the old pins are replaced, detaching the old links.
	if err := l.reattachNetns(); err != nil {
		return rep, err
	}
	if err := l.install(); err != nil {
		return rep, err
	}
	// A connect the old programs alone admitted, hashed after the pass
	// above had walked past its place, is counted now.
	second, err := l.reconcile()
	if err != nil {
		return rep, fmt.Errorf("second reconcile after the migration: %w", err)
	}
	second.addRepairs(rep)
	second.Migrated = true
	return second, nil
}

// specEdit, set by tests only, changes what spec returns: a test makes pins
// of another layout with it, as an older or newer version would have.
var specEdit func(*ebpf.CollectionSpec)

// spec is the embedded collection set up for this limiter: where the walk
// runs, the exempt set's size, the membership tables as Options size them
// and the permit tables for POOL, or as the pinned ones are.
func (l *Limiter) spec() (*ebpf.CollectionSpec, error) {
	spec, err := loadLimiter()
	if err != nil {
		return nil, fmt.Errorf("reading the embedded BPF object: %w", err)
	}
	if err := spec.Variables["base_level"].Set(l.base); err != nil {
		return nil, fmt.Errorf("setting base_level: %w", err)
	}
	if err := spec.Variables["max_depth"].Set(l.depth); err != nil {
		return nil, fmt.Errorf("setting max_depth: %w", err)
	}
	if err := spec.Variables["lookup_netns"].Set(l.netns); err != nil {
		return nil, fmt.Errorf("setting lookup_netns: %w", err)
	}
	// The daemon runs in the host's network namespace (the chart's
	// hostNetwork, or systemd's): a pod there is not limited as
	// unclassified (bpf/lib/project.h), unless LimitHostNetwork.
	if l.hostLax {
		if err := spec.Variables["host_netns"].Set(l.netns); err != nil {
			return nil, fmt.Errorf("setting host_netns: %w", err)
		}
	}
	if l.evWindow > 0 {
		if err := spec.Variables["ev_window_ns"].Set(uint64(l.evWindow)); err != nil {
			return nil, fmt.Errorf("setting ev_window_ns: %w", err)
		}
	}
	spec.Maps["fs_projects"].MaxEntries = l.maxProj
	spec.Maps["fs_names"].MaxEntries = l.maxProj
	spec.Maps["fs_members"].MaxEntries = l.maxMemb
	for _, name := range []string{"fs_projects", "fs_names", "fs_members"} {
		if m, err := ebpf.LoadPinnedMap(filepath.Join(l.pinDir, name), nil); err == nil {
			spec.Maps[name].MaxEntries = m.MaxEntries()
			m.Close()
		}
	}
	l.maxProj = min(spec.Maps["fs_projects"].MaxEntries, spec.Maps["fs_names"].MaxEntries)
	// The tables of an entry per project, keyed by its id: as many.
	for _, name := range []string{"fs_rates", "fs_dryrun", "fs_ev_projects"} {
		spec.Maps[name].MaxEntries = l.maxProj
	}
	// Destination pools: ids 1..maxDest, and a row of the projects' ids per
	// pool; pinned tables keep their sizes (the stride is the pinned
	// projects table's).
	// NoDestPools: one entry each (id 0 is none; an array has at least
	// one), so a node without destination pools does not pay for their
	// per-project table.
	if l.maxDest == 0 && !l.noDest {
		l.maxDest = DefaultMaxDestPools
	}
	if m, err := ebpf.LoadPinnedMap(filepath.Join(l.pinDir, "fs_dpool_conf"), nil); err == nil {
		l.maxDest = m.MaxEntries() - 1
		m.Close()
	}
	spec.Maps["fs_dpool_conf"].MaxEntries = l.maxDest + 1
	spec.Maps["fs_dpool_state"].MaxEntries = l.maxDest + 1
	spec.Maps["fs_dpool_proj"].MaxEntries = max(l.maxDest*l.maxProj, 1)
	// The old destinations and the new at once, while SetDestPools
	// changes them (rewriteDestsLocked).
	spec.Maps["fs_dests"].MaxEntries = 2 * MaxDestinations
	if err := spec.Variables["abort_moved_past"].Set(boolU32(l.abortPast)); err != nil {
		return nil, fmt.Errorf("setting abort_moved_past: %w", err)
	}
	if err := spec.Variables["dest_stride"].Set(l.maxProj); err != nil {
		return nil, fmt.Errorf("setting dest_stride: %w", err)
	}
	// The fleet caps (bpf/lib/cap.h): a row of the projects' ids for the
	// connections pool and one per destination pool.
	spec.Maps["fs_caps"].MaxEntries = (l.maxDest + 1) * l.maxProj
	if err := spec.Variables["cap_stride"].Set(l.maxProj); err != nil {
		return nil, fmt.Errorf("setting cap_stride: %w", err)
	}
	l.maxMemb = spec.Maps["fs_members"].MaxEntries
	// Pinned permit tables keep their size while they hold the pool's
	// capacity; tables too small for it (a larger pool configured since)
	// are of another layout: Open migrates them to tables of this size.
	l.held, l.outgrown = heldCapacity(l.capacity), 0
	if m, err := ebpf.LoadPinnedMap(filepath.Join(l.pinDir, "fs_slots"), nil); err == nil {
		if n := m.MaxEntries(); n >= l.capacity {
			l.held = n
		} else {
			l.outgrown = n
		}
		m.Close()
	}
	spec.Maps["fs_exempt"].MaxEntries = limits.ExemptCap
	spec.Maps["fs_slots"].MaxEntries = l.held
	spec.Maps["fs_held"].MaxEntries = l.held
	if err := spec.Variables["slot_mask"].Set(uint64(l.held - 1)); err != nil {
		return nil, fmt.Errorf("setting slot_mask: %w", err)
	}
	// Reservations hold permits too, so the same size bounds them; a pin
	// made with another size is reused as it is.
	spec.Maps["fs_reservations"].MaxEntries = l.held
	if m, err := ebpf.LoadPinnedMap(filepath.Join(l.pinDir, "fs_reservations"), nil); err == nil {
		if l.outgrown == 0 {
			spec.Maps["fs_reservations"].MaxEntries = m.MaxEntries()
		}
		m.Close()
	}
	if specEdit != nil {
		specEdit(spec)
	}
	return spec, nil
}

// load loads the programs: against the pinned maps when their layout is
// this version's (or nothing is pinned), else with fresh maps in the
// staging directory of a migration (l.mig, migrate.go). An interrupted
// migration is finished or undone first.
func (l *Limiter) load() error {
	if err := l.resumeMigration(); err != nil {
		return err
	}
	if err := l.growDestTables(); err != nil {
		return err
	}
	spec, err := l.spec()
	if err != nil {
		return err
	}
	reason, err := l.incompatible(spec)
	if err != nil {
		return err
	}
	if reason != "" {
		return l.loadStaged(spec, reason)
	}
	if _, err := os.Stat(filepath.Join(l.pinDir, "fs_config")); err == nil {
		l.reused = true
	}
	err = spec.LoadAndAssign(&l.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: l.pinDir}, Cache: l.btf})
	return l.loadError(err)
}

// destTables are the tables sized by Options.MaxDestPools: the destination
// pools' and the fleet caps (bpf/lib/cap.h: a row per pool). The caps hold
// nothing across a restart (Open clears what a daemon before left; the
// fleet computation sets them again), so they are remade as the pools' are.
var destTables = []string{"fs_dpool_conf", "fs_dpool_state", "fs_dpool_proj", "fs_caps"}

// growDestTables unpins the destination pool tables when they were pinned
// for no pool (NoDestPools) and this start wants room for some: they hold
// nothing (no pool id exists in them, so no socket's permit names one), and
// load makes them again at the size asked for. Programs still attached
// from before hold on to the old ones until they are replaced, and find no
// pool in them (dest_get fails: DEST_NONE).
func (l *Limiter) growDestTables() error {
	if l.noDest || l.maxDest == 0 {
		return nil
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(l.pinDir, "fs_dpool_conf"), nil)
	if err != nil {
		return nil
	}
	n := m.MaxEntries()
	m.Close()
	if n > 1 {
		return nil
	}
	for _, name := range destTables {
		if err := os.Remove(filepath.Join(l.pinDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("growing the destination pool tables: %w", err)
		}
	}
	l.log.Info("destination pool tables made for pools", "max_destination_pools", l.maxDest)
	return nil
}

// loadError names the cause of a failed load and what to do about it.
func (l *Limiter) loadError(err error) error {
	if err == nil {
		return nil
	}
	var ve *ebpf.VerifierError
	switch {
	case errors.As(err, &ve) && tooOld(ve):
		return fmt.Errorf("%w; the verifier said: %s", ErrKernelTooOld, strings.Join(lastLines(ve.Log, 3), " | "))
	case errors.As(err, &ve):
		return fmt.Errorf("the kernel verifier rejected a program: %+v", ve)
	case errors.Is(err, ebpf.ErrMapIncompatible):
		// incompatible found them reusable a moment before: another
		// process replaced pins meanwhile, without the directory's lock.
		return fmt.Errorf("the maps pinned in %s changed layout while they were loaded (another process at work on the pin directory?): "+
			"stop it, or run 'fairshare cleanup --pin-dir %s' (enforcement stops and the connection counts are lost "+
			"until the next start), then start again: %w (%w)", l.pinDir, l.pinDir, ErrPinnedMismatch, err)
	case errors.Is(err, ebpf.ErrNotSupported):
		return fmt.Errorf("%w (%w)", ErrKernelTooOld, err)
	case errors.Is(err, unix.EPERM):
		return fmt.Errorf("loading BPF programs was refused; the process needs CAP_BPF and CAP_PERFMON: %w", err)
	}
	return fmt.Errorf("loading BPF programs: %w", err)
}

// tooOld says whether a verifier log refuses a program for what an older
// kernel lacks: a helper it does not know or does not allow for the
// program's type, a kernel function, or a tracepoint argument.
func tooOld(ve *ebpf.VerifierError) bool {
	for _, line := range ve.Log {
		for _, sign := range []string{"unknown func", "invalid func", "cannot use helper",
			"kernel function", "invalid bpf_context access"} {
			if strings.Contains(line, sign) {
				return true
			}
		}
	}
	return false
}

// lastLines is the last n non-empty lines of log.
func lastLines(log []string, n int) []string {
	var out []string
	for i := len(log) - 1; i >= 0 && len(out) < n; i-- {
		if l := strings.TrimSpace(log[i]); l != "" {
			out = append([]string{l}, out...)
		}
	}
	return out
}

func (l *Limiter) checkAndWriteConfig() error {
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("reading config map: %w", err)
	}
	cfg.Pool, cfg.Floor, cfg.WindowNs = l.size, l.floor, uint64(l.window)
	cfg.Layout = pinLayout
	if err := l.clearCaps(&cfg); err != nil {
		return err
	}
	if err := l.objs.FsConfig.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("writing config map: %w", err)
	}
	return nil
}

// retiredLinks are links an earlier version pinned for programs this one
// no longer has; attach detaches them.
var retiredLinks = []string{"link_send_reset", "link_drop"}

// attachment is one link the limiter keeps pinned.
type attachment struct {
	name   string
	prog   *ebpf.Program
	attach func() (link.Link, error)
	// swap: the link type cannot change its program (tracing links): a new
	// link is attached and pinned in the old one's place instead.
	swap bool
}

// attachments lists the links in the order attach creates them: the release
// paths before the admission hooks, so that no permit is ever taken by a
// program whose release is not attached yet.
func (l *Limiter) attachments(cgroup string, objs *limiterObjects) []attachment {
	cg := func(prog *ebpf.Program, typ ebpf.AttachType) func() (link.Link, error) {
		return func() (link.Link, error) {
			return link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: typ, Program: prog})
		}
	}
	tracing := func(prog *ebpf.Program) func() (link.Link, error) {
		return func() (link.Link, error) {
			return link.AttachTracing(link.TracingOptions{Program: prog, AttachType: ebpf.AttachTraceRawTp})
		}
	}
	return []attachment{
		{"link_sock_release", objs.FsSockRelease, cg(objs.FsSockRelease, ebpf.AttachCgroupInetSockRelease), false},
		{"link_set_state", objs.FsSetState, tracing(objs.FsSetState), true},
		{"link_sockops", objs.FsSockops, cg(objs.FsSockops, ebpf.AttachCGroupSockOps), false},
		{"link_connect4", objs.FsConnect4, cg(objs.FsConnect4, ebpf.AttachCGroupInet4Connect), false},
		{"link_connect6", objs.FsConnect6, cg(objs.FsConnect6, ebpf.AttachCGroupInet6Connect), false},
		{"link_sk_lookup", objs.FsSkLookup, func() (link.Link, error) {
			ns, err := os.Open("/proc/self/ns/net")
			if err != nil {
				return nil, err
			}
			defer ns.Close()
			return link.AttachNetNs(int(ns.Fd()), objs.FsSkLookup)
		}, false},
	}
}

// attach attaches the loaded programs and pins their links. A link pinned by
// an earlier run is moved to the program just loaded (its maps are the same
// pinned ones), so new code takes effect on a restart; on an error, the links
// this call created are detached again.
func (l *Limiter) attach() (err error) {
	var created []link.Link
	defer func() {
		if err == nil {
			return
		}
		for _, lk := range created {
			_ = lk.Unpin()
		}
	}()
	// Links of programs this version no longer has: an earlier version
	// undid reservations at tcp_send_reset and kfree_skb.
	for _, name := range retiredLinks {
		path := filepath.Join(l.pinDir, name)
		if old, err := link.LoadPinnedLink(path, nil); err == nil {
			if err := old.Unpin(); err != nil {
				old.Close()
				return fmt.Errorf("unpinning retired link %s: %w", path, err)
			}
			old.Close()
			l.log.Info("detached a program this version no longer has", "link", name)
		}
	}
	var tags []any
	for _, a := range l.attachments(l.root, &l.objs) {
		path := filepath.Join(l.pinDir, a.name)
		old, lerr := link.LoadPinnedLink(path, nil)
		switch {
		case lerr == nil && !a.swap:
			if err := old.Update(a.prog); err != nil {
				old.Close()
				return fmt.Errorf("moving pinned link %s to the new program: %w", path, err)
			}
			l.links = append(l.links, old)
		case lerr == nil || errors.Is(lerr, os.ErrNotExist):
			lk, err := a.attach()
			if err != nil {
				if old != nil {
					old.Close()
				}
				if errors.Is(err, ebpf.ErrNotSupported) {
					return fmt.Errorf("attaching %s: the kernel does not support this hook: %w", a.name, err)
				}
				return fmt.Errorf("attaching %s: %w", a.name, err)
			}
			if err := pinOver(lk, path, old != nil); err != nil {
				lk.Close()
				if old != nil {
					old.Close()
				}
				return fmt.Errorf("pinning %s: %w", a.name, err)
			}
			if old != nil {
				// Unpinned by the rename: closing the last fd detaches it.
				// Until then both programs ran, which the exactly-once
				// release and the listener refcount tolerate.
				old.Close()
			} else {
				created = append(created, lk)
			}
			l.links = append(l.links, lk)
		default:
			return fmt.Errorf("loading pinned link %s: %w", path, lerr)
		}
		if info, err := a.prog.Info(); err == nil {
			tags = append(tags, a.name, info.Tag)
		}
	}
	l.log.Info("bpf programs attached", tags...)
	return nil
}

// pinOver pins lk at path; with replace, the pin there is replaced in one
// rename, so the path never lacks a link.
func pinOver(lk link.Link, path string, replace bool) error {
	if !replace {
		return lk.Pin(path)
	}
	tmp := path + "_new" // bpffs refuses dots in names
	_ = os.Remove(tmp)
	if err := lk.Pin(tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = lk.Unpin()
		return fmt.Errorf("replacing the pinned link: %w", err)
	}
	return nil
}

func (l *Limiter) closeFDs() {
	l.closeNetns()
	for _, lk := range l.links {
		lk.Close()
	}
	l.links = nil
	l.objs.Close()
}

// Close closes the limiter's file descriptors. The pinned maps and links
// stay, so the kernel keeps counting and refusing; a later Open reuses them.
func (l *Limiter) Close() error {
	// A pass under way (onePass) reads the maps without mu: it ends
	// before their descriptors close.
	l.passM.Lock()
	defer l.passM.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	l.closeFDs()
	return nil
}

// Cleanup detaches and unpins the loader's pins under pinDir ("" means
// DefaultPinDir) and removes the directory. Enforcement stops once no
// process holds the links open. A missing directory is not an error
// (CleanupPinDir tells it apart). A directory that is not a pin directory
// of the loader's (not on bpffs, bpffs's root, or holding anything the
// loader does not make: cleanupguard.go) is refused with an error wrapping
// ErrNotPinDir, and nothing in it is removed.
func Cleanup(pinDir string) error {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	return cleanup(pinDir, true)
}

// PinDirReplaced says whether pinDir is no longer the directory f is open
// on (a daemon's lock on it): removed (f's inode unlinked), or another
// directory in its place.
func PinDirReplaced(f *os.File, pinDir string) (bool, error) {
	var held, now unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &held); err != nil {
		return false, fmt.Errorf("reading the pin directory's lock: %w", err)
	}
	if held.Nlink == 0 {
		return true, nil
	}
	err := unix.Stat(pinDir, &now)
	if errors.Is(err, unix.ENOENT) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("reading the pin directory %s: %w", pinDir, err)
	}
	return now.Dev != held.Dev || now.Ino != held.Ino, nil
}

// CleanupOpened unpins everything in the directory dir is open on,
// wherever it is now (renamed, or under a file system mounted over it;
// nothing if it was removed), and leaves the directory: a daemon's own
// pins, when its pin directory's path no longer leads to them.
func CleanupOpened(dir *os.File) error {
	return cleanup(fmt.Sprintf("/proc/self/fd/%d", dir.Fd()), false)
}

func cleanup(pinDir string, rmdir bool) error {
	ents, err := guardPinDir(pinDir, !rmdir)
	if errors.Is(err, errNoPinDir) {
		return nil
	}
	if err != nil {
		return err
	}
	errs := []error{cleanupNetns(pinDir)}
	for _, e := range ents {
		path := filepath.Join(pinDir, e.Name())
		if e.Name() == netnsDir {
			continue
		}
		if e.Name() == stagingDir || e.Name() == readyDir {
			// A migration's, interrupted (migrate.go).
			if err := Cleanup(path); err != nil {
				errs = append(errs, err)
			}
			continue
		}
		if strings.HasPrefix(e.Name(), "link_") {
			lk, err := link.LoadPinnedLink(path, nil)
			if err == nil {
				err = lk.Unpin()
				lk.Close()
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("unpinning %s: %w", path, err))
			}
			continue
		}
		if err := os.Remove(path); err != nil {
			errs = append(errs, fmt.Errorf("unpinning %s: %w", path, err))
		}
	}
	if !rmdir {
		return errors.Join(errs...)
	}
	if err := os.Remove(pinDir); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing pin directory: %w", err))
	}
	return errors.Join(errs...)
}

// kernelHasFunc says whether the running kernel's BTF (read through cache,
// which the load then shares) has the function name (a kfunc the programs
// call only if it is there); false if its BTF cannot be read either.
func kernelHasFunc(cache *btf.Cache, name string) bool {
	spec, err := cache.Kernel()
	if err != nil {
		return false
	}
	var fn *btf.Func
	return spec.TypeByName(name, &fn) == nil
}

// boolU32 is b as a C flag.
func boolU32(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}
