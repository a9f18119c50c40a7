// SPDX-License-Identifier: Apache-2.0

package proxyclaim

import "testing"

func TestIs(t *testing.T) {
	for k, want := range map[string]bool{
		// Every spelling an upstream may read as the same variable.
		"X-Forwarded-For": true, "x-forwarded-for": true, "X_FORWARDED_FOR": true, "x_Forwarded-for": true,
		"X-Forwarded-Scheme": true, "X-Forwarded-Ssl": true, "X-Forwarded-Port": true, "X-Forwarded-Prefix": true,
		"X-Forwarded-Anything-New": true, "X-Forwarded": true, "Forwarded": true, "Forwarded-For": true,
		"X-Real-Ip": true, "X-REAL-IP": true, "Client-Ip": true, "X-Client-Ip": true, "True-Client-Ip": true,
		"X-Cluster-Client-Ip": true, "X-Scheme": true, "X-Url-Scheme": true, "Front-End-Https": true,
		// Not claims.
		"X-Forwarded-": false, "X-Forwardedness": false, "Forwarded-By-Me": false, "X-Real": false,
		"Fairshare-Project": false, "Host": false, "X-Scheme2": false, "": false, "Scheme": false,
	} {
		if got := Is(k); got != want {
			t.Errorf("Is(%q) = %v, want %v", k, got, want)
		}
	}
}

func TestFold(t *testing.T) {
	for k, want := range map[string]string{"Fairshare_Project": "fairshare-project", "X-A_b": "x-a-b", "": "", "é_A": "é-a"} {
		if got := Fold(k); got != want {
			t.Errorf("Fold(%q) = %q, want %q", k, got, want)
		}
		if !FoldEq(k, want) {
			t.Errorf("FoldEq(%q, %q) = false", k, want)
		}
	}
	if FoldEq("X-A", "x-b") || FoldEq("X-A", "x-a-") {
		t.Error("FoldEq matched different names")
	}
}

func TestIsAllocatesNothing(t *testing.T) {
	if n := testing.AllocsPerRun(100, func() { _ = Is("X_Forwarded_Scheme") || Is("Accept-Encoding") }); n != 0 {
		t.Errorf("Is allocates %v times", n)
	}
}

func TestFramingAlias(t *testing.T) {
	for k, want := range map[string]bool{
		"Transfer_Encoding": true, "content_length": true, "CONTENT_LENGTH": true, "Keep_Alive": true,
		"Proxy_Connection": true, "proxy_connection": true,
		// The fields themselves are the proxy's to handle; near names frame nothing.
		"Transfer-Encoding": false, "Content-Length": false, "Connection": false, "Content_Length_": false,
		"X_Content_Length": false, "Content_Type": false, "_": false, "": false,
	} {
		if got := FramingAlias(k); got != want {
			t.Errorf("FramingAlias(%q) = %v, want %v", k, got, want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = FramingAlias("Transfer_Encoding") || FramingAlias("Accept_Encoding") }); n != 0 {
		t.Errorf("FramingAlias allocates %v times", n)
	}
}
