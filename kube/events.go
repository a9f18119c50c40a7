// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	rt "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// ErrNoEvents means the runtime serves no container events over the CRI
// (containerd 1.6 answers GetContainerEvents with Unimplemented).
var ErrNoEvents = errors.New("the container runtime serves no container events")

// Events follows the runtime's container events (GetContainerEvents) and
// calls f with each until ctx is done (nil) or the stream fails: ErrNoEvents
// when the runtime does not have them, else the runtime's error. Each event
// of a pod sandbox has its id as both the container's and the sandbox's.
func (c *CRI) Events(ctx context.Context, f func(*rt.ContainerEventResponse)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.rs.GetContainerEvents(ctx, &rt.GetEventsRequest{})
	for err == nil {
		var ev *rt.ContainerEventResponse
		if ev, err = stream.Recv(); err == nil {
			f(ev)
		}
	}
	if ctx.Err() != nil {
		return nil
	}
	if status.Code(err) == codes.Unimplemented {
		return fmt.Errorf("%w (%s at %s)", ErrNoEvents, status.Convert(err).Message(), c.endpoint)
	}
	return fmt.Errorf("%w at %s: container events: %w", ErrRuntime, c.endpoint, err)
}

// Version returns the runtime's name and version ("containerd", "v2.4.2").
func (c *CRI) Version(ctx context.Context) (name, version string, err error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	v, err := c.rs.Version(ctx, &rt.VersionRequest{})
	if err != nil {
		return "", "", fmt.Errorf("%w at %s: %w", ErrRuntime, c.endpoint, err)
	}
	return v.RuntimeName, v.RuntimeVersion, nil
}

// EventsShared says why the runtime's container events must not be
// followed ("" when they may): containerd before 2.0 (issue 7318 of
// containerd) and CRI-O give each event to one reader of a queue all the
// readers share, so a second reader would take events away from kubelet's
// evented PLEG. containerd 2.0 gives every reader every event. A runtime
// not known to do so is not followed either; the pods are polled then.
func EventsShared(name, version string) string {
	if name != "containerd" {
		return fmt.Sprintf("%s %s is not known to give every reader of its container events every event", name, version)
	}
	v := strings.TrimPrefix(version, "v")
	major, err := strconv.Atoi(v[:strings.IndexFunc(v+".", func(r rune) bool { return r < '0' || r > '9' })])
	if err != nil {
		return fmt.Sprintf("containerd's version %q is not one this daemon reads", version)
	}
	if major < 2 {
		return fmt.Sprintf("containerd %s gives each container event to one reader only, and kubelet may be one (containerd 2.0 gives them to every reader)", version)
	}
	return ""
}
