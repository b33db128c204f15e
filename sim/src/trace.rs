//! The run's trace: compact records in virtual time, handed to a sink the caller supplies as
//! they are produced, and written as text or as a Chrome trace one record at a time.
//!
//! The simulator keeps no trace itself: a run with a sink formats each record and passes it on
//! (the command line streams it to disk), a run without one formats nothing. So a long run's
//! trace costs no memory here, and the sink decides what to keep.
//!
//! A request can be followed from arrival to finish: every record that concerns one request
//! names it (`req-N`, the proxy's number), and records of its life carry a [`Link`] that the
//! Chrome trace draws as an async slice per request (arrival, prefill done, first token,
//! finish), a flow arrow from the prefill step that computed its prompt to the first read of its
//! KV, and a counter of requests in flight.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};
use std::rc::Rc;

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
    pub name: &'static str,
    /// The rank or component it happened on, e.g. `P0.dp0.tp3`, `D0.dp1`, `proxy`.
    pub track: String,
    /// Details, `key=value` separated by spaces.
    pub detail: String,
    /// What ties the record to a request's life, a flow or a counter in the Chrome trace; the
    /// text trace writes every record as one line whatever its link.
    pub link: Option<Link>,
}

/// What a record means besides its line, for the Chrome trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Link {
    /// A moment of request `request`'s life, the record's track being the request's label
    /// (`req-N`): `Begin` (its arrival) opens an async slice of that name, `End` (its finish)
    /// closes it, and each is also an instant named by the record.
    Life { request: u64, phase: Phase },
    /// The start of the flow of request `request`'s KV, inside the prefill step that computed
    /// the last of its prompt (the slice enclosing the record's time on its track).
    FlowStart { request: u64 },
    /// A span that ends request `request`'s flow: the first read of its KV that completes (later
    /// reads of the same request draw no arrow).
    FlowEnd { request: u64 },
    /// The value of the counter the record names.
    Counter { value: u64 },
    /// A NIC's load after its flows changed: the reads moving through it and the bytes a second
    /// they move together, a counter track named by the NIC's rank (the record's track).
    NicLoad { reads: u64, rate_mb_s: u64 },
}

/// Where a moment stands in a request's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Phase {
    /// Its arrival: the life begins.
    Begin,
    /// A moment inside it (prefill done, first token).
    Instant,
    /// Its finish (or failure): the life ends.
    End,
}

/// Where a run's trace records go, in the order they are produced: the virtual time order of
/// their production, which is their start's except for a KV read's span, produced when the read
/// ends (its length depends on the NIC sharing until then) and starting at its post. A run
/// calls it and nothing else; what happens to a record (a file, a channel, memory) is the
/// caller's, so the run stays a pure function of (scenario, seed).
pub trait TraceSink {
    /// Takes the next record.
    fn handle_record(&mut self, record: TraceRecord);
}

/// A sink that keeps every record in memory, for tests and small runs: a clone shares the
/// records, so the caller keeps one and hands the run the other.
#[derive(Clone, Debug, Default)]
pub struct TraceMemory(Rc<RefCell<Vec<TraceRecord>>>);

impl TraceMemory {
    /// The records so far.
    pub fn records(&self) -> Vec<TraceRecord> {
        self.0.borrow().clone()
    }
}

impl TraceSink for TraceMemory {
    fn handle_record(&mut self, record: TraceRecord) {
        self.0.borrow_mut().push(record);
    }
}

/// The text trace's first line.
pub const TEXT_HEADER: &str = "# virtual time   category   track           event            detail\n";

/// Writes the compact text trace, one line per record, virtual time first.
pub struct TextTrace<W: Write> {
    out: W,
}

impl<W: Write> TextTrace<W> {
    /// Starts the trace: writes the header line.
    pub fn new(mut out: W) -> io::Result<Self> {
        out.write_all(TEXT_HEADER.as_bytes())?;
        Ok(TextTrace { out })
    }

