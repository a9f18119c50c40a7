# fairshare: see README.md. `make` lists the targets.
.DEFAULT_GOAL := help
SHELL := /usr/bin/env bash

# go from PATH, else where the archive from go.dev/dl is unpacked, else
# $(HOME)/go/bin: sudo's secure_path often leaves Go's directory out of PATH.
# GO=... on the command line or in the environment wins.
ifeq ($(origin GO),undefined)
GO        := $(or $(shell command -v go 2>/dev/null),$(wildcard /usr/local/go/bin/go),$(wildcard $(HOME)/go/bin/go),go)
endif
BIN       := bin/fairshare
VERSION   ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -X main.version=$(VERSION)
TESTFLAGS ?=
BPF_TOOLS := clang llvm-strip bpftool

.PHONY: help
help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: check-go
check-go: ## check that a Go toolchain >= 1.26 is on PATH (or in /usr/local/go/bin)
	@command -v $(GO) >/dev/null || { echo 'error: no Go toolchain: go is not on PATH, in /usr/local/go/bin or in $(HOME)/go/bin; install Go 1.26 or later (https://go.dev/dl). Under sudo, whose secure_path replaces your PATH, run: sudo env PATH="$$PATH" make $(MAKECMDGOALS)'; exit 1; }
	@$(GO) version | awk '{split($$3,v,"."); if (v[2]+0 < 26) {print "error: " $$3 " is too old; fairshare needs go1.26 or later"; exit 1}}'

