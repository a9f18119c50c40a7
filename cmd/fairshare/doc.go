// SPDX-License-Identifier: Apache-2.0

// Command fairshare is the fair-share limiter's daemon and CLI.
package main
