// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestProjectSources(t *testing.T) {
	if got := Default().Projects.Sources; !slices.Equal(got, []string{"directory", "registered"}) {
		t.Fatalf("default sources %v", got)
	}
	for _, ok := range []string{"[directory]", "[systemd, registered]", "[registered]", "[registered, directory]", "[kubernetes, registered]"} {
		c := Default()
		if err := Parse(strings.NewReader("projects: {sources: "+ok+"}\n"), &c); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for bad, want := range map[string]string{
		"[]":                     "projects.sources must name at least one",
		"[kube]":                 `projects.sources: "kube" is not a source`,
		"[directory, directory]": "projects.sources names directory twice",
		"[directory, systemd]":   "choose one",
		"[Directory]":            `"Directory" is not a source`,
	} {
		c := Default()
		err := Parse(strings.NewReader("projects: {sources: "+bad+"}\n"), &c)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", bad, err, want)
		}
	}
}
