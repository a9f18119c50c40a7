// SPDX-License-Identifier: Apache-2.0

package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fairshare-dev/fairshare/compare"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "compare:", err)
		os.Exit(1)
	}
}

func run() error {
	d := compare.Defaults()
	var systems, loads, seeds, jsonPath, svgPath string
	flag.IntVar(&d.Pool, "pool", d.Pool, "seats in the pool")
	flag.DurationVar(&d.Service, "service", d.Service, "how long each request holds its seat")
	flag.DurationVar(&d.Duration, "duration", d.Duration, "length of each run")
	flag.StringVar(&seeds, "seeds", "1,2,3", "comma-separated seeds, one run of each workload per seed")
	flag.StringVar(&systems, "systems", "", "comma-separated systems (default all: "+names()+")")
	flag.StringVar(&loads, "workloads", "", "comma-separated workloads (default all: "+strings.Join(compare.Workloads, ",")+")")
	flag.StringVar(&jsonPath, "json", os.Getenv("COMPARE_JSON"), "write the report as JSON here (default $COMPARE_JSON)")
	flag.StringVar(&svgPath, "svg", os.Getenv("COMPARE_SVG"), "draw the held permits of apf and fairshare on the onoff workload here (default $COMPARE_SVG)")
	quiet := flag.Bool("q", false, "no progress lines on stderr")
	overHTTP := flag.Bool("http", false, "compare the systems over HTTP instead ("+httpNames()+"): nginx and haproxy must be installed")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), `usage: compare [flags]

Runs the comparison of docs/compare.md in real time (real sleeps, the system
clock): every system on every workload, once per seed, one run at a time, and
prints the table. On a loaded machine the latencies carry its timer noise;
make compare runs the same code in virtual time.

`)
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	if d.Pool < 1 || d.Service <= 0 || d.Duration <= 0 {
		return fmt.Errorf("-pool, -service and -duration must be positive")
	}
	d.Seeds = nil
	for _, s := range split(seeds) {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return fmt.Errorf("-seeds: %q is not a number", s)
		}
		d.Seeds = append(d.Seeds, n)
	}
	if len(d.Seeds) == 0 {
		return fmt.Errorf("-seeds: none given")
	}
	d.Systems, d.Workloads = split(systems), split(loads)
	if *overHTTP && len(d.Systems) == 0 {
		for _, s := range compare.HTTPSchemes {
			d.Systems = append(d.Systems, s.Name)
		}
	}
	for _, s := range d.Systems {
		if _, err := compare.SchemeByName(s); err != nil {
			return fmt.Errorf("-systems: %w", err)
		}
	}
	for _, w := range d.Workloads {
		if _, err := compare.Build(w, time.Second, 1); err != nil {
			return fmt.Errorf("-workloads: %w", err)
		}
	}
	if svgPath != "" {
		for _, need := range []string{"apf", "fairshare"} {
			if *overHTTP || len(d.Systems) > 0 && !slices.Contains(d.Systems, need) {
				return fmt.Errorf("-svg plots apf and fairshare: -systems must include %s", need)
			}
		}
		if len(d.Workloads) > 0 && !slices.Contains(d.Workloads, "onoff") {
			return fmt.Errorf("-svg plots the onoff workload: -workloads must include it")
		}
	}
	if !*quiet {
		d.Progress = os.Stderr
	}
	rep, err := compare.Compare(d)
	if err != nil {
		return err
	}
	if err := rep.WriteTable(os.Stdout); err != nil {
		return err
	}
	if jsonPath != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return fmt.Errorf("encoding the report: %w", err)
		}
		if err := os.WriteFile(jsonPath, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("writing the report: %w", err)
		}
	}
	if svgPath != "" {
		f, err := os.Create(svgPath)
		if err != nil {
			return fmt.Errorf("writing the plot: %w", err)
		}
		if err := rep.WriteSVG(f, "onoff", []string{"apf", "fairshare"}); err != nil {
			f.Close()
			return fmt.Errorf("writing the plot: %w", err)
		}
		if err := f.Close(); err != nil {
			return fmt.Errorf("writing the plot: %w", err)
		}
	}
	return nil
}

func names() string {
	var n []string
	for _, s := range compare.Schemes {
		n = append(n, s.Name)
	}
	return strings.Join(n, ",")
}

func httpNames() string {
	var n []string
	for _, s := range compare.HTTPSchemes {
		n = append(n, s.Name)
	}
	return strings.Join(n, ",")
}

func split(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
