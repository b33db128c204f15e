//! Renders every picture for realistic simulator runs into /tmp/pdkv-report-check (or the folder
//! given as the first argument), for looking at them: `cargo run --release -p pdkv-reports
//! --example render_check`.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use pdkv_core::ids::{EngineId, RankId};
use pdkv_core::ports::SessionKey;
use pdkv_reports::SweepPoint;
use pdkv_sim::scenario::Clients;
use pdkv_sim::waitfor::{Collective, WaitEdge, WaitNode, WaitReason};
use pdkv_sim::{RunOptions, Scenario};

/// Writes every picture of `r` into `dir` and prints each file's size.
fn report(r: &pdkv_sim::RunResult, dir: &Path) {
    let mut written = Vec::new();
    written.extend(pdkv_reports::nic_balance(r, dir).expect("nic_balance"));
    written.extend(pdkv_reports::nic_utilisation(r, dir).expect("nic_utilisation"));
    written.extend(pdkv_reports::latency_cdf(r, dir).expect("latency_cdf"));
    for (i, h) in r.hangs.iter().enumerate() {
        written.extend(pdkv_reports::wait_for_graph(h, i, &r.title(), dir).expect("wait_for_graph"));
    }
    for p in written {
        println!("{:>7} {}", std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0), p.display());
    }
}

/// A synthetic hang with `edges` as its wait-for edges.
fn hang(what: &str, edges: Vec<WaitEdge>, cycle: Option<Vec<WaitNode>>) -> pdkv_sim::result::Hang {
    pdkv_sim::result::Hang {
        t_ms: 12_345.0,
        what: what.to_string(),
        ranks: Vec::new(),
        wait_for: edges,
        cycle,
        dot: "digraph waitfor {}\n".to_string(),
    }
}

