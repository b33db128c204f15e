//! `pdkv run`'s trace files, streamed: the simulation hands its records, in batches, to a writer
//! thread that formats them into `trace.txt` (and `trace.json` when asked) while the run goes
//! on. No record is kept once written, and the channel between them is bounded, so memory stays
//! small however long the run.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::{Scope, ScopedJoinHandle};

use pdkv_sim::trace::{ChromeTrace, TextTrace, TraceRecord, TraceSink};

/// Most bytes of records a trace file gets; a longer trace stops there and ends with a
/// `trace_truncated` record saying how many records were left out (the default budget of 200 M
/// events would otherwise write tens of gigabytes).
pub const MAX_TRACE_BYTES: u64 = 1 << 30;
/// Records per batch handed to the writer: one channel message per few thousand records.
const BATCH: usize = 4096;
/// Batches in flight at most; the simulation waits for the writer beyond that.
const BATCHES_IN_FLIGHT: usize = 8;

/// What the writer thread is sent.
enum Msg {
    Records(Vec<TraceRecord>),
    /// The run ended normally: finish the files (without it, the run failed to start and no
    /// file is written).
    End,
}

/// The trace files written, and a sentence when they were cut short.
#[derive(Debug, Default)]
pub struct Written {
    pub files: Vec<PathBuf>,
    pub truncated: Option<String>,
}

/// Which trace files to write.
#[derive(Clone, Copy, Debug)]
pub struct Which {
    pub text: bool,
    pub chrome: bool,
}

/// The simulation's end: collects records into batches and sends them to the writer.
struct Batches {
    batch: Vec<TraceRecord>,
    tx: Option<SyncSender<Msg>>,
}

impl Batches {
    fn send(&mut self) {
        if let Some(tx) = &self.tx {
            let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
            // The writer stopped (a write failed): it reports why when joined; drop the rest.
            if tx.send(Msg::Records(batch)).is_err() {
                self.tx = None;
            }
        }
        self.batch.clear();
    }
}

impl TraceSink for Batches {
    fn handle_record(&mut self, record: TraceRecord) {
        self.batch.push(record);
        if self.batch.len() >= BATCH {
            self.send();
        }
    }
}

impl Drop for Batches {
    /// The run is over (the world drops its sink): the last records go to the writer.
    fn drop(&mut self) {
        if !self.batch.is_empty() {
            self.send();
        }
    }
}

/// The handle to tell the writer the run ended, and the writer.
pub struct Traces<'scope> {
    end: SyncSender<Msg>,
    writer: ScopedJoinHandle<'scope, Result<Written, String>>,
}

impl Traces<'_> {
    /// Waits for the writer after a run that ended normally.
    pub fn finish(self) -> Result<Written, String> {
        // A failed send means the writer already stopped on an error, which join returns.
        let _ = self.end.send(Msg::End);
        drop(self.end);
        self.writer.join().unwrap_or_else(|_| Err("the trace writer panicked".into()))
    }
}

/// Starts the writer of the trace files `which` in `out` on a thread of `scope`; returns the
/// sink to give the run, and the writer.
pub fn start<'scope>(
    scope: &'scope Scope<'scope, '_>,
    out: &Path,
    which: Which,
) -> (Box<dyn TraceSink>, Traces<'scope>) {
    let (tx, rx) = sync_channel(BATCHES_IN_FLIGHT);
    let out = out.to_path_buf();
    let writer = scope.spawn(move || write(&out, which, rx));
    let sink = Batches { batch: Vec::with_capacity(BATCH), tx: Some(tx.clone()) };
    (Box::new(sink), Traces { end: tx, writer })
}

/// Counts the bytes written through it.
struct Counting<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

type Out = Counting<BufWriter<File>>;

impl Counting<BufWriter<File>> {
    /// Flushes the buffer and the file to the disk, so a full disk is an error here and not a
    /// short file later.
    fn sync(self) -> io::Result<()> {
        self.inner.into_inner().map_err(|e| e.into_error())?.sync_all()
    }
}

/// One trace file being written: its format, its path, and the records left out past its limit.
struct TraceFile {
    format: Format,
    path: PathBuf,
    /// Where the file is written until it is finished and renamed to `path`, so a run that
    /// fails midway (a full disk) leaves no trace cut mid-line under the real name.
    temp: PathBuf,
    dropped: u64,
    last_t_ns: u64,
}

