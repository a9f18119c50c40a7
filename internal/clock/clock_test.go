// SPDX-License-Identifier: Apache-2.0

package clock

import (
	"testing"
	"time"
)

type fixed time.Time

func (f fixed) Now() time.Time { return time.Time(f) }

func TestOr(t *testing.T) {
	at := time.Unix(42, 0)
	if got := Or(fixed(at)).Now(); !got.Equal(at) {
		t.Errorf("Or kept %v, want %v", got, at)
	}
	before := time.Now()
	if got := Or(nil).Now(); got.Before(before) || time.Since(got) > time.Minute {
		t.Errorf("Or(nil) read %v, not the system clock (%v)", got, before)
	}
}
