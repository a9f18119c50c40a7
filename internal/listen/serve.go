// SPDX-License-Identifier: Apache-2.0

package listen

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"time"
)

// ServeHTTP serves srv on ln until ctx is done, then shuts srv down: ln is
// closed at once, idle connections are closed, and the requests in flight
// have up to grace to finish; the connections left then are closed (their
// requests' contexts end). It returns the error that ended Serve before
// ctx was done, or the error of a shutdown that ran out of grace.
func ServeHTTP(ctx context.Context, srv *http.Server, ln net.Listener, grace time.Duration) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := srv.Shutdown(sctx)
	<-errc
	if err != nil {
		_ = srv.Close()
		return fmt.Errorf("shutting down: %w", err)
	}
	return nil
}
