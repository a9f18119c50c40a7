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
