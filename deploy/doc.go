// SPDX-License-Identifier: Apache-2.0

// Package deploy holds what runs fairshare on a Kubernetes cluster: the Helm
// chart (helm/fairshare), the same manifests rendered with the chart's
// defaults (kubernetes/fairshare.yaml, for kubectl apply), and the image
// recipe (Dockerfile). It is a module of its own so that Helm and the
// Kubernetes API types stay out of the daemon's dependencies; its tests render
// the chart with Helm's Go library and decode every manifest into the
// Kubernetes API types, strictly. TestChartPodNeverRefused runs the chart's
// pod on a real containerd (the image built from the Dockerfile by hand,
// the pod through the CRI as kubelet would run it), with the daemon's test
// helpers from the main module (required through a replace of ../).
//
// Regenerate kubernetes/fairshare.yaml after changing the chart, from the
// repository's root (this directory is a module of its own, so -C):
//
//	go test -C deploy -run TestStaticManifests . -update
package deploy
