{{- define "fairshare.name" -}}fairshare{{- end -}}

{{- define "fairshare.labels" -}}
app.kubernetes.io/name: fairshare
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "fairshare.selector" -}}
app.kubernetes.io/name: fairshare
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fairshare.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
fairshare.false is "false" for a value that says false (false, or the
strings false, no, off, n in any case, as --set-string passes them), else
empty: a test with include.
*/}}
{{- define "fairshare.false" -}}
{{- if has (lower (toString .)) (list "false" "no" "off" "n") }}false{{ end }}
{{- end }}

{{/*
fairshare.true is "true" for a value that says true (true, or the strings
true, yes, on, y in any case, as --set-string and GitOps tools pass them),
empty for one that says false (false, no, off, n, "") or is not set; any
other value fails, naming the key. Call it with (list KEY VALUE) or
(list KEY VALUE DEFAULT), DEFAULT standing for a key that is not set. A
plain {{ if .Values.x }} is wrong for these: the string "false" is true.
*/}}
{{- define "fairshare.true" -}}
{{- $v := index . 1 }}
{{- if and (kindIs "invalid" $v) (gt (len .) 2) }}{{ $v = index . 2 }}{{ end }}
{{- $s := lower (toString $v) }}
{{- if has $s (list "true" "yes" "on" "y") }}true
{{- else if not (has $s (list "false" "no" "off" "n" "" "<nil>")) }}
{{- fail (printf "%s: true or false, got %v" (index . 0) $v) }}
{{- end }}
{{- end }}

{{/* fairshare.bool is fairshare.true written as YAML: true or false. */}}
{{- define "fairshare.bool" -}}
{{- if include "fairshare.true" . }}true{{ else }}false{{ end }}
{{- end }}

{{/*
fairshare.socket is kubernetes.runtimeSocket as a path on the node: the
unix:// of kubelet's --container-runtime-endpoint taken off. Anything but
an absolute path below a directory fails.
*/}}
{{- define "fairshare.socket" -}}
{{- $raw := toString .Values.kubernetes.runtimeSocket }}
{{- $p := trimPrefix "unix://" $raw }}
{{- if or (not (isAbs $p)) (contains "://" $p) (eq (dir (clean $p)) "/") }}
{{- fail (printf "kubernetes.runtimeSocket: the CRI socket's path on the node, /run/containerd/containerd.sock or unix:///run/containerd/containerd.sock, got %q" $raw) }}
{{- end }}
{{- clean $p }}
{{- end }}

{{/*
fairshare.valuesVersion is the layout of this chart's values. helm upgrade
--reuse-values renders a new chart with the values of the release's old
chart: its defaults, not this chart's, and none of the keys added since (a
nil pointer, or a fix of a default silently dropped). valuesVersion in
values.yaml says which layout the values come from; every template checks
it first. Bump both (and Chart.yaml's version) when a default changes or a
key is added: TestStaticManifests -update refuses to write otherwise.
*/}}
{{- define "fairshare.valuesVersion" -}}2{{- end -}}

{{- define "fairshare.checkValues" -}}
{{- $want := include "fairshare.valuesVersion" . }}
{{- if ne (toString .Values.valuesVersion) $want }}
{{- fail (printf "valuesVersion %v: these values come from another version of the fairshare chart (this one's is %s), as helm upgrade --reuse-values or a copied values.yaml gives them, with its defaults and without this chart's new keys. Upgrade with --reset-then-reuse-values (Helm 3.14 or later) or with -f of the output of 'helm get values' (without --all), and leave valuesVersion out of your values; see docs/kubernetes.md#upgrade" (.Values.valuesVersion | default "unset") $want) }}
{{- end }}
{{- end }}
