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

/// One Chrome trace event. Fields are in alphabetical order, the order `serde_json` gave the
/// map this replaced, so the file is byte-for-byte what it was; typed events serialise straight
/// into the output instead of building a JSON tree per record (which took about a kilobyte per
/// record, a gigabyte for a long trace).
#[derive(Serialize)]
struct ChromeEvent<'a> {
    args: ChromeArgs<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    name: &'a str,
    ph: &'a str,
    pid: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<&'a str>,
    tid: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    ts: Option<f64>,
}

/// The `args` of an event: a metadata event's name, or a record's detail.
#[derive(Serialize)]
#[serde(untagged)]
enum ChromeArgs<'a> {
    Name { name: &'a str },
    Detail { detail: &'a str },
}

/// The whole file, keys again in alphabetical order.
#[derive(Serialize)]
struct ChromeTrace<'a> {
    #[serde(rename = "displayTimeUnit")]
    display_time_unit: &'a str,
    #[serde(rename = "traceEvents")]
    trace_events: Vec<ChromeEvent<'a>>,
}

/// The Chrome trace-event JSON (loadable in Perfetto or `chrome://tracing`): spans as complete
/// events, instants as instant events, one process per category and one thread per track.
pub fn to_chrome<'a>(records: &'a [TraceRecord]) -> String {
    use std::collections::BTreeMap;
    let mut pids: BTreeMap<&str, usize> = BTreeMap::new();
    let mut tids: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for r in records {
        let next = pids.len() + 1;
        pids.entry(r.cat).or_insert(next);
        let next = tids.len() + 1;
        tids.entry((r.cat, r.track.as_str())).or_insert(next);
    }
    // Metadata events name each process (category) and thread (track).
    let meta = |name: &'static str, pid: usize, tid: usize, label: &'a str| ChromeEvent {
        args: ChromeArgs::Name { name: label },
        cat: None,
        dur: None,
        name,
        ph: "M",
        pid,
        s: None,
        tid,
        ts: None,
    };
    let mut events = Vec::with_capacity(records.len() + pids.len() + tids.len());
    for (cat, pid) in &pids {
        events.push(meta("process_name", *pid, 0, cat));
    }
    for ((cat, track), tid) in &tids {
        events.push(meta("thread_name", pids[cat], *tid, track));
    }
    for r in records {
        // Chrome traces count microseconds; keep nanosecond precision as a fraction.
        let span = r.dur_ns.is_some();
        events.push(ChromeEvent {
            args: ChromeArgs::Detail { detail: &r.detail },
            cat: Some(r.cat),
            dur: r.dur_ns.map(|d| d as f64 / 1e3),
            name: &r.name,
            ph: if span { "X" } else { "i" },
            pid: pids[r.cat],
            s: (!span).then_some("t"),
            tid: tids[&(r.cat, r.track.as_str())],
            ts: Some(r.t_ns as f64 / 1e3),
        });
    }
    let trace = ChromeTrace { display_time_unit: "ms", trace_events: events };
    // Serialising borrowed strings and numbers into a String cannot fail.
    serde_json::to_string(&trace).expect("a trace serialises")
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

    /// The Chrome file is exactly what the JSON-tree writer it replaced produced (keys in
    /// alphabetical order, metadata events first), so existing traces and tools still match.
    #[test]
    fn chrome_trace_is_byte_stable() {
        let check = |records: &[TraceRecord], expected: &str| assert_eq!(to_chrome(records), expected);
        check(&[], r#"{"displayTimeUnit":"ms","traceEvents":[]}"#);
        check(
            &records(),
            concat!(
                r#"{"displayTimeUnit":"ms","traceEvents":["#,
                r#"{"args":{"name":"check"},"name":"process_name","ph":"M","pid":2,"tid":0},"#,
                r#"{"args":{"name":"decode"},"name":"process_name","ph":"M","pid":1,"tid":0},"#,
                r#"{"args":{"name":"x"},"name":"thread_name","ph":"M","pid":2,"tid":2},"#,
                r#"{"args":{"name":"D0.u0"},"name":"thread_name","ph":"M","pid":1,"tid":1},"#,
                r#"{"args":{"detail":"batch=4"},"cat":"decode","dur":2000.0,"name":"step","ph":"X","pid":1,"tid":1,"ts":1500000.0},"#,
                r#"{"args":{"detail":""},"cat":"check","name":"hang","ph":"i","pid":2,"s":"t","tid":2,"ts":1600000.0}"#,
                "]}"
            ),
        );
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
