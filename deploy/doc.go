// SPDX-License-Identifier: Apache-2.0

// Package deploy holds what runs fairshare on a Kubernetes cluster: the Helm
// chart (helm/fairshare), the same manifests rendered with the chart's
// defaults (kubernetes/fairshare.yaml, for kubectl apply), and the image
// recipe (Dockerfile). It is a module of its own so that Helm and the
// Kubernetes API types stay out of the daemon's dependencies; its tests render
// the chart with Helm's Go library and decode every manifest into the
// Kubernetes API types, strictly.
//
// Regenerate kubernetes/fairshare.yaml after changing the chart, from the
// repository's root (this directory is a module of its own, so -C):
//
//	go test -C deploy -run TestStaticManifests . -update
package deploy