enum Format {
    Text(TextTrace<Out>),
    Chrome(ChromeTrace<Out>),
    /// Finished (its writer closed).
    Done,
}

impl Drop for TraceFile {
    /// A file not finished (the run or a write failed) leaves no temporary file behind; a
    /// finished one was renamed, and removing its old name fails harmlessly.
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.temp);
    }
}

impl TraceFile {
    fn create(out: &Path, name: &str) -> Result<TraceFile, String> {
        std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
        let path = out.join(name);
        let temp = pdkv_sim::files::temp_path(&path);
        let file = File::create(&temp).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let file = Counting { inner: BufWriter::with_capacity(1 << 20, file), bytes: 0 };
        let format = if name.ends_with(".json") {
            ChromeTrace::new(file).map(Format::Chrome)
        } else {
            TextTrace::new(file).map(Format::Text)
        };
        let format = format.map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(TraceFile { format, path, temp, dropped: 0, last_t_ns: 0 })
    }

    fn error(&self, e: io::Error) -> String {
        format!("cannot write {}: {e}", self.path.display())
    }

    fn bytes(&self) -> u64 {
        match &self.format {
            Format::Text(t) => t.writer().bytes,
            Format::Chrome(c) => c.writer().bytes,
            Format::Done => 0,
        }
    }

    fn write(&mut self, r: &TraceRecord) -> io::Result<()> {
        match &mut self.format {
            Format::Text(t) => t.handle_record(r),
            Format::Chrome(c) => c.handle_record(r),
            Format::Done => Ok(()),
        }
    }

    /// Writes `r`, or counts it as left out once the file has reached its limit.
    fn handle_record(&mut self, r: &TraceRecord) -> Result<(), String> {
        self.last_t_ns = r.t_ns;
        if self.bytes() >= MAX_TRACE_BYTES {
            self.dropped += 1;
            return Ok(());
        }
        self.write(r).map_err(|e| self.error(e))
    }

    /// Ends the file (with a `trace_truncated` record when records were left out); a sentence
    /// when they were.
    fn finish(mut self) -> Result<(PathBuf, Option<String>), String> {
        let mut note = None;
        if self.dropped > 0 {
            let record = TraceRecord {
                t_ns: self.last_t_ns,
                dur_ns: None,
                cat: "check",
                name: "trace_truncated",
                track: "sim".into(),
                detail: format!(
                    "{} more records were not written (limit {} MiB per file)",
                    self.dropped,
                    MAX_TRACE_BYTES >> 20
                ),
                link: None,
            };
            self.write(&record).map_err(|e| self.error(e))?;
            let name = self.path.file_name().unwrap_or_default().to_string_lossy().to_string();
            note = Some(format!(
                "{name} stops at {} MiB ({} later records not written)",
                MAX_TRACE_BYTES >> 20,
                self.dropped
            ));
        }
        let finished = match std::mem::replace(&mut self.format, Format::Done) {
            Format::Text(t) => t.finish().and_then(Counting::sync),
            Format::Chrome(c) => c.finish().and_then(Counting::sync),
            Format::Done => Ok(()),
        };
        finished
            .and_then(|()| std::fs::rename(&self.temp, &self.path))
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))?;
        Ok((self.path.clone(), note))
    }
}

/// The writer thread: opens the files at the first message (none when the run never started),
/// writes each record to each file until its byte limit, and finishes them at the end.
fn write(out: &Path, which: Which, rx: Receiver<Msg>) -> Result<Written, String> {
    let Ok(first) = rx.recv() else { return Ok(Written::default()) };
    let mut files = Vec::new();
    for (wanted, name) in [(which.text, "trace.txt"), (which.chrome, "trace.json")] {
        if wanted {
            files.push(TraceFile::create(out, name)?);
        }
    }
    let mut message = Some(first);
    while let Some(Msg::Records(records)) = message.take().or_else(|| rx.recv().ok()) {
        for r in &records {
            for file in &mut files {
                file.handle_record(r)?;
            }
        }
    }
    let mut written = Written::default();
    let mut notes = Vec::new();
    for file in files {
        let (path, note) = file.finish()?;
        written.files.push(path);
        notes.extend(note);
    }
    if !notes.is_empty() {
        written.truncated = Some(notes.join("; "));
    }
    Ok(written)
}
