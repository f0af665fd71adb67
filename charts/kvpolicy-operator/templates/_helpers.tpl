{{/* Full name of the release's objects, at most 63 characters (a DNS label). */}}
{{- define "kvpolicy-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpolicy-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpolicy-operator.labels" -}}
{{ include "kvpolicy-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: kvpolicy
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The Lease the replicas elect their leader with (coordination.k8s.io, in the release namespace). */}}
{{- define "kvpolicy-operator.leaseName" -}}
{{- printf "%s-leader" (include "kvpolicy-operator.fullname" . | trunc 56 | trimSuffix "-") -}}
{{- end -}}

{{- define "kvpolicy-operator.serviceAccountName" -}}
{{- default (include "kvpolicy-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/*
An image repository value ([repository, root context]): a full name (it has a "/") as it is, a bare name under
imageRegistry. No kvpolicy image is published, so a bare name without imageRegistry fails the install, saying so.
*/}}
{{- define "kvpolicy-operator.repository" -}}
{{- $repository := index . 0 -}}
{{- $root := index . 1 -}}
{{- if contains "/" $repository -}}
{{- $repository -}}
{{- else -}}
{{- $registry := required "imageRegistry is required: no kvpolicy image is published. Build and push the operator and FP8 serving images (README \"Images\"), then set imageRegistry=REGISTRY (or image.repository and probeImage.repository to full names)" $root.Values.imageRegistry -}}
{{- printf "%s/%s" (trimSuffix "/" $registry) $repository -}}
{{- end -}}
{{- end -}}

{{- define "kvpolicy-operator.image" -}}
{{- $repository := include "kvpolicy-operator.repository" (list .Values.image.repository .) -}}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The gate Jobs run `kvpolicy gate ...`, which the operator image contains: it is the default. */}}
{{- define "kvpolicy-operator.gateImage" -}}
{{- $repository := include "kvpolicy-operator.repository" (list (default .Values.image.repository .Values.gateImage.repository) .) -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.gateImage.tag -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{- define "kvpolicy-operator.probeImage" -}}
{{- $repository := include "kvpolicy-operator.repository" (list .Values.probeImage.repository .) -}}
{{- printf "%s:%s" $repository .Values.probeImage.tag -}}
{{- end -}}

{{/*
RBAC rules for the namespaced resources the operator reads and writes; the chart README justifies each verb.
Granted cluster-wide (ClusterRole) without watchNamespaces, or per namespace (Role) with it.
*/}}
{{- define "kvpolicy-operator.namespacedRules" -}}
- apiGroups: ["kvpolicy.dev"]
  resources: ["kvpolicies"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvpolicy.dev"]
  resources: ["kvpolicies/status"]
  verbs: ["patch"]
- apiGroups: ["kvpolicy.dev"]
  resources: ["kvpolicies/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["list", "watch", "create", "delete"]
# patch: a ReplicaRatio canary joins the users' Service by its running pods' labels (the pods the accuracy gate judged).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.targets.leaderWorkerSet.enabled }}
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
{{- if .Values.targets.llmInferenceService.enabled }}
- apiGroups: ["serving.kserve.io"]
  resources: ["llminferenceservices"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
{{- if or .Values.notifications.policySecrets .Values.auth.readReferencedSecrets }}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- end }}
{{- if .Values.gatewayAPI.enabled }}
# rollout.traffic InferencePool: the user's route is read and JSON-patched (its backendRefs only), the canary's pool
# created and deleted; InferencePools are listed to find the baseline's and one selecting a ReplicaRatio target.
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "patch"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["list", "create", "delete"]
{{- end }}
{{- if .Values.auth.readReferencedSecrets }}
# gates.latency.prometheusAuth may take a CA bundle from a ConfigMap.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get"]
{{- end }}
{{- end -}}

{{/* Cluster-scoped reads, needed in both modes. */}}
{{- define "kvpolicy-operator.clusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}
