//! Turns simulator results into pictures, each written as PNG and SVG: NIC balance and NIC
//! utilisation per prefill GPU, latency distributions, wait-for graphs of hangs and sweep
//! charts. Never imported by `pdkv-sim`.
//!
//! Text uses the embedded DejaVu Sans (`assets/`), registered with plotters' `ab_glyph`
//! support, so nothing needs fontconfig or system fonts. Pictures are byte-identical for
//! identical input: no clock, no randomness, no hash-map iteration.

#![forbid(unsafe_code)]

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
pub use nic::{nic_balance, nic_by_node, nic_utilisation, DrillDown, NodePictures, MAX_BARS};
pub use sweep::{sweep_charts, ErrorBand, SweepPoint};
pub use waitfor::wait_for_graph;

/// The pictures of one run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunPictures {
    /// The files written (PNG, SVG and DOT), wait-for graphs first.
    pub files: Vec<std::path::PathBuf>,
    /// One sentence for each picture left out because the run has no data for it.
    pub omitted: Vec<String>,
    /// When the NIC pictures aggregate by node (more than [`MAX_BARS`] prefill GPUs), the
    /// sentence saying how; `None` when they show every GPU.
    pub aggregation: Option<String>,
    /// The per-GPU NIC pictures of the nodes that stand out, when the pictures aggregate.
    pub drill_downs: Vec<DrillDown>,
}

/// Every picture of one run: a wait-for graph for each hang first (when a run hangs, that is
/// what there is to see), then NIC balance, NIC utilisation and latency CDFs. A chart the run
/// has no data for (no reads, no NIC traffic, no finished request) is not drawn as empty axes:
/// it is left out, with a sentence saying why. With more than [`MAX_BARS`] prefill GPUs the NIC
/// pictures show one bar or row per node of `gpus_per_node` GPUs, with per-GPU drill-downs of
/// the nodes that stand out ([`nic_by_node`]).
pub fn run_pictures(
    result: &pdkv_sim::RunResult,
    gpus_per_node: u16,
    dir: &std::path::Path,
) -> Result<RunPictures, ReportError> {
    let mut pictures = RunPictures::default();
    let title = result.title();
    for (i, hang) in result.hangs.iter().enumerate() {
        pictures.files.extend(wait_for_graph(hang, i, &title, dir)?);
    }
    let nic = &result.nic;
    let balance = nic.reads_per_prefill_gpu.iter().chain(&nic.bytes_per_prefill_gpu).any(|&n| n > 0);
    let utilisation = nic.utilisation.iter().flatten().any(|&u| u > 0.0);
    let gpus = nic
        .prefill_gpus
        .len()
        .max(nic.reads_per_prefill_gpu.len())
        .max(nic.bytes_per_prefill_gpu.len())
        .max(nic.utilisation.len());
    if gpus > MAX_BARS && (balance || utilisation) {
        let by_node = nic_by_node(result, gpus_per_node, dir, balance, utilisation)?;
        pictures.files.extend(by_node.files);
        pictures.aggregation = Some(by_node.aggregation);
        pictures.drill_downs = by_node.drill_downs;
    } else {
        if balance {
            pictures.files.extend(nic_balance(result, dir)?);
        }
        if utilisation {
            pictures.files.extend(nic_utilisation(result, dir)?);
        }
    }
    if !balance {
        pictures.omitted.push("No NIC balance chart: no prefill GPU served a read.".into());
    }
    if !utilisation {
        pictures.omitted.push("No NIC utilisation chart: no NIC carried any traffic.".into());
    }
    if result.latency_ms.ttft_percentiles.is_empty() {
        pictures
            .omitted
            .push("No latency chart: no request finished, so there is no TTFT or TPOT to plot.".into());
    } else {
        pictures.files.extend(latency_cdf(result, dir)?);
    }
    Ok(pictures)
}
