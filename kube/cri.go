// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	rt "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// DefaultEndpoint is containerd's CRI socket.
const DefaultEndpoint = "/run/containerd/containerd.sock"

// Labels kubelet puts on every pod sandbox.
const (
	LabelNamespace = "io.kubernetes.pod.namespace"
	LabelName      = "io.kubernetes.pod.name"
	LabelUID       = "io.kubernetes.pod.uid"
)

// Pod is a pod sandbox that is ready on this node, as the runtime reports it.
type Pod struct {
	// ID is the sandbox id.
	ID                   string
	Namespace, Name, UID string
	// Labels are the pod's labels (kubelet copies them onto the sandbox).
	Labels map[string]string
	// Cgroup is the pod's cgroup, the parent of all its containers, as a
	// path relative to the cgroup2 mount ("/kubepods/burstable/pod<uid>",
	// or for the systemd driver the slice's directory).
	Cgroup string
	// HostNetwork says the pod uses the node's network namespace.
	HostNetwork bool
	// NetNS is the path of the pod's own network namespace; "" for a
	// host-network pod.
	NetNS string
	// Pid is the sandbox's process, whose /proc/<pid>/ns/net is the pod's
	// network namespace too.
	Pid int
	// Unusable says why the runtime's account of the pod cannot be used
	// (no cgroup in its status, a status that does not decode); the other
	// pods are listed all the same. Only ID, the identity and Labels are
	// set then.
	Unusable string
	// Pending says why the runtime's status of a sandbox seen for the
	// first time could not be read in this list (an error, or no answer in
	// time: a hung shim); it is asked again at the next. Only ID, the
	// identity and Labels are set then.
	Pending string
}

// statusWorkers bounds the status calls of one list in flight at once.
const statusWorkers = 8

// ErrRuntime wraps errors of the container runtime (not there, gone, or
// answering with an error).
var ErrRuntime = errors.New("container runtime")

// CRI lists the pods of a node from its container runtime, over the CRI v1
// gRPC API. It needs no API server and no Kubernetes credentials, only the
// runtime's socket. Safe for concurrent use.
type CRI struct {
	endpoint string
	conn     *grpc.ClientConn
	rs       rt.RuntimeServiceClient

	mu sync.Mutex // guards the fields below
	// details caches what the verbose sandbox status says of a sandbox
	// (cgroup, network namespace): none of it changes while it lives.
	details map[string]Pod
}

// DialCRI returns a client of the runtime at endpoint (a unix socket path,
// or "unix://..."). It does not connect until first used, so a runtime that
// is not up yet is not an error here.
func DialCRI(endpoint string) (*CRI, error) {
	if endpoint == "" {
		endpoint = DefaultEndpoint
	}
	target := endpoint
	if !strings.Contains(target, "://") {
		target = "unix://" + target
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("%w at %s: %w", ErrRuntime, endpoint, err)
	}
	return &CRI{endpoint: endpoint, conn: conn, rs: rt.NewRuntimeServiceClient(conn), details: map[string]Pod{}}, nil
}

// Endpoint is the runtime's socket as given.
func (c *CRI) Endpoint() string { return c.endpoint }

// Close closes the connection.
func (c *CRI) Close() error { return c.conn.Close() }

// Pods lists the ready pod sandboxes. A sandbox seen for the first time
// costs one more call (its verbose status); later lists reuse it.
func (c *CRI) Pods(ctx context.Context) ([]Pod, error) {
	l, err := c.rs.ListPodSandbox(ctx, &rt.ListPodSandboxRequest{
		Filter: &rt.PodSandboxFilter{State: &rt.PodSandboxStateValue{State: rt.PodSandboxState_SANDBOX_READY}},
	})
	if err != nil {
		return nil, fmt.Errorf("%w at %s: listing pod sandboxes: %w", ErrRuntime, c.endpoint, err)
	}
	details := c.statuses(ctx, l.Items)
	live := make(map[string]bool, len(l.Items))
	pods := make([]Pod, 0, len(l.Items))
	for i, s := range l.Items {
		live[s.Id] = true
		p, err := details[i].pod, details[i].err
		switch {
		case errors.Is(err, errSandboxGone):
			// Gone between the list and the status: not a pod any more.
			continue
		case errors.Is(err, errUnusable):
			// One odd sandbox (another runtime's, a VM's) must not hide
			// the others: it is listed with why.
			p = Pod{ID: s.Id, Unusable: err.Error()}
		case err != nil:
			// Nor one whose status fails or hangs: the others are
			// listed, it is asked again at the next list.
			p = Pod{ID: s.Id, Pending: err.Error()}
		}
		p.Labels = s.Labels
		if md := s.Metadata; md != nil {
			p.Namespace, p.Name, p.UID = md.Namespace, md.Name, md.Uid
		}
		// kubelet's labels win: metadata is whatever the creator said.
		if v := s.Labels[LabelNamespace]; v != "" {
			p.Namespace = v
		}
		if v := s.Labels[LabelName]; v != "" {
			p.Name = v
		}
		if v := s.Labels[LabelUID]; v != "" {
			p.UID = v
		}
		pods = append(pods, p)
	}
	c.mu.Lock()
	for id := range c.details {
		if !live[id] {
			delete(c.details, id)
		}
	}
	c.mu.Unlock()
	return pods, nil
}

