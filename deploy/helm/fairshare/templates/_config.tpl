{{/*
fairshare.config is the daemon's configuration file, extraConfig merged
over it (when set, the file is the merge written as YAML, without these
comments).
*/}}
{{- define "fairshare.config" -}}
{{- $conf := include "fairshare.configText" . }}
{{- with .Values.extraConfig }}
{{- if not (kindIs "map" .) }}
{{- fail (printf "extraConfig: a map of the daemon's configuration keys (docs/configuration.md), got %v" .) }}
{{- end }}
{{- $conf = toYaml (mergeOverwrite (fromYaml $conf) (deepCopy .)) }}
{{- end }}
{{- $conf }}
{{- end }}

{{- define "fairshare.configText" -}}
state_dir: /var/lib/fairshare
pin_dir: {{ .Values.pinDir }}
admin_socket: /run/fairshare/admin.sock
policies_file: /etc/fairshare/policies/policies.yaml
permits:
  socket: /run/fairshare/permits.sock
metrics:
  max_projects: {{ .Values.metrics.maxProjects }}
pools:
  {{- range $name, $p := .Values.pools }}
  {{ $name }}: {size: {{ $p.size }}, floor: {{ $p.floor | default 0 }}{{ if hasKey $p "enforce" }}, enforce: {{ if include "fairshare.false" $p.enforce }}false{{ else }}true{{ end }}{{ end }}{{ with $p.window }}, window: {{ . | quote }}{{ end }}{{ if include "fairshare.true" (list (printf "pools.%s.fleet" $name) $p.fleet) }}, fleet: true{{ end }}{{ with $p.destinations }}, destinations: {{ toJson . }}{{ end }}}
  {{- end }}
# The node's pods are the projects' members (each in its namespace's project,
# or its project label's), besides cgroups registered with 'fairshare project add'.
projects:
  sources: [kubernetes, registered]
kubernetes:
  runtime_endpoint: /run/fairshare-cri/{{ base (include "fairshare.socket" .) }}
  project_label: {{ .Values.kubernetes.projectLabel | quote }}
  namespace_projects: {{ include "fairshare.bool" (list "kubernetes.namespaceProjects" .Values.kubernetes.namespaceProjects true) }}
  system_namespaces: {{ .Values.kubernetes.systemNamespaces | toJson }}
  pod_cgroups: {{ .Values.kubernetes.podCgroups | toJson }}
connections:
  max_netns: {{ .Values.connections.maxNetns }}
  max_netns_per_project: {{ .Values.connections.maxNetnsPerProject }}
  lapse_after: {{ .Values.connections.lapseAfter | quote }}
  limit_host_network_pods: {{ include "fairshare.bool" (list "connections.limitHostNetworkPods" .Values.connections.limitHostNetworkPods) }}
{{- with .Values.fleet }}
{{- if .etcd }}
# Fleet pools through etcd; the node's name in the fleet is its host name
# (the pod has the node's: host network), fleet.node being unset.
fleet:
  etcd: {{ .etcd | toJson }}
  prefix: {{ .prefix | quote }}
  safe_fraction: {{ .safeFraction }}
  {{- with .leaseTTL }}
  lease_ttl: {{ . | quote }}
  {{- end }}
  {{- with .period }}
  period: {{ . | quote }}
  {{- end }}
  {{- if .tlsSecret }}
  tls: {ca: /etc/fairshare/fleet-tls/ca.crt, cert: /etc/fairshare/fleet-tls/tls.crt, key: /etc/fairshare/fleet-tls/tls.key}
  {{- end }}
{{- end }}
{{- end }}
{{- end }}
