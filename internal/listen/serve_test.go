// SPDX-License-Identifier: Apache-2.0

package listen

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// ServeHTTP lets a request in flight at shutdown finish within the grace,
// says when one outlives it, and returns a Serve error as it is.
func TestServeHTTP(t *testing.T) {
	for _, tc := range []struct {
		name      string
		hold      time.Duration // how long the request in flight takes
		grace     time.Duration
		wantErr   bool
		wantReply bool
	}{
		{"within grace", 100 * time.Millisecond, 5 * time.Second, false, true},
		{"past grace", 5 * time.Second, 50 * time.Millisecond, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			started := make(chan struct{})
			srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				close(started)
				select {
				case <-time.After(tc.hold):
				case <-r.Context().Done():
				}
				io.WriteString(w, "done")
			})}
			ctx, cancel := context.WithCancel(context.Background())
			served := make(chan error, 1)
			go func() { served <- ServeHTTP(ctx, srv, ln, tc.grace) }()
			// Its own transport, closed at the end: no descriptor of this
			// test outlives it (TestAcceptSurvivesEMFILE counts them).
			tr := &http.Transport{}
			defer tr.CloseIdleConnections()
			replied := make(chan bool, 1)
			go func() {
				resp, err := (&http.Client{Transport: tr}).Get("http://" + ln.Addr().String())
				if err != nil {
					replied <- false
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				replied <- string(b) == "done"
			}()
			<-started
			cancel()
			select {
			case err := <-served:
				if (err != nil) != tc.wantErr {
					t.Errorf("ServeHTTP = %v, want an error: %v", err, tc.wantErr)
				}
			case <-time.After(3 * time.Second):
				t.Fatal("ServeHTTP did not return after its grace")
			}
			srv.Close()
			if got := <-replied; got != tc.wantReply {
				t.Errorf("the request in flight answered: %v, want %v", got, tc.wantReply)
			}
		})
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	if err := ServeHTTP(context.Background(), &http.Server{}, ln, time.Second); !errors.Is(err, net.ErrClosed) {
		t.Errorf("serving a closed listener: %v", err)
	}
}
