// SPDX-License-Identifier: Apache-2.0

// Package config reads, defaults and validates the daemon's YAML configuration.
//
// The defaults are embedded (default.yaml, documented key by key) and are what
// Default returns; a user file is decoded on top of them, so a file only names
// what it changes. Decoding is strict: an unknown key is an error, and every
// validation error names the offending field by its YAML path
// ("pools.requests.size must be > 0", "front.trusted_peers[1]: ..."). Every
// value is checked here, not when the daemon builds its parts: addresses and
// CIDRs parse, project names follow the one rule of internal/project, cgroup
// paths are clean, numbers have their signs. A floor of 0 stands for the
// default (5% of the size), which pools.EffectiveFloor resolves. Flags and
// FAIRSHARE_* environment variables override the file; that layering lives
// in cmd/fairshare, not here.
//
// Pools are named. The four the product knows (requests, connections, residents,
// flights) exist by default; any other name under pools: adds a plain pool with
// the same fair-share rule. "connections" is the pool the kernel enforces, and
// so is a pool with destinations (Pool.Destinations): a destination pool,
// counting the connects to those destinations on top of the connections pool
// (docs/destination-pools.md; the destinations' syntax and overlap rule are
// package internal/destination's).
package config
