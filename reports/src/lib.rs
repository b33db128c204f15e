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
pub use pdkv_sim::result::SweepPoint;
pub use sweep::{sweep_charts, ErrorBand};
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
///
/// Each picture is drawn on a thread of its own: they share only the result, so the report's
/// pictures take as long as the slowest one. The files are listed in the order above whatever
/// the threads' timing, and each picture's bytes do not depend on it.
pub fn run_pictures(
    result: &pdkv_sim::RunResult,
    gpus_per_node: u16,
    dir: &std::path::Path,
) -> Result<RunPictures, ReportError> {
    type Draw<'a> = Box<dyn FnOnce() -> Result<Vec<std::path::PathBuf>, ReportError> + Send + 'a>;
    let mut pictures = RunPictures::default();
    let title = result.title();
    let title = &title;
    // The by-node pictures' aggregation sentence and drill-downs, handed back by their thread.
    let by_node_notes = std::sync::Mutex::new(None);
    let mut draws: Vec<Draw> = Vec::new();
    for (i, hang) in result.hangs.iter().enumerate() {
        draws.push(Box::new(move || wait_for_graph(hang, i, title, dir)));
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
        let notes = &by_node_notes;
        draws.push(Box::new(move || {
            let by_node = nic_by_node(result, gpus_per_node, dir, balance, utilisation)?;
            *notes.lock().expect("no panics while held") = Some((by_node.aggregation, by_node.drill_downs));
            Ok(by_node.files)
        }));
    } else {
        if balance {
            draws.push(Box::new(|| nic_balance(result, dir)));
        }
        if utilisation {
            draws.push(Box::new(|| nic_utilisation(result, dir)));
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
        draws.push(Box::new(|| latency_cdf(result, dir)));
    }
    let drawn: Vec<_> = std::thread::scope(|scope| {
        let threads: Vec<_> = draws.into_iter().map(|draw| scope.spawn(draw)).collect();
        // A drawing thread that panicked passes its panic on, as drawing here would have.
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect()
    });
    for files in drawn {
        pictures.files.extend(files?);
    }
    if let Some((aggregation, drill_downs)) = by_node_notes.into_inner().expect("threads ended") {
        pictures.aggregation = Some(aggregation);
        pictures.drill_downs = drill_downs;
    }
    Ok(pictures)
}
