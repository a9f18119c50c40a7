// SPDX-License-Identifier: Apache-2.0

package answerfield

import "testing"

func TestReserved(t *testing.T) {
	for name, reserved := range map[string]bool{
		"Content-Length": true, "content-type": true, "CONTENT-ENCODING": true, "Transfer-Encoding": true,
		"keep-alive": true, "Upgrade": true, "te": true, "Date": true, "date": true,
		"Fairshare-Class": true, "fairshare-queue-wait": true, "Fairshare-Refused": true,
		"Fairshare-Work-Units": false, "X-Cost": false, "Contents": false, "Dated": false, "Content_Length": false,
	} {
		if why := Reserved(name); (why != "") != reserved {
			t.Errorf("Reserved(%q) = %q, want reserved %v", name, why, reserved)
		}
	}
}

func TestIsHopByHop(t *testing.T) {
	for _, k := range HopByHop() {
		if !IsHopByHop(k) {
			t.Errorf("%s", k)
		}
	}
	if IsHopByHop("keep-alive") || IsHopByHop("Content-Length") {
		t.Error("IsHopByHop takes canonical keys and only the hop-by-hop ones")
	}
}