// detailed is a sandbox's detail or why it has none.
type detailed struct {
	pod Pod
	err error
}

// statuses is detail of each of items, in their order: those seen before
// from the cache, the others asked in parallel (statusWorkers at a time),
// each within three quarters of the time ctx leaves (a second without a
// deadline), so that a sandbox whose status hangs (a hung shim; containerd
// asks it for the verbose status) costs the list that much, not its whole
// deadline, and the list still comes back in time. One that misses it is
// Pending, asked again at the next list.
func (c *CRI) statuses(ctx context.Context, items []*rt.PodSandbox) []detailed {
	out := make([]detailed, len(items))
	per := time.Second
	if d, ok := ctx.Deadline(); ok {
		per = time.Until(d) * 3 / 4
	}
	sem := make(chan struct{}, statusWorkers)
	var wg sync.WaitGroup
	for i, s := range items {
		c.mu.Lock()
		p, ok := c.details[s.Id]
		c.mu.Unlock()
		if ok {
			out[i] = detailed{pod: p}
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			sctx, cancel := context.WithTimeout(ctx, per)
			defer cancel()
			p, err := c.detail(sctx, s.Id)
			if err != nil && sctx.Err() != nil && ctx.Err() == nil {
				// The same words each poll: the reason is listed, and a
				// changed list is a changed membership.
				err = fmt.Errorf("%w at %s: no status of sandbox %s in time: %w", ErrRuntime, c.endpoint, s.Id, context.DeadlineExceeded)
			}
			out[i] = detailed{pod: p, err: err}
		}()
	}
	wg.Wait()
	return out
}

var (
	errSandboxGone = errors.New("sandbox gone")
	errUnusable    = errors.New("unusable sandbox status")
)

// sandboxInfo is the part of containerd's verbose sandbox status read here.
type sandboxInfo struct {
	Pid                int  `json:"pid"`
	NetNamespaceClosed bool `json:"netNamespaceClosed"`
	Config             struct {
		Linux struct {
			CgroupParent    string `json:"cgroup_parent"`
			SecurityContext struct {
				NamespaceOptions struct {
					Network json.RawMessage `json:"network"`
				} `json:"namespace_options"`
			} `json:"security_context"`
		} `json:"linux"`
	} `json:"config"`
	RuntimeSpec struct {
		Linux struct {
			CgroupsPath string `json:"cgroupsPath"`
			Namespaces  []struct {
				Type string `json:"type"`
				Path string `json:"path"`
			} `json:"namespaces"`
		} `json:"linux"`
	} `json:"runtimeSpec"`
}

func (c *CRI) detail(ctx context.Context, id string) (Pod, error) {
	c.mu.Lock()
	p, ok := c.details[id]
	c.mu.Unlock()
	if ok {
		return p, nil
	}
	st, err := c.rs.PodSandboxStatus(ctx, &rt.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		if strings.Contains(err.Error(), "not found") {
			return Pod{}, errSandboxGone
		}
		return Pod{}, fmt.Errorf("%w at %s: status of sandbox %s: %w", ErrRuntime, c.endpoint, id, err)
	}
	p = Pod{ID: id}
	if ns := st.GetStatus().GetLinux().GetNamespaces().GetOptions(); ns != nil {
		p.HostNetwork = ns.Network == rt.NamespaceMode_NODE
	}
	var info sandboxInfo
	if raw := st.Info["info"]; raw != "" {
		if err := json.Unmarshal([]byte(raw), &info); err != nil {
			return Pod{}, fmt.Errorf("%w: sandbox %s: reading its verbose status: %v", errUnusable, id, err)
		}
	}
	p.Pid = info.Pid
	cg := info.Config.Linux.CgroupParent
	if cg == "" {
		// Without the config (another runtime), the sandbox's own cgroup
		// is the pod's first child.
		if sp := info.RuntimeSpec.Linux.CgroupsPath; sp != "" {
			cg, err = cgroupOf(sp)
			if err == nil {
				cg = path.Dir(cg)
			}
		}
	} else {
		cg, err = CgroupDir(cg)
	}
	if err != nil || cg == "" || cg == "/" {
		return Pod{}, fmt.Errorf("%w: sandbox %s: no usable cgroup (%q): %v", errUnusable, id, info.Config.Linux.CgroupParent, err)
	}
	p.Cgroup = cg
	if !p.HostNetwork {
		for _, ns := range info.RuntimeSpec.Linux.Namespaces {
			if ns.Type == "network" {
				p.NetNS = ns.Path
			}
		}
	}
	c.mu.Lock()
	c.details[id] = p
	c.mu.Unlock()
	return p, nil
}

