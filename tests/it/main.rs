//! Integration tests of the whole workspace, one binary with a module per area.

mod docs;
mod machines;
mod routes_cli;
mod scenarios;
mod wire;
