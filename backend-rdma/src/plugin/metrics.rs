//! A plugin rank's metrics: counters and latency histograms kept from what its driver says and
//! what it is told, served in Prometheus's text format (version 0.0.4) on a port of its own, so
//! an operator's Prometheus scrapes each rank of a vLLM deployment.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use pdkv_core::ids::RankId;

use crate::sched::{FromRank, ToRank};

/// Upper bounds of the latency buckets, in microseconds (100 us to 10 s).
const BUCKETS_US: [u64; 10] =
    [100, 500, 1_000, 5_000, 10_000, 50_000, 100_000, 500_000, 1_000_000, 10_000_000];

/// Largest request line and headers a scrape may send.
const MAX_REQUEST_BYTES: usize = 8192;

#[derive(Clone, Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS_US.len()],
    sum_us: u64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, us: u64) {
        for (bound, count) in BUCKETS_US.iter().zip(self.counts.iter_mut()) {
            if us <= *bound {
                *count += 1;
            }
        }
        self.sum_us = self.sum_us.saturating_add(us);
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in BUCKETS_US.iter().zip(self.counts.iter()) {
            let le = *bound as f64 / 1e6;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum_us as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// What one rank has done, as counters by name and peer.
#[derive(Debug, Default)]
pub struct RankMetrics {
    /// The labels of every series: the rank and its NIC.
    labels: String,
    /// `(metric, peer)` to value; `peer` is empty for counters of the rank alone.
    counters: BTreeMap<(&'static str, String), u64>,
    read_latency: Histogram,
    handshake_latency: Histogram,
}

/// Each counter's help line.
const HELP: &[(&str, &str)] = &[
    ("pdkv_read_bytes_total", "KV bytes this decode rank read, by prefill rank read"),
    ("pdkv_reads_total", "reads this decode rank completed, by prefill rank read"),
    ("pdkv_handshakes_total", "handshake dials that completed, by prefill rank"),
    ("pdkv_handshake_failures_total", "handshake dials that failed, by prefill rank"),
    ("pdkv_requests_received_total", "requests whose KV this decode rank received whole"),
    ("pdkv_requests_failed_total", "requests whose KV this decode rank could not receive"),
    ("pdkv_votes_total", "barrier votes this decode rank cast"),
    ("pdkv_votes_failed_total", "barrier votes this decode rank cast as not ready"),
    ("pdkv_transfers_registered_total", "transfers the prefill engine registered on this rank"),
    ("pdkv_transfers_finished_total", "transfers whose releases this prefill rank counted whole"),
    ("pdkv_transfers_retired_total", "transfers the prefill engine retired on this rank"),
    ("pdkv_fences_total", "fences the prefill engine raised on this rank's blocks"),
    ("pdkv_leases_total", "read leases this prefill rank took"),
    ("pdkv_refused_total", "releases or leases this prefill rank refused (forged, or a wrong MAC)"),
    ("pdkv_problems_total", "problems the rank's driver reported (a listener's bad input, a KV copy)"),
    ("pdkv_protocol_errors_total", "inconsistencies the core itself reported"),
];

impl RankMetrics {
    /// The metrics of `rank`, which moves KV through `nic` (an RDMA device, `rdma` or `tcp`),
    /// all zero. Every series carries both, so that a query can sum a host's traffic by NIC.
    pub fn new(rank: RankId, nic: String) -> RankMetrics {
        let labels = format!("rank=\"{rank}\",nic=\"{}\"", escape(&nic));
        RankMetrics { labels, ..RankMetrics::default() }
    }

    fn add(&mut self, name: &'static str, peer: String, n: u64) {
        let counter = self.counters.entry((name, peer)).or_default();
        *counter = counter.saturating_add(n);
    }

    /// Counts what the driver said.
    pub fn observe_from(&mut self, msg: &FromRank) {
        match msg {
            FromRank::ReadVerified { source, bytes, elapsed_us, .. } => {
                self.add("pdkv_read_bytes_total", source.to_string(), *bytes);
                self.add("pdkv_reads_total", source.to_string(), 1);
                self.read_latency.observe(*elapsed_us);
            }
            FromRank::Dialled { peer, ok, elapsed_us } => {
                let name = if *ok { "pdkv_handshakes_total" } else { "pdkv_handshake_failures_total" };
                self.add(name, peer.to_string(), 1);
                self.handshake_latency.observe(*elapsed_us);
            }
            FromRank::Received { .. } => self.add("pdkv_requests_received_total", String::new(), 1),
            FromRank::RecvFailed { .. } => self.add("pdkv_requests_failed_total", String::new(), 1),
            FromRank::Vote { ok, .. } => {
                self.add("pdkv_votes_total", String::new(), 1);
                if !ok {
                    self.add("pdkv_votes_failed_total", String::new(), 1);
                }
            }
            FromRank::Finished { .. } => self.add("pdkv_transfers_finished_total", String::new(), 1),
            FromRank::Leased { .. } => self.add("pdkv_leases_total", String::new(), 1),
            FromRank::Refused { .. } => self.add("pdkv_refused_total", String::new(), 1),
            FromRank::Problem(_) => self.add("pdkv_problems_total", String::new(), 1),
            FromRank::ProtocolError { .. } => self.add("pdkv_protocol_errors_total", String::new(), 1),
            _ => {}
        }
    }

    /// Counts what the driver was told.
    pub fn observe_to(&mut self, msg: &ToRank) {
        match msg {
            ToRank::Register { .. } => self.add("pdkv_transfers_registered_total", String::new(), 1),
            ToRank::Retire { .. } => self.add("pdkv_transfers_retired_total", String::new(), 1),
            ToRank::Fence { .. } => self.add("pdkv_fences_total", String::new(), 1),
            _ => {}
        }
    }

    /// The metrics in Prometheus's text format: every counter with its help line, zero or not.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let labels = &self.labels;
        for (name, help) in HELP {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let mut any = false;
            for ((_, peer), value) in
                self.counters.range((*name, String::new())..).take_while(|((n, _), _)| n == name)
            {
                any = true;
                if peer.is_empty() {
                    let _ = writeln!(out, "{name}{{{labels}}} {value}");
                } else {
                    let _ = writeln!(out, "{name}{{{labels},peer=\"{peer}\"}} {value}");
                }
            }
            if !any {
                let _ = writeln!(out, "{name}{{{labels}}} 0");
            }
        }
        self.read_latency.render(&mut out, "pdkv_read_seconds", "time of one read on the data plane", labels);
        self.handshake_latency.render(
            &mut out,
            "pdkv_handshake_seconds",
            "time of one handshake dial",
            labels,
        );
        out
    }
}

/// `text` as a Prometheus label value (backslash, double quote and newline escaped).
fn escape(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Serves `metrics` at `http://addr/metrics` from a thread of its own until the process ends.
/// Returns the address bound (port 0 picks one).
pub fn serve(addr: SocketAddr, metrics: Arc<Mutex<RankMetrics>>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    thread::Builder::new().name("pdkv metrics".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            // A slow or broken scraper concerns itself only.
            let _ = answer(stream, &metrics);
        }
    })?;
    Ok(local)
}

fn answer(stream: TcpStream, metrics: &Mutex<RankMetrics>) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?).take(MAX_REQUEST_BYTES as u64);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Headers end at the first empty line.
    let mut line = String::new();
    while reader.read_line(&mut line)? > 2 {
        line.clear();
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("");
    let (status, body) = if request_line.starts_with("GET ") && (path == "/metrics" || path == "/") {
        ("200 OK", metrics.lock().unwrap_or_else(PoisonError::into_inner).render())
    } else {
        ("404 Not Found", "pdkv serves only GET /metrics\n".to_string())
    };
    let mut stream = stream;
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::EngineId;

    #[test]
    fn counters_and_histograms_follow_what_the_rank_said() {
        let rank = RankId::new(EngineId::decode(0), 0, 1);
        let source = RankId::new(EngineId::prefill(0), 0, 1);
        let mut m = RankMetrics::new(rank, "mlx5_1".into());
        let read = |bytes, elapsed_us| FromRank::ReadVerified {
            request: pdkv_core::ids::RequestId(0),
            layer: None,
            source,
            bytes,
            elapsed_us,
        };
        m.observe_from(&read(4096, 250));
        m.observe_from(&read(1024, 20_000));
        m.observe_from(&FromRank::Dialled { peer: source, ok: false, elapsed_us: 3 });
        m.observe_from(&FromRank::Vote { step: 0, ok: false });
        let text = m.render();
        let check = |line: &str| assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        check("pdkv_read_bytes_total{rank=\"D0.dp0.tp1\",nic=\"mlx5_1\",peer=\"P0.dp0.tp1\"} 5120");
        check("pdkv_reads_total{rank=\"D0.dp0.tp1\",nic=\"mlx5_1\",peer=\"P0.dp0.tp1\"} 2");
        check("pdkv_handshake_failures_total{rank=\"D0.dp0.tp1\",nic=\"mlx5_1\",peer=\"P0.dp0.tp1\"} 1");
        check("pdkv_handshakes_total{rank=\"D0.dp0.tp1\",nic=\"mlx5_1\"} 0");
        check("pdkv_votes_failed_total{rank=\"D0.dp0.tp1\",nic=\"mlx5_1\"} 1");
        check("pdkv_read_seconds_bucket{rank=\"D0.dp0.tp1\",nic=\"mlx5_1\",le=\"0.0005\"} 1");
        check("pdkv_read_seconds_bucket{rank=\"D0.dp0.tp1\",nic=\"mlx5_1\",le=\"0.05\"} 2");
        check("pdkv_read_seconds_count{rank=\"D0.dp0.tp1\",nic=\"mlx5_1\"} 2");
        let odd = RankMetrics::new(rank, "a\"b\\c\nd".into()).render();
        assert!(odd.contains(r#"pdkv_votes_total{rank="D0.dp0.tp1",nic="a\"b\\c\nd"} 0"#), "{odd}");
    }

    #[test]
    fn the_endpoint_answers_a_scrape_and_refuses_other_paths() {
        let metrics =
            Arc::new(Mutex::new(RankMetrics::new(RankId::new(EngineId::prefill(0), 0, 0), "tcp".into())));
        metrics.lock().expect("not poisoned").observe_to(&ToRank::Fence {
            transfer_id: pdkv_core::ids::TransferId::new("tx-1"),
            blocks: vec![1],
        });
        let addr = serve("127.0.0.1:0".parse().expect("an address"), metrics).expect("binds");
        let get = |path: &str| {
            let mut stream = TcpStream::connect(addr).expect("connects");
            write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").expect("sends");
            let mut text = String::new();
            std::io::Read::read_to_string(&mut stream, &mut text).expect("reads");
            text
        };
        let text = get("/metrics");
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        assert!(text.contains("pdkv_fences_total{rank=\"P0.dp0.tp0\",nic=\"tcp\"} 1"), "{text}");
        assert!(get("/secrets").starts_with("HTTP/1.1 404"));
    }
}