.PHONY: tools
tools: ## make sure clang, llvm-strip and bpftool are installed (apt-get as root)
	@missing=""; for t in $(BPF_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing clang llvm bpftool libbpf-dev (missing:$$missing)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang llvm bpftool libbpf-dev >/dev/null; \
		else \
			echo "error: missing$$missing; install them (Debian: apt-get install clang llvm bpftool libbpf-dev)"; exit 1; \
		fi; \
	fi

.PHONY: vmlinux
vmlinux: tools ## regenerate bpf/headers/vmlinux.h from the running kernel's BTF
	@test -r /sys/kernel/btf/vmlinux || { echo "error: /sys/kernel/btf/vmlinux is missing; the kernel needs CONFIG_DEBUG_INFO_BTF=y"; exit 1; }
	bpftool btf dump file /sys/kernel/btf/vmlinux format c > bpf/headers/vmlinux.h

.PHONY: generate
generate: check-go tools ## rebuild the BPF objects and their Go bindings (bpf2go)
	$(GO) generate ./...

.PHONY: check-generated
# Another clang version builds other bytes from the same source, so the
# objects are rebuilt and compared only with the clang that built the
# committed ones (loader/clang.version, written by go generate beside them);
# with another, loader/ is left untouched. The check decides before anything
# is generated: it does not depend on generate.
check-generated: check-go tools ## fail when the committed BPF objects differ from a fresh build (with the clang that built them)
	@built=$$(cat loader/clang.version 2>/dev/null); here=$$($${BPF2GO_CC:-clang} --version | head -n 1); \
	if [ "$$built" != "$$here" ]; then \
		echo "note: the committed BPF objects were built by '$${built:-an unrecorded clang}' (loader/clang.version), this host has '$$here':"; \
		echo "      not rebuilt or compared (another clang builds other bytes); loader/ is left as it is"; \
		exit 0; \
	fi; \
	$(GO) generate ./... || exit 1; \
	git diff --exit-code --stat -- loader/ || { echo "error: generated BPF files are not up to date; run 'make generate' and commit"; exit 1; }

.PHONY: build
build: check-go ## build bin/fairshare
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/fairshare

.PHONY: lint
lint: check-go ## gofmt and go vet
	@bad=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$bad" ]; then echo "gofmt needed:"; echo "$$bad"; exit 1; fi
	$(GO) vet ./...
	cd deploy && $(GO) vet ./...
	cd compare && $(GO) vet ./...

.PHONY: test
# Tools some tests need besides root; a test that lacks one skips and says so
# (go test -v), and make test says here which will skip.
TEST_TOOLS := nft containerd runc ctr etcd
TEST_PACKAGES := nftables containerd runc busybox-static containernetworking-plugins etcd-server
# The slowest packages, longest first: go test starts packages in the order
# given (./... adds the rest once each), so these no longer start last and
# run alone at the end (loader started 12 minutes into a loaded run and ran
# alone for most of its 12). The timeout is per package: loader alone took
# 12 minutes on a loaded machine, some 5 since a load of the programs went
# from 2.7-3.0 s of the verifier's CPU to 1.0-1.3 s (2026-12-07).
SLOW_PACKAGES := ./loader ./cmd/fairshare ./scheduler ./front ./sockdiag

# A program built with -race sleeps a second as it exits (the race
# detector's atexit_sleep_ms, so that other threads can finish a report).
# The tests start hundreds of helper processes from their own -race binary
# and wait for each to exit: cmd/fairshare took 500 s with the sleep and
# 230 s without it. A race is reported when it happens, not at exit; a
# GORACE of your own is kept (its settings come after, and win).
test test-front-modes: export GORACE := atexit_sleep_ms=0 $(GORACE)

test: check-go lint check-generated ## run the whole suite (as root: the kernel tests run for real)
	@[ "$$(id -u)" = 0 ] || echo "note: not root; tests that need BPF and cgroups will skip"
	@missing=""; for t in $(TEST_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	[ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 || missing="$$missing busybox-static"; \
	[ -z "$$missing" ] || echo "note: missing$$missing: the nftables, container-runtime and etcd tests will skip (Debian: apt-get install $(TEST_PACKAGES))"
	@: $(info $(GO) test -race -count=1 -timeout 20m $(TESTFLAGS) $(SLOW_PACKAGES) ./... (the front's other two modes beside it))
	@d=$$(mktemp -d) || exit 1; f=; g=; set -m; \
	stop() { kill -- -$$f -$$g 2>/dev/null; rm -rf "$$d"; exit $$1; }; \
	trap 'stop 130' INT; trap 'stop 143' TERM; trap 'stop 129' HUP; \
	( $(FRONT_MODES) ) >"$$d/front" 2>&1 & f=$$!; \
	$(GO) test -race -count=1 -timeout 20m $(TESTFLAGS) $(SLOW_PACKAGES) ./... & g=$$!; \
	set +m; wait $$g; rc=$$?; wait $$f || rc=1; \
	cat "$$d/front"; rm -rf "$$d"; exit $$rc
	cd deploy && $(GO) test -count=1 ./...
	cd compare && $(GO) test -count=1 -timeout 5m ./...

# The front's other two modes (fast path for every front; and without its
# ring of sends) at once: each mostly waits on its peers (some 26 s of CPU
# in 100 s), so side by side they take the time of one; make test runs
# them beside the packages' tests, whose loader (the longest, mostly the
# kernel verifier's work on one CPU) outlasts them. Each one's output is
# printed whole once both are done, with its exit status. Each runs in a
# process group of its own (set -m) and the shell waits for them with
# wait, which a signal interrupts: an interrupt, a TERM or a HUP stops them
# at once and removes the temporary files. TESTFLAGS that write a fixed
# file (-coverprofile, -cpuprofile, -o) would have the runs write the same
# one: run go test ./front yourself for those. A recipe that names $(MAKE)
# runs even under make -n, hence a variable rather than a sub-make.
FRONT_MODES = d=$$(mktemp -d) || exit 1; a=; b=; set -m; \
	stop() { kill -- -$$a -$$b 2>/dev/null; rm -rf "$$d"; exit $$1; }; \
	trap 'stop 130' INT; trap 'stop 143' TERM; trap 'stop 129' HUP; \
	(FAIRSHARE_FRONT_FAST=1 $(GO) test -race -count=1 -timeout 5m $(TESTFLAGS) ./front >"$$d/fast" 2>&1; echo $$? >"$$d/fast.rc") & a=$$!; \
	(FAIRSHARE_FRONT_FAST=1 FAIRSHARE_FRONT_PLAIN_SENDS=1 $(GO) test -race -count=1 -timeout 5m $(TESTFLAGS) ./front >"$$d/plain" 2>&1; echo $$? >"$$d/plain.rc") & b=$$!; \
	set +m; wait $$a $$b; rc=0; \
	for m in fast plain; do \
		st=$$(cat "$$d/$$m.rc" 2>/dev/null); [ "$$st" = 0 ] || rc=1; \
		case $$m in fast) env="FAIRSHARE_FRONT_FAST=1";; *) env="FAIRSHARE_FRONT_FAST=1 FAIRSHARE_FRONT_PLAIN_SENDS=1";; esac; \
		echo "$$env $(GO) test -race -count=1 -timeout 5m ./front: exit $${st:-none}"; cat "$$d/$$m"; \
	done; \
	rm -rf "$$d"; exit $$rc

.PHONY: test-front-modes
test-front-modes: check-go
	@$(FRONT_MODES)

.PHONY: bench
bench: check-go ## run the benchmarks (as root for the BPF ones)
	$(GO) test -run '^$$' -bench . -benchmem -count 5 ./... | tee bench.txt

# COMPARE_JSON and COMPARE_SVG, when set, are where make compare writes the
# report as JSON and the plot of held permits (apf above fairshare).
.PHONY: compare
compare: check-go ## run the same workloads through fairshare, APF, static caps and a FIFO semaphore; print the table (docs/compare.md)
	cd compare && COMPARE_JSON="$(abspath $(COMPARE_JSON))" COMPARE_SVG="$(abspath $(COMPARE_SVG))" \
		$(GO) test -count=1 -timeout 20m -run '^TestReport$$' -report

# DEMO_RUN is the binary that runs the drills and DEMO_FLAGS their flags
# (the test runs a fresh binary with short phases); DEMO_UID decides whether
# the kernel's drill can run.
DEMO_RUN ?= ./$(BIN)
DEMO_FLAGS ?=
DEMO_UID ?= $(shell id -u)

.PHONY: demo
demo: build ## run the fair-share drills on this host: requests, then connections through the kernel and to a destination pool (root)
	@# Every drill runs, and make fails at the end if a verdict did: a
	@# latency verdict the host's load failed does not hide the kernel's.
	@echo "$(DEMO_RUN) drill $(DEMO_FLAGS)"; $(DEMO_RUN) drill $(DEMO_FLAGS); req=$$?; \
	if [ "$(DEMO_UID)" = 0 ]; then \
		echo; echo "the same drill for TCP connections, counted and refused by the BPF programs in the kernel:"; \
		$(DEMO_RUN) drill connections $(DEMO_FLAGS); node=$$?; \
		echo; echo "and for a destination pool: the pool of connections to one address and port (docs/destination-pools.md):"; \
		$(DEMO_RUN) drill connections --to $(DEMO_FLAGS); dest=$$?; \
		[ $$req = 0 ] && [ $$node = 0 ] && [ $$dest = 0 ]; \
	else \
		echo; echo "SKIPPED: the connections drill, the kernel path (BPF counts and refuses connect and accept), needs root;"; \
		echo "         run 'sudo make demo', or 'sudo ./$(BIN) drill connections'."; \
		[ $$req = 0 ]; \
	fi

.PHONY: docs
docs: check-go ## regenerate docs/configuration.md from the configuration code
	$(GO) run ./cmd/fairshare gendocs config > docs/configuration.md.tmp && mv docs/configuration.md.tmp docs/configuration.md

.PHONY: man
man: check-go ## write the man page bin/fairshare.8 (man -l bin/fairshare.8)
	@mkdir -p bin
	$(GO) run ./cmd/fairshare gendocs man > bin/fairshare.8.tmp && mv bin/fairshare.8.tmp bin/fairshare.8

.PHONY: clean
clean: ## remove build output
	rm -rf bin bench.txt coverage.out