// DefaultPodCgroups are the cgroups kubelet places every pod below at its
// default cgroup root: /kubepods with the cgroupfs driver, /kubepods.slice
// with the systemd driver.
var DefaultPodCgroups = []string{"/kubepods", "/kubepods.slice"}

// CheckPodCgroup checks a pod's cgroup as the runtime reported it (Pod.Cgroup)
// before it is made a member: it must be an absolute, clean path (no "..",
// no "." or empty element, no trailing "/") strictly below one of roots
// (DefaultPodCgroups when nil), and it must be the cgroup kubelet names for
// the pod's uid: "pod<uid>" with the cgroupfs driver, a slice ending in
// "-pod<uid>.slice" (the uid's dashes made underscores) with the systemd
// driver. The runtime is not trusted with more: a cgroup of "/" or of
// anything outside the pods' cgroups would put every process of the node,
// or another tenant's, in the pod's project, and another pod's cgroup would
// count that pod's sockets in this pod's project.
func CheckPodCgroup(cg, uid string, roots []string) error {
	if roots == nil {
		roots = DefaultPodCgroups
	}
	switch {
	case cg == "":
		return errors.New("the runtime reports no cgroup")
	case !strings.HasPrefix(cg, "/") || path.Clean(cg) != cg:
		return fmt.Errorf("cgroup %q is not a clean absolute path", cg)
	}
	below := false
	for _, r := range roots {
		if strings.HasPrefix(cg, strings.TrimSuffix(r, "/")+"/") {
			below = true
			break
		}
	}
	if !below {
		return fmt.Errorf("cgroup %q is not below the pods' cgroups %s", cg, strings.Join(roots, ", "))
	}
	if uid == "" || strings.IndexFunc(uid, func(r rune) bool {
		return !(r == '-' || '0' <= r && r <= '9' || 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z')
	}) >= 0 {
		return fmt.Errorf("the runtime reports no usable pod uid (%q) to check cgroup %q against", uid, cg)
	}
	base := path.Base(cg)
	if base != "pod"+uid && !strings.HasSuffix(base, "-pod"+strings.ReplaceAll(uid, "-", "_")+".slice") {
		return fmt.Errorf("cgroup %q is not the cgroup kubelet makes for pod uid %s", cg, uid)
	}
	return nil
}

// CgroupDir turns a cgroup parent as kubelet gives it to the runtime into a
// directory relative to the cgroup2 mount. The cgroupfs driver gives the
// path itself ("/kubepods/burstable/pod<uid>"); the systemd driver gives a
// slice name ("kubepods-burstable-pod<uid>.slice"), which systemd places by
// its dashes: each dash-separated prefix is a parent slice.
func CgroupDir(parent string) (string, error) {
	if strings.HasSuffix(parent, ".slice") && !strings.Contains(parent, "/") {
		return SliceDir(parent)
	}
	if !strings.HasPrefix(parent, "/") {
		parent = "/" + parent
	}
	clean := path.Clean(parent)
	if clean != parent && clean+"/" != parent {
		return "", fmt.Errorf("cgroup path %q is not clean", parent)
	}
	return clean, nil
}

// SliceDir is the directory of a systemd slice below the cgroup root:
// "a-b-c.slice" is "/a.slice/a-b.slice/a-b-c.slice", and "-.slice" is the
// root itself.
func SliceDir(slice string) (string, error) {
	name, ok := strings.CutSuffix(slice, ".slice")
	if !ok || strings.Contains(name, "/") {
		return "", fmt.Errorf("%q is not a slice name", slice)
	}
	if name == "-" {
		return "/", nil
	}
	if name == "" || strings.HasPrefix(name, "-") || strings.HasSuffix(name, "-") || strings.Contains(name, "--") {
		return "", fmt.Errorf("%q is not a valid slice name", slice)
	}
	parts := strings.Split(name, "-")
	dir := ""
	for i := range parts {
		dir += "/" + strings.Join(parts[:i+1], "-") + ".slice"
	}
	return dir, nil
}

// cgroupOf turns a container's cgroupsPath (OCI runtime spec) into a
// directory: a path for cgroupfs, or "slice:prefix:name" for systemd, whose
// unit is the scope "prefix-name.scope" inside the slice.
func cgroupOf(p string) (string, error) {
	if strings.HasPrefix(p, "/") {
		return CgroupDir(p)
	}
	f := strings.Split(p, ":")
	if len(f) != 3 {
		return "", fmt.Errorf("cgroups path %q is neither a path nor slice:prefix:name", p)
	}
	dir, err := SliceDir(f[0])
	if err != nil {
		return "", err
	}
	return path.Join(dir, f[1]+"-"+f[2]+".scope"), nil
}

// Ping asks the runtime for its version, to tell an operator at start
// whether it is there.
func (c *CRI) Ping(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	v, err := c.rs.Version(ctx, &rt.VersionRequest{})
	if err != nil {
		return "", fmt.Errorf("%w at %s: %w", ErrRuntime, c.endpoint, err)
	}
	return v.RuntimeName + " " + v.RuntimeVersion, nil
}
