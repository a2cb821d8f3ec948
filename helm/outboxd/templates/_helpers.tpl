{{- define "outboxd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "outboxd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "outboxd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outboxd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "outboxd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "outboxd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "outboxd.secretName" -}}
{{- default (include "outboxd.fullname" .) .Values.existingSecret -}}
{{- end -}}

{{- define "outboxd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "outboxd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "outboxd.monitoringApi" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/*
The [[sources]] tables of .Values.sources, as TOML. Values are written with
toJson: a JSON string, number, boolean or array of them is valid TOML.
*/}}
{{- define "outboxd.sources" -}}
{{- range $src := .Values.sources }}
[[sources]]
name = {{ required "every entry of sources needs a name" $src.name | toJson }}
{{- if hasKey $src "required" }}
required = {{ $src.required | toJson }}
{{- end }}
{{- with $src.mode }}
mode = {{ . | toJson }}
{{- end }}
{{- with $src.weight }}
weight = {{ . | toJson }}
{{- end }}
{{- range $section := list "postgres" "columns" "routing" "polling" "kafka" }}
{{- with index $src $section }}
[sources.{{ $section }}]
{{- range $k, $v := . }}
{{- if not (or (kindIs "map" $v) (and (kindIs "slice" $v) (gt (len $v) 0) (kindIs "map" (first $v)))) }}
{{ $k }} = {{ $v | toJson }}
{{- end }}
{{- end }}
{{- range $k, $v := . }}
{{- if kindIs "map" $v }}
[sources.{{ $section }}.{{ $k }}]
{{- range $k2, $v2 := $v }}
{{ $k2 }} = {{ $v2 | toJson }}
{{- end }}
{{- end }}
{{- end }}
{{- range $k, $v := . }}
{{- if and (kindIs "slice" $v) (gt (len $v) 0) (kindIs "map" (first $v)) }}
{{- range $item := $v }}
[[sources.{{ $section }}.{{ $k }}]]
{{- range $k2, $v2 := $item }}
{{ $k2 }} = {{ $v2 | toJson }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The number of pods: `replicas`, else the older `replicaCount`.
*/}}
{{- define "outboxd.replicas" -}}
{{- if kindIs "invalid" .Values.replicas }}{{ .Values.replicaCount }}{{ else }}{{ .Values.replicas }}{{ end }}
{{- end }}

{{/*
Whether the pods share the sources through a Kafka consumer group
(docs/sources.md, "Several replicas"): several pods and several sources.
*/}}
{{- define "outboxd.coordinated" -}}
{{- if and (gt (int (include "outboxd.replicas" .)) 1) (gt (len .Values.sources) 1) .Values.coordination.enabled }}true{{ end }}
{{- end }}

{{/*
The [coordination] section of a coordinated release.
*/}}
{{- define "outboxd.coordination" -}}
[coordination]
group = {{ .Values.coordination.group | default (printf "outboxd.%s.%s" .Release.Namespace (include "outboxd.fullname" .)) | toJson }}
replica = "${POD_NAME}"
session_timeout = {{ .Values.coordination.sessionTimeout | toJson }}
heartbeat_interval = {{ .Values.coordination.heartbeatInterval | toJson }}
{{- end }}
