//! The run's trace: compact records in virtual time, written as text and as a Chrome trace.

use serde::Serialize;

/// One thing that happened (or took time) in a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceRecord {
    /// Virtual time the record starts at, in nanoseconds.
    pub t_ns: u64,
    /// How long it took, for spans (a prefill batch, a decode step, a read); `None` for instants.
    pub dur_ns: Option<u64>,
    /// Category: `proxy`, `prefill`, `decode`, `nic`, `handshake`, `release`, `fault`, `check`.
    pub cat: &'static str,
    /// What happened, e.g. `step`, `read`, `dial`, `free`.
    pub name: String,
    /// The rank or component it happened on, e.g. `P0.dp0.tp3`, `D0.dp1`, `proxy`.
    pub track: String,
    /// Details, `key=value` separated by spaces.
    pub detail: String,
}

/// The compact text trace: one line per record, virtual time first.
pub fn to_text(records: &[TraceRecord]) -> String {
    let mut out = String::with_capacity(records.len() * 80);
    out.push_str("# virtual time   category   track           event            detail\n");
    for r in records {
        let time = format!("{}.{:09}s", r.t_ns / 1_000_000_000, r.t_ns % 1_000_000_000);
        let duration = r.dur_ns.map(|d| format!(" ({:.3} ms)", d as f64 / 1e6)).unwrap_or_default();
        out.push_str(&format!(
            "{time:>16}  {:<9}  {:<14}  {:<15}  {}{duration}\n",
            r.cat, r.track, r.name, r.detail
        ));
    }
    out
}

/// The Chrome trace-event JSON (loadable in Perfetto or `chrome://tracing`): spans as complete
/// events, instants as instant events, one process per category and one thread per track.
pub fn to_chrome(records: &[TraceRecord]) -> String {
    use std::collections::BTreeMap;
    let mut pids: BTreeMap<&str, usize> = BTreeMap::new();
    let mut tids: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for r in records {
        let next = pids.len() + 1;
        pids.entry(r.cat).or_insert(next);
        let next = tids.len() + 1;
        tids.entry((r.cat, r.track.as_str())).or_insert(next);
    }
    let mut events = Vec::with_capacity(records.len() + pids.len() + tids.len());
    for (cat, pid) in &pids {
        events.push(serde_json::json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
            "args": {"name": cat}}));
    }
    for ((cat, track), tid) in &tids {
        events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": pids[cat], "tid": tid,
            "args": {"name": track}}));
    }
    for r in records {
        let pid = pids[r.cat];
        let tid = tids[&(r.cat, r.track.as_str())];
        // Chrome traces count microseconds; keep nanosecond precision as a fraction.
        let ts = r.t_ns as f64 / 1e3;
        let args = serde_json::json!({"detail": r.detail});
        events.push(match r.dur_ns {
            Some(d) => serde_json::json!({"ph": "X", "name": r.name, "cat": r.cat, "pid": pid, "tid": tid,
                "ts": ts, "dur": d as f64 / 1e3, "args": args}),
            None => serde_json::json!({"ph": "i", "s": "t", "name": r.name, "cat": r.cat, "pid": pid,
                "tid": tid, "ts": ts, "args": args}),
        });
    }
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records() -> Vec<TraceRecord> {
        vec![
            TraceRecord {
                t_ns: 1_500_000_000,
                dur_ns: Some(2_000_000),
                cat: "decode",
                name: "step".into(),
                track: "D0.u0".into(),
                detail: "batch=4".into(),
            },
            TraceRecord {
                t_ns: 1_600_000_000,
                dur_ns: None,
                cat: "check",
                name: "hang".into(),
                track: "x".into(),
                detail: String::new(),
            },
        ]
    }

    #[test]
    fn text_has_a_time_column_and_chrome_is_valid_json() {
        let text = to_text(&records());
        assert!(text.lines().nth(1).unwrap().trim_start().starts_with("1.500000000s  decode"), "{text}");
        assert!(text.contains("(2.000 ms)"));
        let chrome: serde_json::Value = serde_json::from_str(&to_chrome(&records())).unwrap();
        let events = chrome["traceEvents"].as_array().unwrap();
        let span = events.iter().find(|e| e["ph"] == "X").unwrap();
        assert_eq!((span["ts"].as_f64(), span["dur"].as_f64()), (Some(1_500_000.0), Some(2_000.0)));
        assert!(events.iter().any(|e| e["ph"] == "i" && e["name"] == "hang"));
    }
}
