// SPDX-License-Identifier: Apache-2.0

// Package pools implements the fair-share rule that divides a node's bounded
// pools among the projects using it. (Specification to be written here.)
package pools