    /// Writes one record's line. Written piece by piece, with no string per record: a long
    /// run's trace has millions of lines.
    pub fn handle_record(&mut self, r: &TraceRecord) -> io::Result<()> {
        let (seconds, nanos) = (r.t_ns / 1_000_000_000, r.t_ns % 1_000_000_000);
        // The time `S.NNNNNNNNNs`, right-aligned in 16 columns as `{:>16}` would.
        let width = digits(seconds) + 11;
        write!(self.out, "{:pad$}{seconds}.{nanos:09}s", "", pad = 16usize.saturating_sub(width))?;
        write!(self.out, "  {:<9}  {:<14}  {:<15}  {}", r.cat, r.track, r.name, r.detail)?;
        if let Some(d) = r.dur_ns {
            write!(self.out, " ({:.3} ms)", d as f64 / 1e6)?;
        }
        self.out.write_all(b"\n")
    }

    /// The writer (to count what went out, say).
    pub fn writer(&self) -> &W {
        &self.out
    }

    /// Flushes the trace and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Decimal digits of `n`.
fn digits(mut n: u64) -> usize {
    let mut count = 1;
    while n >= 10 {
        n /= 10;
        count += 1;
    }
    count
}

/// One Chrome trace event. Fields are in alphabetical order, the order `serde_json` gave the
/// map of the first writer, so tools that matched its bytes still match; typed events serialise
/// straight into the output instead of building a JSON tree per record.
#[derive(Serialize)]
struct ChromeEvent<'a> {
    args: ChromeArgs<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bp: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
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
    Name {
        name: &'a str,
    },
    Detail {
        detail: &'a str,
    },
    Counter {
        requests: u64,
    },
    NicLoad {
        reads: u64,
        #[serde(rename = "MB/s")]
        rate_mb_s: u64,
    },
    None {},
}

/// The category and name of the flow events that tie a prefill step to a read.
const FLOW_CAT: &str = "kv";
const FLOW_NAME: &str = "kv transfer";

/// Writes the Chrome trace-event JSON (loadable in Perfetto or `chrome://tracing`) one record at
/// a time: spans as complete events, instants as instant events, one process per category and
/// one thread per track, numbered in order of first appearance. A process's or thread's
/// metadata event comes just before its first record (the format allows metadata anywhere), so
/// nothing needs the whole trace first.
pub struct ChromeTrace<W: Write> {
    out: W,
    /// Each category's process id and its tracks' thread ids.
    ids: BTreeMap<&'static str, (usize, BTreeMap<String, usize>)>,
    threads: usize,
    first: bool,
    /// Requests whose flow started and has not ended yet.
    flows: BTreeSet<u64>,
}

