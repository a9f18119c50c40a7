// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"syscall"
	"time"

	"github.com/fairshare-dev/fairshare/policy"
)

// ErrNoDaemon means nothing listens on the admin socket.
var ErrNoDaemon = errors.New("no daemon is listening on the admin socket")

// APIError is a non-2xx answer.
type APIError struct {
	Code    int
	Message string
}

// Error returns the server's sentence.
func (e *APIError) Error() string { return e.Message }

// Is lets callers test a 404 with errors.Is(err, ErrNotFound).
func (e *APIError) Is(target error) bool {
	return target == ErrNotFound && e.Code == http.StatusNotFound
}

// Client talks to the admin API over its unix socket.
type Client struct {
	socket string
	hc     *http.Client
}

// NewClient returns a client for the socket at path.
func NewClient(path string) *Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		},
		DisableKeepAlives: true,
	}
	return &Client{socket: path, hc: &http.Client{Transport: tr, Timeout: 10 * time.Second}}
}

// Health checks that a daemon answers.
func (c *Client) Health(ctx context.Context) error {
	return c.do(ctx, http.MethodGet, "/v1/health", nil, nil)
}

// Status fetches the daemon's status.
func (c *Client) Status(ctx context.Context) (Status, error) {
	var st Status
	err := c.do(ctx, http.MethodGet, "/v1/status", nil, &st)
	return st, err
}

// Policies lists stored policies.
func (c *Client) Policies(ctx context.Context) ([]Entry, error) {
	var list []Entry
	err := c.do(ctx, http.MethodGet, "/v1/policies", nil, &list)
	return list, err
}

// Policy fetches one project's policy; a missing one is ErrNotFound.
func (c *Client) Policy(ctx context.Context, project string) (Entry, error) {
	var e Entry
	err := c.do(ctx, http.MethodGet, "/v1/policies/"+url.PathEscape(project), nil, &e)
	return e, err
}

// PatchPolicy changes one project's policy and returns what is stored.
func (c *Client) PatchPolicy(ctx context.Context, project string, pt policy.Patch) (policy.Policy, error) {
	var e Entry
	err := c.do(ctx, http.MethodPatch, "/v1/policies/"+url.PathEscape(project), pt, &e)
	return e.Policy, err
}

// DeletePolicy removes one project's policy; a missing one is ErrNotFound.
func (c *Client) DeletePolicy(ctx context.Context, project string) error {
	return c.do(ctx, http.MethodDelete, "/v1/policies/"+url.PathEscape(project), nil, nil)
}

// Projects fetches the membership.
func (c *Client) Projects(ctx context.Context) (Membership, error) {
	var m Membership
	err := c.do(ctx, http.MethodGet, "/v1/projects", nil, &m)
	return m, err
}

// Register registers cgroups for project. A refusal is an *APIError with
// Code 409.
func (c *Client) Register(ctx context.Context, project string, cgroups []string) (Registration, error) {
	var reg Registration
	err := c.do(ctx, http.MethodPost, "/v1/projects/"+url.PathEscape(project), RegisterRequest{Cgroups: cgroups}, &reg)
	return reg, err
}

// Unregister removes registrations of project: those of cgroups, or all
// with none given. A cgroup not registered for it is ErrNotFound.
func (c *Client) Unregister(ctx context.Context, project string, cgroups []string) (Registration, error) {
	q := url.Values{"cgroup": cgroups}
	path := "/v1/projects/" + url.PathEscape(project)
	if len(cgroups) > 0 {
		path += "?" + q.Encode()
	}
	var reg Registration
	err := c.do(ctx, http.MethodDelete, path, nil, &reg)
	return reg, err
}

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		buf, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("encoding request: %w", err)
		}
		body = bytes.NewReader(buf)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://fairshare"+path, body)
	if err != nil {
		return fmt.Errorf("building request: %w", err)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return fmt.Errorf("%w (%s)", ErrNoDaemon, c.socket)
		}
		return fmt.Errorf("calling the daemon at %s: %w", c.socket, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return fmt.Errorf("reading the daemon's answer: %w", err)
	}
	if resp.StatusCode/100 != 2 {
		var e struct {
			Error string `json:"error"`
		}
		if json.Unmarshal(raw, &e) != nil || e.Error == "" {
			e.Error = fmt.Sprintf("the daemon answered %s", resp.Status)
		}
		return &APIError{Code: resp.StatusCode, Message: e.Error}
	}
	if out == nil || resp.StatusCode == http.StatusNoContent {
		return nil
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return fmt.Errorf("decoding the daemon's answer: %w", err)
	}
	return nil
}
