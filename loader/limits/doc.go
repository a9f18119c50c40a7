// SPDX-License-Identifier: Apache-2.0

// Package limits holds the bounds of the kernel side's options
// (loader.Options): the one home of each, in a package that imports only
// package time, so that package config can check a file against them
// without importing the loader and, through it, cilium/ebpf. The loader checks the
// same options against the same constants when it opens, so a file config
// accepts is one the loader accepts.
package limits
