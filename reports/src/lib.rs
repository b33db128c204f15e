//! Turns simulator results into pictures, each written as PNG and SVG: NIC balance and NIC
//! utilisation per prefill GPU, latency distributions, wait-for graphs of hangs and sweep
//! charts. Never imported by `pdkv-sim`.
//!
//! Text uses the embedded DejaVu Sans (`assets/`), registered with plotters' `ab_glyph`
//! support, so nothing needs fontconfig or system fonts. Pictures are byte-identical for
//! identical input: no clock, no randomness, no hash-map iteration.

mod error;
pub mod gallery;
mod latency;
mod nic;
pub mod page;
mod render;
mod sweep;
mod waitfor;

#[cfg(test)]
mod tests;

pub use error::ReportError;
pub use latency::latency_cdf;
pub use nic::{nic_balance, nic_utilisation};
pub use sweep::{sweep_charts, SweepPoint};
pub use waitfor::wait_for_graph;

/// Every picture of one run: NIC balance, NIC utilisation, latency CDFs, and a wait-for graph
/// for each hang; returns the files written (PNG, SVG and DOT).
pub fn run_pictures(
    result: &pdkv_sim::RunResult,
    dir: &std::path::Path,
) -> Result<Vec<std::path::PathBuf>, ReportError> {
    let mut files = nic_balance(result, dir)?;
    files.extend(nic_utilisation(result, dir)?);
    files.extend(latency_cdf(result, dir)?);
    for (i, hang) in result.hangs.iter().enumerate() {
        files.extend(wait_for_graph(hang, i, &result.title(), dir)?);
    }
    Ok(files)
}
