// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"context"
	"errors"
	"io"
)

// RunConnections runs the connections drill.
func RunConnections(ctx context.Context, cfg Config, loopCmd []string) (*Report, error) {
	return nil, errors.New("not implemented yet")
}

// ConnectLoop is the load generator of the connections drill.
func ConnectLoop(ctx context.Context, in io.Reader, out io.Writer) error {
	return errors.New("not implemented yet")
}
