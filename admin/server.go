// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/internal/logrl"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/policy"
)

// ErrInUse means another daemon already answers on the socket.
var ErrInUse = errors.New("admin socket is in use by a running daemon")

// ErrNotFound is what a Backend returns for a project with no stored policy.
var ErrNotFound = errors.New("no policy stored for this project")

// Backend is what the server exposes; the daemon implements it.
type Backend interface {
	Status(ctx context.Context) (Status, error)
	Policies() ([]Entry, error)
	// Policy is the project's policy in force, and where it comes from.
	Policy(project string) (Entry, bool, error)
	// PatchPolicy must store durably and apply before it returns.
	PatchPolicy(project string, pt policy.Patch) (policy.Policy, error)
	DeletePolicy(project string) (bool, error)
	// Projects is the membership: members by source, refusals, namespaces.
	Projects(ctx context.Context) (Membership, error)
	// Register registers cgroups for project (stored, then applied; see
	// Registration.Pending); Unregister removes some, or all with none
	// given. Refused registrations wrap membership.ErrRefused, bad input
	// ErrInvalid, a cgroup not registered policy.ErrNotRegistered.
	Register(ctx context.Context, project string, cgroups []string) (Registration, error)
	Unregister(ctx context.Context, project string, cgroups []string) (Registration, error)
}

// ErrInvalid is what a Backend wraps for a request it cannot take as
// given: a cgroup path that is no cgroup, say. It is answered 400.
var ErrInvalid = errors.New("invalid request")

// Listen creates the socket at path, mode 0600 from its first moment. A
// missing directory is created 0711 (package internal/listen: the permit and
// front sockets may share it). A stale socket file (no one answers) is
// replaced; a live one is ErrInUse, so two daemons never fight over one
// socket; any other file at the path is left alone and refused, named in
// the error.
func Listen(path string) (net.Listener, error) {
	ln, _, err := listen.Unix(path, 0o600, -1)
	if errors.Is(err, listen.ErrInUse) {
		return nil, fmt.Errorf("%w: %s", ErrInUse, path)
	}
	if err != nil {
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	return ln, nil
}

type peerKey struct{}

// Server serves the v1 API for a Backend.
type Server struct {
	b   Backend
	log *slog.Logger
	mux *http.ServeMux

	streams atomic.Int32 // open streams of GET /v1/events
	// stopping is closed when Serve begins to shut down: a stream that
	// follows the events ends then, rather than hold the shutdown for its
	// grace and fail it.
	stopping chan struct{}
	stopOnce sync.Once
}

// NewServer returns the API handler for b.
func NewServer(b Backend, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{b: b, log: log, mux: http.NewServeMux(), stopping: make(chan struct{})}
	s.mux.HandleFunc("GET /v1/health", s.health)
	s.mux.HandleFunc("GET /v1/status", s.status)
	s.mux.HandleFunc("GET /v1/policies", s.listPolicies)
	s.mux.HandleFunc("GET /v1/policies/{project}", s.getPolicy)
	s.mux.HandleFunc("PATCH /v1/policies/{project}", s.patchPolicy)
	s.mux.HandleFunc("DELETE /v1/policies/{project}", s.deletePolicy)
	s.mux.HandleFunc("GET /v1/projects", s.projects)
	s.mux.HandleFunc("POST /v1/projects/{project}", s.register)
	s.mux.HandleFunc("DELETE /v1/projects/{project}", s.unregister)
	s.mux.HandleFunc("GET /v1/events", s.events)
	return s
}

// ServeHTTP checks the peer recorded by Serve, then routes.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	peer, ok := r.Context().Value(peerKey{}).(peercred.Cred)
	if !ok || peer.UID != 0 {
		s.log.Warn("admin api refused a non-root peer", "uid", peer.UID, "pid", peer.PID, "known", ok)
		writeError(w, http.StatusForbidden, "the admin api accepts only root")
		return
	}
	s.mux.ServeHTTP(w, r)
}

// Serve answers on ln until ctx is done, then shuts down gracefully.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	// Timeouts: the CLI sends one small request per connection and reads
	// one answer; a peer that holds a connection open without doing so is
	// closed, so idle connections cannot pile up against the listener's cap.
	hs := &http.Server{
		Handler:           s,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       30 * time.Second,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			peer, err := peercred.Of(c)
			if err != nil {
				s.log.Warn("admin api could not read peer credentials", "err", err)
				return ctx // no credentials: ServeHTTP refuses
			}
			return context.WithValue(ctx, peerKey{}, peer)
		},
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	hs.RegisterOnShutdown(func() { s.stopOnce.Do(func() { close(s.stopping) }) })
	if err := listen.ServeHTTP(ctx, hs, ln, 2*time.Second); err != nil {
		return fmt.Errorf("admin api: %w", err)
	}
	return nil
}

// Versioner is a Backend that knows its version without a read of its
// status: the health check then reads nothing else, so a status that fails
// (a map the kernel will not read, an undecodable stored policy) does not
// make every policy and project command, the one that would mend it
// included, take the daemon for one that does not answer.
type Versioner interface {
	Version() string
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	if v, ok := s.b.(Versioner); ok {
		writeJSON(w, http.StatusOK, map[string]any{"ok": true, "version": v.Version()})
		return
	}
	st, err := s.b.Status(r.Context())
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"ok": true, "version": st.Version})
}