fn main() {
    let out = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "/tmp/pdkv-report-check".to_string()));
    let hang_scenario =
        pdkv_sim::load::load_scenario(Path::new("scenarios/no-handshake-timeout-lost-reply.ron"))
            .expect("scenario loads");
    let mixed = Scenario::from_notation("2P_TP8:1D_DP8EP");
    for (name, scenario) in [("hang", &hang_scenario), ("mixed", &mixed)] {
        let run = pdkv_sim::run(scenario, RunOptions::default()).expect("runs");
        report(&run.result, &out.join(name));
    }
    // More shapes: imbalanced reads, 64 prefill GPUs, synthetic wait-for graphs.
    for file in ["proxy-aliasing.ron", "read-from-dp0.ron"] {
        let s = pdkv_sim::load::load_scenario(&Path::new("scenarios").join(file)).expect("scenario loads");
        let r = pdkv_sim::run(&s, RunOptions::default()).expect("runs").result;
        report(&r, &out.join("extra").join(file.trim_end_matches(".ron")));
    }
    for notation in ["4P_DP2TP8:2D_DP8EP", "8P_DP8EP:4D_TP8"] {
        let mut s = Scenario::from_notation(notation);
        s.workload.clients = Clients::Closed { concurrency: 64, requests: 256 };
        let r = pdkv_sim::run(&s, RunOptions::default()).expect("runs").result;
        report(&r, &out.join("extra").join(notation.replace(':', "-")));
    }
    // Nodes and edges as the simulator names them.
    let rank = |engine: u16, tp: u16| WaitNode::Rank { rank: RankId::new(EngineId::decode(engine), 0, tp) };
    let collective = |engine: u16, step: u64| WaitNode::Collective {
        op: Collective::TpCollective,
        engine: EngineId::decode(engine),
        step,
    };
    let vote = |engine: u16, step: u64| WaitNode::Vote { engine: EngineId::decode(engine), group: 0, step };
    let listener = |engine: u16, tp: u16| WaitNode::HandshakeListener {
        rank: RankId::new(EngineId::prefill(engine), 0, tp),
    };
    let blocked = |engine: u16, tp: u16| WaitReason::BlockedOnHandshake {
        session: SessionKey(format!("prefill-{engine}:6301_dp0_tp{tp}")),
    };
    let edge = |from: WaitNode, to: WaitNode, reason: WaitReason| WaitEdge { from, to, reason };
    // The simulator's graphs have no cycle; this one is made up to see how one is drawn.
    let long = WaitReason::Handshake {
        session: SessionKey("prefill-0:6301_dp0_tp1, a session key long enough to be cut short".into()),
    };
    let cycle = vec![
        edge(collective(0, 4), rank(0, 0), WaitReason::NotArrived),
        edge(rank(0, 0), vote(0, 4), WaitReason::WaitingForMinVote),
        edge(vote(0, 4), rank(0, 1), WaitReason::HasNotVoted),
        edge(rank(0, 1), rank(0, 0), long),
        edge(rank(0, 1), rank(0, 1), WaitReason::RaisedOutOfStep),
        edge(rank(0, 1), listener(0, 1), blocked(0, 1)),
    ];
    let members = vec![rank(0, 0), rank(0, 1), vote(0, 4)];
    let extra = out.join("extra").join("graphs");
    pdkv_reports::wait_for_graph(&hang("Synthetic deadlock", cycle, Some(members)), 0, "synthetic", &extra)
        .expect("cycle");
    let mut big = Vec::new();
    for t in 0..16 {
        big.push(edge(collective(1, 9), rank(1, t), WaitReason::NotArrived));
        if t % 5 == 2 {
            big.push(edge(rank(1, t), listener(t % 2, t), blocked(t % 2, t)));
        } else {
            big.push(edge(rank(1, t), vote(1, 9), WaitReason::WaitingForMinVote));
        }
    }
    big.push(edge(vote(1, 9), rank(1, 2), WaitReason::HasNotVoted));
    pdkv_reports::wait_for_graph(&hang("Synthetic 16-rank hang", big, None), 1, "synthetic", &extra)
        .expect("big");
    let mut points = Vec::new();
    for notation in ["1P_TP8:1D_TP8", "2P_TP8:1D_DP8EP", "1P_TP4:1D_TP8"] {
        for concurrency in [32u32, 128, 512] {
            let mut s = Scenario::from_notation(notation);
            s.workload.clients = Clients::Closed { concurrency, requests: concurrency * 2 };
            let r = pdkv_sim::run(&s, RunOptions::default()).expect("runs").result;
            points.push(SweepPoint {
                run: notation.to_string(),
                deployment: notation.to_string(),
                concurrency,
                rate_per_s: None,
                gpus: r.gpus,
                total_tok_s: r.throughput.total_tok_s,
                ttft_mean_ms: r.latency_ms.ttft.map(|t| t.mean),
                tpot_mean_ms: r.latency_ms.tpot.map(|t| t.mean),
                outcome: r.outcome,
                steady: r.steady.clone(),
            });
        }
    }
    let calibration = pdkv_sim::calibration::current();
    let band = pdkv_reports::ErrorBand::Unmeasured {
        fitting_error_max: calibration.fitting_error_max,
        calibration: calibration.name.clone(),
    };
    for p in pdkv_reports::sweep_charts(&points, &band, &out.join("sweep")).expect("sweep_charts") {
        println!("{} {}", std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0), p.display());
    }
    // The same sweep with one run marked as hung (synthetic), to see how that is shown.
    let mut marked = points.clone();
    marked[8].outcome = pdkv_sim::Outcome::Hang;
    marked[8].total_tok_s = 0.0;
    marked[8].ttft_mean_ms = None;
    marked[8].tpot_mean_ms = None;
    pdkv_reports::sweep_charts(&marked, &band, &out.join("extra").join("sweep-with-hang"))
        .expect("sweep_charts");
    // The same sweep with a made-up validation error, to see how the band is drawn.
    let measured =
        pdkv_reports::ErrorBand::Measured { half_width: 0.23, points: 8, calibration: calibration.name };
    pdkv_reports::sweep_charts(&points, &measured, &out.join("extra").join("sweep-with-band"))
        .expect("sweep_charts");
    for p in &points {
        eprintln!("{p:?}");
    }
}
