// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rt "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// kubelet is the part of a kubelet the chart's pod test needs: it turns
// the DaemonSet's pod template into the CRI's RunPodSandbox and
// CreateContainer requests as kubelet 1.3x does (pkg/kubelet/kuberuntime:
// the sandbox's namespaces, cgroup parent by QoS class, the container's
// security context, its mounts from the pod's volumes, its environment
// with the downward API and $(VAR) expansion, its resources). A field of
// the template it neither translates nor knows to be kubelet's business
// alone fails the test: the chart cannot grow something the test silently
// leaves out.
type kubelet struct {
	t *testing.T
	// node is the node's name and ip its address (status.podIP of a
	// host-network pod).
	node, ip string
	// podDir holds the files kubelet keeps for a pod (the termination
	// log).
	podDir     string
	configMaps map[string]*corev1.ConfigMap
	cmDirs     map[string]string // the ConfigMap volumes' directories, by volume
}

// Fields of the pod template and its container that the translation
// handles, or that are kubelet's alone (scheduling, image pulls, probes,
// which the test runs itself) and have no part in the CRI requests.
var (
	podFields = []string{"hostNetwork", "hostPID", "containers", "volumes", "priorityClassName",
		"automountServiceAccountToken", "terminationGracePeriodSeconds",
		"dnsPolicy", "tolerations", "nodeSelector", "affinity"} // the last four: no cluster DNS, no scheduler
	containerFields = []string{"name", "image", "command", "args", "env", "ports", "securityContext", "resources",
		"volumeMounts", "terminationMessagePolicy",
		"imagePullPolicy", "startupProbe", "livenessProbe", "readinessProbe"} // the image is imported; the test probes
	securityFields = []string{"privileged", "allowPrivilegeEscalation", "readOnlyRootFilesystem", "runAsUser",
		"capabilities", "seLinuxOptions", "seccompProfile", "appArmorProfile"}
)

