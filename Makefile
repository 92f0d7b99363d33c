# limpet's two commands: `make test` and `make demo`. Both set up what is missing first
# (deploy/setup.sh: libtorch from PyPI's torch wheel and the digits data, cached per machine).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

TORCH_VERSION := 2.13.0
export LIMPET_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/limpet
ENV_MK := $(LIMPET_CACHE)/env-$(TORCH_VERSION).mk
VENV_STAMP := $(LIMPET_CACHE)/torch-$(TORCH_VERSION)/.complete
DIGITS := $(LIMPET_CACHE)/data/digits.csv.gz
FUZZ_SECONDS ?= 60
DEMO_DIR ?= demo-out
TARGET_DIR := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)
LAB := $(TARGET_DIR)/release/limpet-lab

# Every target but these needs the setup's paths; make runs setup.sh, then re-reads them.
ifeq ($(filter help clean,$(MAKECMDGOALS)),)
include $(ENV_MK)
endif
# LIBTORCH reaches cargo through .cargo/config.toml (the same value as plain cargo sees, so
# switching between make and cargo does not rebuild torch-sys).
export LIMPET_PYTHON LIMPET_DIGITS

$(ENV_MK) $(VENV_STAMP) $(DIGITS) &: deploy/setup.sh
	bash deploy/setup.sh
	touch $(ENV_MK) $(VENV_STAMP) $(DIGITS)

.PHONY: help setup build synthetic dist test long-test gpu-test gpu-kit lint unit fuzz-check fuzz bench demo clean

help:
	@echo "make test    set up, then lint and run every test"
	@echo "make lint    rustfmt and clippy alone (make test lints as it builds)"
	@echo "make demo    set up, then run 4 agents through a spot notice, a join, a kill -9 and a drain"
	@echo "make setup   install libtorch (torch==$(TORCH_VERSION) from PyPI) and data into $(LIMPET_CACHE)"
	@echo "make fuzz    run each fuzz target for FUZZ_SECONDS (default 60)"
	@echo "make dist    build the release tarballs deploy/cloud-init.yaml installs (dist/limpet-VERSION-linux-ARCH-{cuda,cpu}.tar.gz)"
	@echo "make gpu-test  run the device tests on the first GPU where libtorch sees one (make test runs them on the CPU)"
	@echo "make gpu-kit TORCH=2.11.0  build .gpu/: the device tests against that torch, run there by .gpu/gpu-check.sh"
	@echo "make synthetic  build limpet-synthetic (bench/synthetic: limpetd's control part without libtorch, for lab fleets of hundreds)"
	@echo "make long-test  run the long multi-process scenarios make test leaves out (a few minutes)"
	@echo "make bench   measure: raft commits, allreduce against gloo (and in bfloat16), hosts of 2 local ranks against 4 of one, state handoff against plain TCP, transitions against torchrun and torchft, planner predictions and pipelines, LLaMA training against transformers (small and 125m) and torchrun + DDP, sharded state's memory per rank against whole state (125m and 350m), memory on a 4 GiB dataset, activation checkpointing and a chunked loss at vocabulary 128k, what grows with the fleet (8 to 48 agents, and 16 to 256 synthetic ones each in a network namespace), and barrier and allreduce time from 8 to 1024 ranks, butterfly against ring, and the leader's steady round from 16 to 256 hosts, a pipelined job's layout kept against worked out afresh"

# The clone's links into the cache (.limpet/libtorch, which cargo builds against, and
# .limpet/python) are made by setup.sh too, and may be missing while the cache is up to date:
# a clone older than the cache, or one cleaned with `git clean -xdf`.
setup: $(ENV_MK)
	@test -e .limpet/libtorch && test -x .limpet/python || bash deploy/setup.sh

build: setup
	cargo build --workspace --release --bins

# The product alone: limpet and limpetd without the `lab` feature (no local-cluster flags,
# drills or chaos hooks), which a workspace build would turn on for limpet-lab's sake.
dist: setup
	cargo build --release --locked -p limpet-daemon --bins
	bash deploy/dist.sh --bin-dir $(TARGET_DIR)/release --out dist

lint: setup
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	# The product as make dist builds it: without the lab feature a workspace build turns on.
	cargo clippy -p limpet-daemon --bins --locked -- -D warnings

# `make test` lints in the build that runs the tests: clippy's driver compiles the
# workspace's crates for them (every warning an error), where a separate `cargo clippy` checked
# every dependency a second time (6.6 of a fresh clone's 31 minutes). The wrapper is part of
# what cargo fingerprints, so after plain `cargo test` the workspace's own crates build again.
LINTED := RUSTC_WORKSPACE_WRAPPER=clippy-driver CLIPPY_ARGS=-Dwarnings

# The product binaries are built first, as `make dist` builds them (and linted so, without the
# lab feature), for the test that looks for the lab in them (the tests' own binaries have it).
unit: setup
	cargo fmt --all -- --check
	$(LINTED) cargo build --locked -p limpet-daemon --bins
	rm -rf $(TARGET_DIR)/product && mkdir -p $(TARGET_DIR)/product
	cp $(TARGET_DIR)/debug/limpet $(TARGET_DIR)/debug/limpetd $(TARGET_DIR)/product/
	$(LINTED) LIMPET_PRODUCT_BINS=$(TARGET_DIR)/product cargo test --workspace --locked

# The fuzz crate and the synthetic agent build outside the workspace; checking them keeps
# them from rotting. They are also where the agent builds without the `trainer` feature (no
# libtorch: its control part and the synthetic agents), so a warning there fails too.
fuzz-check: setup
	for m in fuzz/Cargo.toml bench/synthetic/Cargo.toml; do \
	    out=$$(cargo check --manifest-path $$m --locked --quiet --target-dir $(TARGET_DIR) 2>&1) || { echo "$$out"; exit 1; }; \
	    echo "$$out"; ! grep -q '^warning' <<<"$$out" || exit 1; done

