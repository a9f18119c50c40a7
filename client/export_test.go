// SPDX-License-Identifier: Apache-2.0

package client

// SetAfterDial makes f run between a reconnect's dial and its attach.
func SetAfterDial(c *Client, f func()) { c.afterDial = f }
