# The two commands of the README, and the steps they are made of.
SHELL := /bin/bash
.DEFAULT_GOAL := help

.PHONY: help setup build run test lint

help:
	@echo "make run   - set up what is missing, build, start Strata with the default model"
	@echo "make test  - set up what is missing, then run every check and test (what CI runs)"

setup:
	@bash scripts/setup

build: setup
	cargo build --release --bins

run: build
	@source scripts/paths.sh && scripts/mlx-env "$${CARGO_TARGET_DIR:-target}/release/strata" up

test: setup
	@bash scripts/test

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