test: unit fuzz-check

# The lab's synthetic agent (bench/synthetic: limpetd's control part without libtorch, for
# fleets of hundreds of processes), a crate outside the workspace so that no workspace build
# turns libtorch on in it; built beside limpet-lab, where the lab looks for it.
synthetic: setup
	cargo build --release --locked --manifest-path bench/synthetic/Cargo.toml --target-dir $(TARGET_DIR)

# Scenarios of minutes that repeat what `make test` covers, or measure the lab's replays
# against its simulation: #[ignore]d there, to keep `make test` under half an hour on two cores.
long-test: setup
	cargo test -p limpet-daemon --test processes --locked -- --ignored

# The device tests (trainer/tests/cuda.rs) run on the CPU in `make test`; this runs them on
# the first GPU where libtorch sees one.
gpu-test: setup
	@if "$(LIMPET_PYTHON)" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	    LIMPET_TEST_DEVICE=cuda:0 CUBLAS_WORKSPACE_CONFIG=:4096:8 cargo test -p limpet-trainer --test cuda --locked -- --test-threads=1 --nocapture; \
	else \
	    echo "make gpu-test: skipped: libtorch sees no CUDA device on this host (trainer/tests/cuda.rs ran on the CPU in make test)"; \
	fi

# A kit that proves the device paths on a GPU machine with its own Python torch and no Rust:
# the device tests built against torch $(TORCH), with deploy/gpu-check.sh, in .gpu/.
TORCH ?= 2.11.0
gpu-kit: setup
	deploy/gpu-kit.sh $(TORCH)

fuzz: setup
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	# The dataplane_* targets' endpoints serve each connection on a thread of its own; one that
	# outlives its input keeps glibc's thread-local registration, which LeakSanitizer reports.
	cd fuzz && for t in $$(cargo fuzz list); do \
	    leaks=; case $$t in dataplane_*) leaks=-detect_leaks=0;; esac; \
	    RUSTC_BOOTSTRAP=1 cargo fuzz run $$t -- -max_total_time=$(FUZZ_SECONDS) $$leaks || exit 1; done

bench: build synthetic
	bash deploy/setup.sh --bench
	$(LAB) bench raft --nodes 5 --proposals 1000
	$(LAB) bench raft --nodes 3 --proposals 1000
	$(LAB) bench raft --nodes 5 --proposals 1000 --ballast 1000 --save-every 1
	$(LAB) bench raft --nodes 5 --proposals 1000 --ballast 1000
	$(LAB) bench allreduce --world 2 --sizes 4K,256K,4M,16M,64M --rounds 3 --bf16
	$(LAB) bench allreduce --world 4 --sizes 4K,256K,4M,16M,64M --rounds 3
	$(LAB) bench handoff --bytes 256M
	$(LAB) bench elastic
	$(LAB) bench elastic --model gpt --steps 3000 --shard-replicas 1
	$(LAB) bench straggler
	$(LAB) bench straggler --nodes 2 --pipeline 2 --steps 400
	$(LAB) bench scale --hosts 8,16,32,48
	$(LAB) bench scale --synthetic --netns --hosts 16,64 --steps 1000
	$(LAB) bench scale --synthetic --netns --hosts 16,64,256 --control-only --plot docs/scale-synthetic.svg
	$(LAB) bench collectives --ranks 8,64,256,1024 --sizes 4K,1M,64M --plot docs/collectives.svg
	$(LAB) bench round --hosts 16,64,256
	$(LAB) bench pipeline --model gpt --layers 4 --batch 32 --micro-batch 8 --hosts 2 --train-steps 40 --devices 2
	$(LAB) bench pipeline --model gpt --layers 4 --batch 32 --micro-batch 8 --hosts 4 --train-steps 40 --chaos
	$(LAB) bench train --preset small --batch 8 --context 256
	$(LAB) bench train --preset 125m --batch 4 --context 256 --steps 4
	$(LAB) bench activations --preset small --vocab 128256 --batch 4 --context 512
	$(LAB) bench dp --preset small --world 2 --batch 16 --context 128
	$(LAB) bench dp --preset small --world 4 --batch 16 --context 128 --overlap-both
	$(LAB) bench dp --preset small --world 4 --batch 16 --context 128 --shard-replicas 1
	$(LAB) bench dp --preset small --world 4 --batch 16 --context 128 --devices 2
	$(LAB) bench dp --preset 125m --world 4 --batch 8 --context 64 --steps 3 --warmup 1
	$(LAB) bench dp --preset 125m --world 4 --batch 8 --context 64 --steps 3 --warmup 1 --shard-replicas 1 --gradients-both --whole-world 4
	$(LAB) bench dp --preset 125m --world 4 --batch 8 --context 64 --steps 3 --warmup 1 --devices 2
	$(LAB) bench dp --preset 125m --world 4 --batch 8 --context 64 --steps 3 --warmup 1 --devices 2 --shard-replicas 1
	$(LAB) bench dp --preset 350m --world 4 --batch 8 --context 64 --steps 2 --warmup 1 --shard-replicas 1 --whole-world 2 --no-peer
	$(LAB) bench dp --preset 125m --world 4 --batch 8 --context 64 --steps 5 --warmup 1 --shard-replicas 1 --checkpoint-every 2 --shards-both
	$(LAB) bench memory --preset 125m --dataset-gib 4 --batch 2 --context 128 --steps 5 --sharded-world 4

demo: build
	rm -rf $(DEMO_DIR)
	$(LAB) demo --dir $(DEMO_DIR)

clean:
	cargo clean
	rm -rf $(DEMO_DIR) fuzz/target
