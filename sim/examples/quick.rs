//! Quick manual run of a notation: `cargo run -p pdkv-sim --example quick -- 1P_TP8:1D_TP8 32 320`.

#![forbid(unsafe_code)]

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut sc = pdkv_sim::Scenario::from_notation(&args[1]);
    let c: u32 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(8);
    let n: u32 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(16);
    sc.workload.clients = pdkv_sim::scenario::Clients::Closed { concurrency: c, requests: n };
    for l in args.iter().skip(4) {
        sc.protocol.legacy.push(l.parse().expect("legacy"));
    }
    let t = std::time::Instant::now();
    let run = pdkv_sim::run(&sc, pdkv_sim::RunOptions::default()).expect("runs");
    let mut r = run.result;
    r.scenario_ron.clear();
    r.nic.utilisation.clear();
    println!("{}", r.to_json());
    eprintln!("wall {:?}", t.elapsed());
}