// checkFields fails the test for a field of v (as JSON) not in known.
func (k *kubelet) checkFields(what string, v any, known []string) {
	k.t.Helper()
	raw, err := json.Marshal(v)
	if err != nil {
		k.t.Fatal(err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		k.t.Fatal(err)
	}
	for f := range m {
		if !slices.Contains(known, f) {
			k.t.Fatalf("the chart's %s has %s, which the test's kubelet does not translate into the CRI requests: teach it (kubelet_test.go)", what, f)
		}
	}
}

// Kubelet's defaults for a container whose procMount is Default
// (pkg/securitycontext: DefaultProcMount).
var (
	maskedPaths = []string{"/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
		"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap"}
	readonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
)

// sandbox is the RunPodSandbox configuration of the pod named name with
// uid, from the template tpl.
func (k *kubelet) sandbox(tpl corev1.PodTemplateSpec, namespace, name, uid string) *rt.PodSandboxConfig {
	t := k.t
	t.Helper()
	spec := tpl.Spec
	k.checkFields("pod spec", spec, podFields)
	if spec.SecurityContext != nil && !isZero(spec.SecurityContext) {
		t.Fatal("the chart's pod has a pod-level securityContext: teach the test's kubelet")
	}
	labels := maps.Clone(tpl.Labels)
	labels["io.kubernetes.pod.namespace"], labels["io.kubernetes.pod.name"], labels["io.kubernetes.pod.uid"] = namespace, name, uid
	ns := &rt.NamespaceOption{Network: rt.NamespaceMode_POD, Pid: rt.NamespaceMode_CONTAINER, Ipc: rt.NamespaceMode_POD}
	if spec.HostNetwork {
		ns.Network = rt.NamespaceMode_NODE
	}
	if spec.HostPID {
		ns.Pid = rt.NamespaceMode_NODE
	}
	privileged := false
	var ports []*rt.PortMapping
	for _, c := range spec.Containers {
		privileged = privileged || c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
		for _, p := range c.Ports {
			hp := p.HostPort
			if spec.HostNetwork {
				hp = p.ContainerPort // a host-network pod's ports are the node's
			}
			ports = append(ports, &rt.PortMapping{Protocol: rt.Protocol(rt.Protocol_value[string(p.Protocol)]), ContainerPort: p.ContainerPort, HostPort: hp})
		}
	}
	sc := &rt.PodSandboxConfig{
		Metadata:     &rt.PodSandboxMetadata{Name: name, Namespace: namespace, Uid: uid},
		Labels:       labels,
		Annotations:  tpl.Annotations,
		PortMappings: ports,
		Linux: &rt.LinuxPodSandboxConfig{
			CgroupParent: qosParent(spec) + "/pod" + uid,
			SecurityContext: &rt.LinuxSandboxSecurityContext{
				NamespaceOptions: ns,
				Privileged:       privileged,
				// No pod-level seccomp profile and kubelet's
				// --seccomp-default off: unconfined.
				Seccomp: &rt.SecurityProfile{ProfileType: rt.SecurityProfile_Unconfined},
			},
		},
	}
	// A host-network pod has the node's UTS namespace, so no hostname
	// (kubelet sets one only for the others).
	return sc
}

func isZero(v any) bool {
	raw, _ := json.Marshal(v)
	return string(raw) == "{}"
}

// qosParent is the pod's QoS class's cgroup under the cgroupfs driver:
// Guaranteed pods are in /kubepods, the others in its burstable or
// besteffort child.
func qosParent(spec corev1.PodSpec) string {
	guaranteed, some := true, false
	for _, c := range spec.Containers {
		for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			req, hasReq := c.Resources.Requests[r]
			lim, hasLim := c.Resources.Limits[r]
			some = some || hasReq || hasLim
			if !hasLim || hasReq && req.Cmp(lim) != 0 {
				guaranteed = false
			}
		}
	}
	switch {
	case !some:
		return "/kubepods/besteffort"
	case guaranteed:
		return "/kubepods"
	}
	return "/kubepods/burstable"
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)`)

// expand replaces $(NAME) by the variable's value, as kubelet does in env
// values, command and args; an unknown one stays as written.
func expand(s string, vars map[string]string) string {
	return varRef.ReplaceAllStringFunc(s, func(ref string) string {
		if v, ok := vars[ref[2:len(ref)-1]]; ok {
			return v
		}
		return ref
	})
}

// container is the CreateContainer configuration of the template's one
// container, in the sandbox sc.
func (k *kubelet) container(tpl corev1.PodTemplateSpec, sc *rt.PodSandboxConfig) *rt.ContainerConfig {
	t := k.t
	t.Helper()
	spec := tpl.Spec
	if len(spec.Containers) != 1 || len(spec.InitContainers) != 0 {
		t.Fatalf("the chart's pod has %d containers and %d init containers: the test runs one", len(spec.Containers), len(spec.InitContainers))
	}
	c := spec.Containers[0]
	k.checkFields("container", c, containerFields)

	// The environment: the downward API and $(VAR) of the variables
	// defined before.
	vars := map[string]string{}
	var envs []*rt.KeyValue
	for _, e := range c.Env {
		v := expand(e.Value, vars)
		if f := e.ValueFrom; f != nil {
			switch {
			case f.FieldRef != nil && f.FieldRef.FieldPath == "spec.nodeName":
				v = k.node
			case f.FieldRef != nil && f.FieldRef.FieldPath == "status.podIP" && spec.HostNetwork:
				v = k.ip
			default:
				t.Fatalf("env %s: the test's kubelet does not know %+v", e.Name, f)
			}
		}
		vars[e.Name] = v
		envs = append(envs, &rt.KeyValue{Key: e.Name, Value: []byte(v)})
	}
	exp := func(ss []string) []string {
		var out []string
		for _, s := range ss {
			out = append(out, expand(s, vars))
		}
		return out
	}

	// The security context, as kubelet's determineEffectiveSecurityContext.
	s := c.SecurityContext
	if s == nil {
		t.Fatal("the chart's container has no securityContext")
	}
	k.checkFields("container securityContext", s, securityFields)
	lsc := &rt.LinuxContainerSecurityContext{
		NamespaceOptions: sc.Linux.SecurityContext.NamespaceOptions,
		Privileged:       s.Privileged != nil && *s.Privileged,
		ReadonlyRootfs:   s.ReadOnlyRootFilesystem != nil && *s.ReadOnlyRootFilesystem,
	}
	if s.Capabilities != nil {
		lsc.Capabilities = &rt.Capability{}
		for _, c := range s.Capabilities.Add {
			if !k.hostHas(string(c)) {
				// The runtime cannot grant what it lacks (runc: "unable
				// to apply caps"); a node's root has every capability.
				t.Logf("the test's machine lacks CAP_%s (not in its bounding set): the container runs without it", c)
				continue
			}
			lsc.Capabilities.AddCapabilities = append(lsc.Capabilities.AddCapabilities, string(c))
		}
		for _, c := range s.Capabilities.Drop {
			lsc.Capabilities.DropCapabilities = append(lsc.Capabilities.DropCapabilities, string(c))
		}
	}
	if s.RunAsUser != nil {
		lsc.RunAsUser = &rt.Int64Value{Value: *s.RunAsUser}
	}
	if s.AllowPrivilegeEscalation != nil {
		lsc.NoNewPrivs = !*s.AllowPrivilegeEscalation
	}
	if o := s.SELinuxOptions; o != nil {
		lsc.SelinuxOptions = &rt.SELinuxOption{User: o.User, Role: o.Role, Type: o.Type, Level: o.Level}
	}
	profile := func(what string, p *corev1.SeccompProfile, a *corev1.AppArmorProfile) (*rt.SecurityProfile, string) {
		typ := ""
		if p != nil {
			typ = string(p.Type)
		} else if a != nil {
			typ = string(a.Type)
		}
		switch typ {
		case "", "RuntimeDefault":
			return &rt.SecurityProfile{ProfileType: rt.SecurityProfile_RuntimeDefault}, "runtime/default"
		case "Unconfined":
			// and the deprecated string containerd 1.6 reads too
			return &rt.SecurityProfile{ProfileType: rt.SecurityProfile_Unconfined}, "unconfined"
		}
		t.Fatalf("%s profile %s: the test's kubelet does not know it", what, typ)
		return nil, ""
	}
	lsc.Seccomp, lsc.SeccompProfilePath = profile("seccomp", s.SeccompProfile, nil)
	// kubelet reads the container's field, else the pod's deprecated
	// annotation (the chart's form before Kubernetes 1.30, and the static
	// manifests'), as its apparmor.GetProfile does.
	aa := s.AppArmorProfile
	if aa == nil {
		switch a, ok := tpl.Annotations[corev1.DeprecatedAppArmorBetaContainerAnnotationKeyPrefix+c.Name]; {
		case !ok:
		case a == corev1.DeprecatedAppArmorBetaProfileNameUnconfined:
			aa = &corev1.AppArmorProfile{Type: corev1.AppArmorProfileTypeUnconfined}
		case a == corev1.DeprecatedAppArmorBetaProfileRuntimeDefault:
			aa = &corev1.AppArmorProfile{Type: corev1.AppArmorProfileTypeRuntimeDefault}
		default:
			t.Fatalf("AppArmor annotation %q: the test's kubelet does not know it", a)
		}
	}
	lsc.Apparmor, lsc.ApparmorProfile = profile("AppArmor", nil, aa)
	if !lsc.Privileged {
		lsc.MaskedPaths, lsc.ReadonlyPaths = maskedPaths, readonlyPaths
	}

	// Resources, as kubelet's generateLinuxContainerResources (cgroup v1
	// names; the runtime writes the v2 ones on a v2 node).
	res := &rt.LinuxContainerResources{CpuPeriod: 100000}
	if cpu, ok := c.Resources.Requests[corev1.ResourceCPU]; ok {
		res.CpuShares = max(2, cpu.MilliValue()*1024/1000)
	} else {
		res.CpuShares = 2
	}
	if cpu, ok := c.Resources.Limits[corev1.ResourceCPU]; ok {
		res.CpuQuota = cpu.MilliValue() * 100000 / 1000
	}
	if mem, ok := c.Resources.Limits[corev1.ResourceMemory]; ok {
		res.MemoryLimitInBytes = mem.Value()
	}
	// A system-node-critical pod's score is a guaranteed pod's; the
	// runtime keeps it no lower than its own (restrict_oom_score_adj).
	res.OomScoreAdj = 1000
	if spec.PriorityClassName == "system-node-critical" || spec.PriorityClassName == "system-cluster-critical" {
		res.OomScoreAdj = -997
	} else if mem, ok := c.Resources.Requests[corev1.ResourceMemory]; ok {
		res.OomScoreAdj = min(999, max(3, 1000-1000*mem.Value()/memTotal(t)))
	}

	cc := &rt.ContainerConfig{
		Metadata: &rt.ContainerMetadata{Name: c.Name},
		Image:    &rt.ImageSpec{Image: c.Image},
		Command:  exp(c.Command),
		Args:     exp(c.Args),
		Envs:     envs,
		Mounts:   k.mounts(spec, c),
		Labels: map[string]string{"io.kubernetes.container.name": c.Name, "io.kubernetes.pod.name": sc.Metadata.Name,
			"io.kubernetes.pod.namespace": sc.Metadata.Namespace, "io.kubernetes.pod.uid": sc.Metadata.Uid},
		LogPath: filepath.Join(c.Name, "0.log"),
		Linux:   &rt.LinuxContainerConfig{Resources: res, SecurityContext: lsc},
	}
	return cc
}

// capNumbers are the capabilities the chart adds, by number.
var capNumbers = map[string]uint{"CHOWN": 0, "DAC_OVERRIDE": 1, "DAC_READ_SEARCH": 2, "FOWNER": 3, "KILL": 5,
	"NET_BIND_SERVICE": 10, "NET_ADMIN": 12, "NET_RAW": 13, "IPC_LOCK": 14, "SYS_CHROOT": 18, "SYS_PTRACE": 19,
	"SYS_ADMIN": 21, "SYS_RESOURCE": 24, "PERFMON": 38, "BPF": 39}

// hostHas says whether the capability is in the test process's bounding
// set, where the runtime takes its containers' from.
func (k *kubelet) hostHas(name string) bool {
	t := k.t
	n, ok := capNumbers[name]
	if !ok {
		t.Fatalf("capability %s: add its number to capNumbers", name)
	}
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	var bnd uint64
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "CapBnd:"); ok {
			if bnd, err = strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil {
				t.Fatal(err)
			}
		}
	}
	return bnd&(1<<n) != 0
}

// memTotal is the node's memory (kubelet's capacity), for the OOM score.
func memTotal(t *testing.T) int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	var kb int64
	if _, err := fmt.Sscanf(string(b), "MemTotal: %d kB", &kb); err != nil {
		t.Fatalf("/proc/meminfo: %v", err)
	}
	return kb << 10
}

// mounts are the container's mounts: hostPath volumes as they are (made
// for DirectoryOrCreate, required for Directory), ConfigMap volumes
// written as kubelet's atomic writer lays them out (testutil.ConfigMapDir) (a subPath mounts the
// file the key resolves to), and the termination log kubelet adds.
func (k *kubelet) mounts(spec corev1.PodSpec, c corev1.Container) []*rt.Mount {
	t := k.t
	t.Helper()
	vols := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		vols[v.Name] = v
	}
	var out []*rt.Mount
	for _, m := range c.VolumeMounts {
		v, ok := vols[m.Name]
		if !ok {
			t.Fatalf("volumeMount %s: no such volume", m.Name)
		}
		mt := &rt.Mount{ContainerPath: m.MountPath, Readonly: m.ReadOnly, Propagation: rt.MountPropagation_PROPAGATION_PRIVATE}
		if p := m.MountPropagation; p != nil {
			switch *p {
			case corev1.MountPropagationHostToContainer:
				mt.Propagation = rt.MountPropagation_PROPAGATION_HOST_TO_CONTAINER
			case corev1.MountPropagationBidirectional:
				mt.Propagation = rt.MountPropagation_PROPAGATION_BIDIRECTIONAL
			}
		}
		switch {
		case v.HostPath != nil:
			mt.HostPath = v.HostPath.Path
			typ := corev1.HostPathUnset
			if v.HostPath.Type != nil {
				typ = *v.HostPath.Type
			}
			switch typ {
			case corev1.HostPathDirectoryOrCreate:
				if err := os.MkdirAll(mt.HostPath, 0o755); err != nil {
					t.Fatal(err)
				}
			case corev1.HostPathDirectory:
				if st, err := os.Stat(mt.HostPath); err != nil || !st.IsDir() {
					t.Fatalf("volume %s: hostPath %s is no directory (kubelet would not start the pod): %v", v.Name, mt.HostPath, err)
				}
			default:
				t.Fatalf("volume %s: hostPath type %q: teach the test's kubelet", v.Name, typ)
			}
		case v.ConfigMap != nil:
			cm, ok := k.configMaps[v.ConfigMap.Name]
			if !ok {
				t.Fatalf("volume %s: the chart makes no ConfigMap %s", v.Name, v.ConfigMap.Name)
			}
			dir, ok := k.cmDirs[v.Name]
			if !ok {
				w := testutil.NewConfigMapDir(t)
				w.Write(cm.Data)
				dir = w.Dir
				k.cmDirs[v.Name] = dir
			}
			mt.HostPath, mt.Readonly = dir, true // kubelet mounts API data read-only
			if m.SubPath != "" {
				p, err := filepath.EvalSymlinks(filepath.Join(dir, m.SubPath))
				if err != nil {
					t.Fatalf("volume %s: subPath %s: %v", v.Name, m.SubPath, err)
				}
				mt.HostPath = p
			}
		default:
			t.Fatalf("volume %s: a kind the test's kubelet does not mount: teach it", v.Name)
		}
		out = append(out, mt)
	}
	// The termination log (terminationMessagePath), a file of the pod's.
	tl := filepath.Join(k.podDir, "containers", c.Name, "termination-log")
	if err := os.MkdirAll(filepath.Dir(tl), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tl, nil, 0o666); err != nil {
		t.Fatal(err)
	}
	path := c.TerminationMessagePath
	if path == "" {
		path = corev1.TerminationMessagePathDefault
	}
	out = append(out, &rt.Mount{ContainerPath: path, HostPath: tl})
	return out
}
