// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/pace"
	"github.com/fairshare-dev/fairshare/pools"
)

// A refusal's retry_after_ms is within the documented cap (maxRetry), and
// its message says that same value. Before, a slot at the horizon plus its
// jitter gave up to 65 s (64119 was seen) while the message said "retry
// after 1m0s", the pool's estimate.
func TestRetryHintOneValueWithinCap(t *testing.T) {
	s := &Server{pacer: pace.New(maxRetry)}
	for i := range 2000 {
		rf := &pools.Refusal{Pool: "flights", Project: "p", Reason: pools.ReasonFull, RetryAfter: time.Minute,
			ReleaseRate: 0.1}
		var resp response
		s.refuse(nil, &resp, rf)
		if resp.RetryAfterMS < 1 || resp.RetryAfterMS > maxRetry.Milliseconds() {
			t.Fatalf("refusal %d: retry_after_ms %d, want 1..%d", i, resp.RetryAfterMS, maxRetry.Milliseconds())
		}
		want := fmt.Sprintf("retry after %v", time.Duration(resp.RetryAfterMS)*time.Millisecond)
		if !strings.HasSuffix(resp.Error, want) {
			t.Fatalf("refusal %d: message %q, want it to end with %q (retry_after_ms %d)", i, resp.Error, want, resp.RetryAfterMS)
		}
	}
}
