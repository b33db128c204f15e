//! `pdkv._native`: the native half of the `pdkv` Python package, the KV connector vLLM loads.
//! It exposes pdkv's protocol nodes and data plane to the connector's Python wiring.

#![forbid(unsafe_code)]

use pyo3::prelude::*;

/// The package version, as Cargo knows it.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)
}
