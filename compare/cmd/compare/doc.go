// SPDX-License-Identifier: Apache-2.0

// Command compare runs the comparison of docs/compare.md in real time:
// the same closed-loop workloads through fairshare and the admission
// schemes users would pick instead, with real sleeps and the system clock,
// printing the table of fairness, small-project latency, utilization,
// newcomer wait and refusals. make compare runs the same code in virtual
// time (a testing/synctest bubble), which a loaded machine cannot blur;
// this command shows what the schemes do on the machine at hand.
package main