func (s *Server) status(w http.ResponseWriter, r *http.Request) {
	st, err := s.b.Status(r.Context())
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, st)
}

func (s *Server) listPolicies(w http.ResponseWriter, _ *http.Request) {
	list, err := s.b.Policies()
	if err != nil {
		s.fail(w, err)
		return
	}
	if list == nil {
		list = []Entry{}
	}
	writeJSON(w, http.StatusOK, list)
}

func (s *Server) getPolicy(w http.ResponseWriter, r *http.Request) {
	project := r.PathValue("project")
	if err := policy.ValidateProject(project); err != nil {
		s.fail(w, err)
		return
	}
	e, found, err := s.b.Policy(project)
	if err != nil {
		s.fail(w, err)
		return
	}
	if !found {
		s.fail(w, fmt.Errorf("%w: %s", ErrNotFound, project))
		return
	}
	writeJSON(w, http.StatusOK, e)
}

// decodeBody decodes the JSON value that is the whole of body, at most
// limit bytes, into v, refusing fields v does not have. A body past limit,
// and anything after the value, is refused, rather than decoded in part
// ("unexpected EOF") or ignored.
func decodeBody(body io.Reader, limit int64, v any) error {
	b, err := io.ReadAll(io.LimitReader(body, limit+1))
	if err != nil {
		return err
	}
	if int64(len(b)) > limit {
		return fmt.Errorf("longer than %d bytes", limit)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("more after the JSON value")
	}
	return nil
}

func (s *Server) patchPolicy(w http.ResponseWriter, r *http.Request) {
	project := r.PathValue("project")
	var pt policy.Patch
	if err := decodeBody(r.Body, 1<<16, &pt); err != nil {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("the request body is not a policy patch: %v", err))
		return
	}
	if pt.Empty() {
		// Stored, it would be a copy of the default in force, which then
		// no longer followed scheduler.default_tier.
		writeError(w, http.StatusBadRequest, "the policy patch sets nothing")
		return
	}
	p, err := s.b.PatchPolicy(project, pt)
	if err != nil {
		s.fail(w, err)
		return
	}
	s.log.Info("policy set", "project", project, "tier", p.Tier, "shares", p.Shares,
		"requests_per_sec", p.RequestsPerSec, "work_per_sec", p.WorkPerSec, "connections_per_sec", p.ConnectionsPerSec, "accepts_per_sec", p.AcceptsPerSec, "enforce", p.Enforced(), logrl.Audit())
	writeJSON(w, http.StatusOK, Entry{Project: project, Policy: p})
}

func (s *Server) deletePolicy(w http.ResponseWriter, r *http.Request) {
	project := r.PathValue("project")
	found, err := s.b.DeletePolicy(project)
	if err != nil {
		s.fail(w, err)
		return
	}
	if !found {
		s.fail(w, fmt.Errorf("%w: %s", ErrNotFound, project))
		return
	}
	s.log.Info("policy deleted", "project", project, logrl.Audit())
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) projects(w http.ResponseWriter, r *http.Request) {
	m, err := s.b.Projects(r.Context())
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, m)
}

func (s *Server) register(w http.ResponseWriter, r *http.Request) {
	project := r.PathValue("project")
	var req RegisterRequest
	if err := decodeBody(r.Body, 1<<20, &req); err != nil {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("the request body is not a registration: %v", err))
		return
	}
	reg, err := s.b.Register(r.Context(), project, req.Cgroups)
	if err != nil {
		s.fail(w, err)
		return
	}
	if len(reg.Added) > 0 {
		s.log.Info("cgroups registered", "project", project, "cgroups", reg.Added, "pending", reg.Pending)
	}
	writeJSON(w, http.StatusOK, reg)
}

// unregister takes the cgroups to remove as repeated ?cgroup= parameters;
// none removes every registration of the project.
func (s *Server) unregister(w http.ResponseWriter, r *http.Request) {
	project := r.PathValue("project")
	reg, err := s.b.Unregister(r.Context(), project, r.URL.Query()["cgroup"])
	if err != nil {
		s.fail(w, err)
		return
	}
	s.log.Info("registrations removed", "project", project, "cgroups", reg.Removed, "pending", reg.Pending)
	writeJSON(w, http.StatusOK, reg)
}

func (s *Server) fail(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, policy.ErrInvalid), errors.Is(err, policy.ErrBadProject), errors.Is(err, ErrInvalid):
		writeError(w, http.StatusBadRequest, err.Error())
	case errors.Is(err, membership.ErrRefused):
		writeError(w, http.StatusConflict, err.Error())
	case errors.Is(err, ErrNotFound), errors.Is(err, policy.ErrNotRegistered):
		writeError(w, http.StatusNotFound, err.Error())
	case errors.Is(err, policy.ErrFromFile):
		writeError(w, http.StatusConflict, err.Error())
	default:
		s.log.Error("admin api", "err", err)
		writeError(w, http.StatusInternalServerError, err.Error())
	}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v) // the peer hung up; nothing to do
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]string{"error": msg})
}
