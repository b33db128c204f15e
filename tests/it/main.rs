//! Integration tests of the whole workspace, one binary with a module per area.

#![forbid(unsafe_code)]

mod allocation;
mod bounds_cli;
mod cli;
mod cluster;
mod cluster_hostile;
mod coverage;
mod docs;
mod explore_cli;
mod gallery;
mod help_examples;
mod hostile_io;
mod legacy_caught;
mod machines;
mod measure;
mod plan_cli;
mod properties;
mod reports_cli;
mod routes_cli;
mod scenarios;
mod shards;
mod steady;
mod wire;
mod zmtp_pyzmq;