impl<W: Write> ChromeTrace<W> {
    /// Starts the trace: writes the file's opening.
    pub fn new(mut out: W) -> io::Result<Self> {
        out.write_all(br#"{"displayTimeUnit":"ms","traceEvents":["#)?;
        Ok(ChromeTrace { out, ids: BTreeMap::new(), threads: 0, first: true, flows: BTreeSet::new() })
    }

    fn event(&mut self, event: &ChromeEvent) -> io::Result<()> {
        if !self.first {
            self.out.write_all(b",")?;
        }
        self.first = false;
        serde_json::to_writer(&mut self.out, event).map_err(io::Error::from)
    }

    fn meta(&mut self, name: &str, pid: usize, tid: usize, label: &str) -> io::Result<()> {
        let event = ChromeEvent {
            args: ChromeArgs::Name { name: label },
            bp: None,
            cat: None,
            dur: None,
            id: None,
            name,
            ph: "M",
            pid,
            s: None,
            tid,
            ts: None,
        };
        self.event(&event)
    }

    /// The process id of category `cat`, after its metadata if it is new.
    fn pid(&mut self, cat: &'static str) -> io::Result<usize> {
        Ok(match self.ids.get(cat) {
            Some(&(pid, _)) => pid,
            None => {
                let pid = self.ids.len() + 1;
                self.ids.insert(cat, (pid, BTreeMap::new()));
                self.meta("process_name", pid, 0, cat)?;
                pid
            }
        })
    }

    /// Writes a request's life moment or a counter: events of the category's process with no
    /// thread of their own (an async slice per request, a counter track), so a run of a million
    /// requests adds no million threads.
    fn process_event(&mut self, r: &TraceRecord, link: Link) -> io::Result<()> {
        let pid = self.pid(r.cat)?;
        let ts = Some(r.t_ns as f64 / 1e3);
        let event = |args, id, name, ph| ChromeEvent {
            args,
            bp: None,
            cat: Some(r.cat),
            dur: None,
            id,
            name,
            ph,
            pid,
            s: None,
            tid: 0,
            ts,
        };
        let detail = ChromeArgs::Detail { detail: &r.detail };
        match link {
            Link::Life { request, phase } => {
                if phase == Phase::Begin {
                    self.event(&event(ChromeArgs::None {}, Some(request), &r.track, "b"))?;
                }
                self.event(&event(detail, Some(request), r.name, "n"))?;
                if phase == Phase::End {
                    self.event(&event(ChromeArgs::None {}, Some(request), &r.track, "e"))?;
                }
                Ok(())
            }
            Link::Counter { value } => {
                self.event(&event(ChromeArgs::Counter { requests: value }, None, r.name, "C"))
            }
            Link::NicLoad { reads, rate_mb_s } => {
                self.event(&event(ChromeArgs::NicLoad { reads, rate_mb_s }, None, &r.track, "C"))
            }
            Link::FlowStart { .. } | Link::FlowEnd { .. } => Ok(()),
        }
    }

    /// Writes one record, after the metadata of its category and track if they are new.
    pub fn handle_record(&mut self, r: &TraceRecord) -> io::Result<()> {
        if let Some(link @ (Link::Life { .. } | Link::Counter { .. } | Link::NicLoad { .. })) = r.link {
            return self.process_event(r, link);
        }
        let pid = self.pid(r.cat)?;
        let tid = match self.ids[r.cat].1.get(r.track.as_str()) {
            Some(&tid) => tid,
            None => {
                self.threads += 1;
                let tid = self.threads;
                if let Some((_, tracks)) = self.ids.get_mut(r.cat) {
                    tracks.insert(r.track.clone(), tid);
                }
                self.meta("thread_name", pid, tid, &r.track)?;
                tid
            }
        };
        // Chrome traces count microseconds; keep nanosecond precision as a fraction.
        let span = r.dur_ns.is_some();
        let flow = |ph, bp, id, t_ns: u64| ChromeEvent {
            args: ChromeArgs::None {},
            bp,
            cat: Some(FLOW_CAT),
            dur: None,
            id: Some(id),
            name: FLOW_NAME,
            ph,
            pid,
            s: None,
            tid,
            ts: Some(t_ns as f64 / 1e3),
        };
        if let Some(Link::FlowStart { request }) = r.link {
            // A flow's start binds to the slice enclosing its time on its thread: the step.
            self.flows.insert(request);
            return self.event(&flow("s", None, request, r.t_ns));
        }
        let event = ChromeEvent {
            args: ChromeArgs::Detail { detail: &r.detail },
            bp: None,
            cat: Some(r.cat),
            dur: r.dur_ns.map(|d| d as f64 / 1e3),
            id: None,
            name: r.name,
            ph: if span { "X" } else { "i" },
            pid,
            s: (!span).then_some("t"),
            tid,
            ts: Some(r.t_ns as f64 / 1e3),
        };
        self.event(&event)?;
        match r.link {
            // The flow ends inside this span (the middle of it, so the enclosing slice is it).
            Some(Link::FlowEnd { request }) if self.flows.remove(&request) => {
                let middle = r.t_ns + r.dur_ns.unwrap_or(0) / 2;
                self.event(&flow("f", Some("e"), request, middle))
            }
            _ => Ok(()),
        }
    }

    /// The writer (to count what went out, say).
    pub fn writer(&self) -> &W {
        &self.out
    }

    /// Closes the JSON, flushes and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.write_all(b"]}")?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// The whole text trace of `records`.
pub fn to_text(records: &[TraceRecord]) -> String {
    let mut trace = TextTrace::new(Vec::with_capacity(records.len() * 80)).expect("writing to memory");
    for r in records {
        trace.handle_record(r).expect("writing to memory");
    }
    String::from_utf8(trace.finish().expect("writing to memory")).expect("the trace is UTF-8")
}

/// The whole Chrome trace of `records`.
pub fn to_chrome(records: &[TraceRecord]) -> String {
    let mut trace = ChromeTrace::new(Vec::with_capacity(records.len() * 150)).expect("writing to memory");
    for r in records {
        trace.handle_record(r).expect("writing to memory");
    }
    String::from_utf8(trace.finish().expect("writing to memory")).expect("the trace is UTF-8")
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
                name: "step",
                track: "D0.u0".into(),
                detail: "batch=4".into(),
                link: None,
            },
            TraceRecord {
                t_ns: 1_600_000_000,
                dur_ns: None,
                cat: "check",
                name: "hang",
                track: "x".into(),
                detail: String::new(),
                link: None,
            },
            TraceRecord {
                t_ns: 12_345_678_901_234,
                dur_ns: Some(1),
                cat: "decode",
                name: "step",
                track: "D0.u0".into(),
                detail: "batch=1".into(),
                link: None,
            },
        ]
    }

    /// The Chrome file, byte for byte: keys in alphabetical order, each process's and thread's
    /// metadata just before its first event, ids in order of first appearance.
    #[test]
    fn chrome_trace_is_byte_stable() {
        let check = |records: &[TraceRecord], expected: &str| assert_eq!(to_chrome(records), expected);
        check(&[], r#"{"displayTimeUnit":"ms","traceEvents":[]}"#);
        check(
            &records(),
            concat!(
                r#"{"displayTimeUnit":"ms","traceEvents":["#,
                r#"{"args":{"name":"decode"},"name":"process_name","ph":"M","pid":1,"tid":0},"#,
                r#"{"args":{"name":"D0.u0"},"name":"thread_name","ph":"M","pid":1,"tid":1},"#,
                r#"{"args":{"detail":"batch=4"},"cat":"decode","dur":2000.0,"name":"step","ph":"X","pid":1,"tid":1,"ts":1500000.0},"#,
                r#"{"args":{"name":"check"},"name":"process_name","ph":"M","pid":2,"tid":0},"#,
                r#"{"args":{"name":"x"},"name":"thread_name","ph":"M","pid":2,"tid":2},"#,
                r#"{"args":{"detail":""},"cat":"check","name":"hang","ph":"i","pid":2,"s":"t","tid":2,"ts":1600000.0},"#,
                r#"{"args":{"detail":"batch=1"},"cat":"decode","dur":0.001,"name":"step","ph":"X","pid":1,"tid":1,"ts":12345678901.234}"#,
                "]}"
            ),
        );
    }

    /// A request's life, its KV's flow and the in-flight counter, byte for byte: the life is an
    /// async slice named by the request on its category's process (no thread per request) with
    /// an instant per moment; the flow starts inside the prefill step and ends in the middle of
    /// the first read only (a second read of the request draws no arrow); the counters (requests
    /// in flight, a NIC's load named by its rank) are counter events.
    #[test]
    fn request_lives_flows_and_counters_are_chrome_events() {
        let rec =
            |t_ns: u64, dur_ns: Option<u64>, cat: &'static str, name: &'static str, track: &str, link| {
                TraceRecord {
                    t_ns,
                    dur_ns,
                    cat,
                    name,
                    track: track.into(),
                    detail: name.to_string(),
                    link: Some(link),
                }
            };
        let life = |phase| Link::Life { request: 5, phase };
        let records = [
            rec(1_000, None, "request", "arrival", "req-5", life(Phase::Begin)),
            rec(1_000, None, "request", "in_flight", "proxy", Link::Counter { value: 3 }),
            TraceRecord {
                link: None,
                ..rec(2_000, Some(4_000), "prefill", "batch", "P0.dp0", life(Phase::Instant))
            },
            rec(5_999, None, "prefill", "flow_start", "P0.dp0", Link::FlowStart { request: 5 }),
            rec(5_999, None, "request", "prefill_done", "req-5", life(Phase::Instant)),
            rec(7_000, Some(2_000), "nic", "read", "P0.dp0.tp0", Link::FlowEnd { request: 5 }),
            rec(7_500, Some(2_000), "nic", "read", "P0.dp0.tp1", Link::FlowEnd { request: 5 }),
            rec(9_000, None, "request", "finish", "req-5", life(Phase::End)),
            rec(9_500, None, "nic", "load", "P0.dp0.tp1", Link::NicLoad { reads: 2, rate_mb_s: 48_000 }),
        ];
        let chrome = to_chrome(&records);
        let expected = concat!(
            r#"{"displayTimeUnit":"ms","traceEvents":["#,
            r#"{"args":{"name":"request"},"name":"process_name","ph":"M","pid":1,"tid":0},"#,
            r#"{"args":{},"cat":"request","id":5,"name":"req-5","ph":"b","pid":1,"tid":0,"ts":1.0},"#,
            r#"{"args":{"detail":"arrival"},"cat":"request","id":5,"name":"arrival","ph":"n","pid":1,"tid":0,"ts":1.0},"#,
            r#"{"args":{"requests":3},"cat":"request","name":"in_flight","ph":"C","pid":1,"tid":0,"ts":1.0},"#,
            r#"{"args":{"name":"prefill"},"name":"process_name","ph":"M","pid":2,"tid":0},"#,
            r#"{"args":{"name":"P0.dp0"},"name":"thread_name","ph":"M","pid":2,"tid":1},"#,
            r#"{"args":{"detail":"batch"},"cat":"prefill","dur":4.0,"name":"batch","ph":"X","pid":2,"tid":1,"ts":2.0},"#,
            r#"{"args":{},"cat":"kv","id":5,"name":"kv transfer","ph":"s","pid":2,"tid":1,"ts":5.999},"#,
            r#"{"args":{"detail":"prefill_done"},"cat":"request","id":5,"name":"prefill_done","ph":"n","pid":1,"tid":0,"ts":5.999},"#,
            r#"{"args":{"name":"nic"},"name":"process_name","ph":"M","pid":3,"tid":0},"#,
            r#"{"args":{"name":"P0.dp0.tp0"},"name":"thread_name","ph":"M","pid":3,"tid":2},"#,
            r#"{"args":{"detail":"read"},"cat":"nic","dur":2.0,"name":"read","ph":"X","pid":3,"tid":2,"ts":7.0},"#,
            r#"{"args":{},"bp":"e","cat":"kv","id":5,"name":"kv transfer","ph":"f","pid":3,"tid":2,"ts":8.0},"#,
            r#"{"args":{"name":"P0.dp0.tp1"},"name":"thread_name","ph":"M","pid":3,"tid":3},"#,
            r#"{"args":{"detail":"read"},"cat":"nic","dur":2.0,"name":"read","ph":"X","pid":3,"tid":3,"ts":7.5},"#,
            r#"{"args":{"detail":"finish"},"cat":"request","id":5,"name":"finish","ph":"n","pid":1,"tid":0,"ts":9.0},"#,
            r#"{"args":{},"cat":"request","id":5,"name":"req-5","ph":"e","pid":1,"tid":0,"ts":9.0},"#,
            r#"{"args":{"reads":2,"MB/s":48000},"cat":"nic","name":"P0.dp0.tp1","ph":"C","pid":3,"tid":0,"ts":9.5}"#,
            "]}"
        );
        assert_eq!(chrome, expected);
        // The text trace has a line per record, whatever its link.
        assert_eq!(to_text(&records).lines().count(), 1 + records.len());
    }

    /// The text trace, byte for byte: the time right-aligned in 16 columns (wider when it needs
    /// more), the columns padded, spans with their duration.
    #[test]
    fn text_trace_is_byte_stable() {
        assert_eq!(to_text(&[]), TEXT_HEADER);
        let expected = concat!(
            "# virtual time   category   track           event            detail\n",
            "    1.500000000s  decode     D0.u0           step             batch=4 (2.000 ms)\n",
            "    1.600000000s  check      x               hang             \n",
            "12345.678901234s  decode     D0.u0           step             batch=1 (0.000 ms)\n",
        );
        assert_eq!(to_text(&records()), expected);
        let long = TraceRecord { t_ns: u64::MAX, ..records()[1].clone() };
        assert!(to_text(&[long]).contains("\n18446744073.709551615s  check "));
    }

    #[test]
    fn chrome_is_valid_json() {
        let chrome: serde_json::Value = serde_json::from_str(&to_chrome(&records())).unwrap();
        let events = chrome["traceEvents"].as_array().unwrap();
        let span = events.iter().find(|e| e["ph"] == "X").unwrap();
        assert_eq!((span["ts"].as_f64(), span["dur"].as_f64()), (Some(1_500_000.0), Some(2_000.0)));
        assert!(events.iter().any(|e| e["ph"] == "i" && e["name"] == "hang"));
    }

    #[test]
    fn memory_sink_shares_its_records_with_its_clones() {
        let memory = TraceMemory::default();
        let mut sink: Box<dyn TraceSink> = Box::new(memory.clone());
        for r in records() {
            sink.handle_record(r);
        }
        assert_eq!(memory.records(), records());
    }
}
