//! The per-request table, `requests.csv`: one row per request of a run (where it went, its
//! times, its lengths, how it ended and whether the steady-state window counts it), in the
//! columns `vllm bench serve --save-detailed` users compare with.
//!
//! Times are integer nanoseconds in the run and are written as milliseconds with six decimals,
//! exactly (no float rounding), so the file is byte-identical for identical runs and a time in it
//! is the trace's to the nanosecond. TPOT, a quotient, is rounded to six decimals.

use std::io::{self, Write};

use pdkv_core::proxy::Slot;

/// The file's name in a run's folder.
pub const FILE: &str = "requests.csv";

/// The header line, without its newline.
pub const HEADER: &str = "id,arrival_ms,prefill,decode,first_token_ms,finish_ms,ttft_ms,tpot_ms,e2e_ms,\
prompt_tokens,output_tokens,outcome,in_steady_window";

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// It produced all its tokens.
    Finished,
    /// It ended with an error (KV not received, prefill refused).
    Failed,
    /// It was still in flight when the run ended.
    Unfinished,
}

impl RequestOutcome {
    /// The outcome as the table writes it.
    pub fn name(self) -> &'static str {
        match self {
            RequestOutcome::Finished => "finished",
            RequestOutcome::Failed => "failed",
            RequestOutcome::Unfinished => "unfinished",
        }
    }
}

/// One request's row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRow {
    /// The proxy's request number (1, 2, ... in arrival order), as the trace names it.
    pub id: u64,
    /// Its arrival at the proxy.
    pub arrival_ns: u64,
    /// The prefill DP rank that computed its prompt: engine and DP rank, `P1.dp0` (the proxy's
    /// slot, always with its DP rank; a few integers, so a million rows hold no string each).
    pub prefill: Slot,
    /// The decode DP group that generated its tokens: engine and group, `D0.dp3`.
    pub decode: Slot,
    /// The end of its first decode step.
    pub first_token_ns: Option<u64>,
    /// When it ended, finished or failed (`None`: in flight at the end).
    pub done_ns: Option<u64>,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens it was to generate.
    pub output_tokens: u32,
    pub outcome: RequestOutcome,
    /// It arrived inside the steady-state window, so the window's latencies count it.
    pub in_steady_window: bool,
}

/// Nanoseconds as milliseconds with six decimals, exactly.
fn ms(ns: u64) -> String {
    format!("{}.{:06}", ns / 1_000_000, ns % 1_000_000)
}

impl RequestRow {
    /// The row's line, without its newline. A finished request has TTFT, TPOT (with more than
    /// one output token) and E2E, as the run's latencies take them; a failed or unfinished one
    /// leaves them empty.
    pub fn line(&self) -> String {
        let finished = self.outcome == RequestOutcome::Finished;
        let done = self.done_ns.filter(|_| finished);
        // A finished request without a first token had one output token, made by its last step.
        let first = done.map(|done| self.first_token_ns.unwrap_or(done));
        let ttft = first.map(|first| ms(first - self.arrival_ns));
        let tpot = match (first, done) {
            (Some(first), Some(done)) if self.output_tokens > 1 => {
                Some(format!("{:.6}", (done - first) as f64 / 1e6 / f64::from(self.output_tokens - 1)))
            }
            _ => None,
        };
        let e2e = done.map(|done| ms(done - self.arrival_ns));
        let cell = |v: Option<String>| v.unwrap_or_default();
        format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{}",
            self.id,
            ms(self.arrival_ns),
            self.prefill,
            self.decode,
            cell(self.first_token_ns.map(ms)),
            cell(self.done_ns.map(ms)),
            cell(ttft),
            cell(tpot),
            cell(e2e),
            self.prompt_tokens,
            self.output_tokens,
            self.outcome.name(),
            self.in_steady_window
        )
    }
}

/// Writes the whole file to `out`: the header, then a line per row, each ending in a newline.
pub fn write_csv(rows: &[RequestRow], out: &mut dyn Write) -> io::Result<()> {
    writeln!(out, "{HEADER}")?;
    for row in rows {
        writeln!(out, "{}", row.line())?;
    }
    Ok(())
}

/// The whole file as text ([`write_csv`]).
pub fn csv(rows: &[RequestRow]) -> String {
    let mut bytes = Vec::with_capacity(96 * (rows.len() + 1));
    write_csv(rows, &mut bytes).expect("writing to memory does not fail");
    String::from_utf8(bytes).expect("the table is ASCII")
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::EngineId;

    fn row(outcome: RequestOutcome, first: Option<u64>, done: Option<u64>, output: u32) -> RequestRow {
        RequestRow {
            id: 7,
            arrival_ns: 1_500_000_123,
            prefill: Slot { engine: EngineId::prefill(1), dp_rank: Some(0) },
            decode: Slot { engine: EngineId::decode(0), dp_rank: Some(3) },
            first_token_ns: first,
            done_ns: done,
            prompt_tokens: 8192,
            output_tokens: output,
            outcome,
            in_steady_window: true,
        }
    }

    /// (row) -> its line: exact milliseconds, empty latencies where the request did not finish.
    #[test]
    fn rows_are_written_exactly_with_empty_cells_for_what_was_not_measured() {
        let check = |row: RequestRow, expected: &str| assert_eq!(row.line(), expected);
        check(
            row(RequestOutcome::Finished, Some(2_000_000_000), Some(12_000_000_000), 1001),
            "7,1500.000123,P1.dp0,D0.dp3,2000.000000,12000.000000,499.999877,10.000000,10499.999877,8192,1001,\
             finished,true",
        );
        // One output token: no TPOT; no first-token step either, so TTFT is E2E.
        check(
            row(RequestOutcome::Finished, None, Some(1_600_000_000), 1),
            "7,1500.000123,P1.dp0,D0.dp3,,1600.000000,99.999877,,99.999877,8192,1,finished,true",
        );
        check(
            row(RequestOutcome::Failed, None, Some(3_000_000_000), 64),
            "7,1500.000123,P1.dp0,D0.dp3,,3000.000000,,,,8192,64,failed,true",
        );
        check(
            row(RequestOutcome::Unfinished, Some(2_000_000_000), None, 64),
            "7,1500.000123,P1.dp0,D0.dp3,2000.000000,,,,,8192,64,unfinished,true",
        );
        let text = csv(&[row(RequestOutcome::Unfinished, None, None, 2)]);
        assert_eq!(text.lines().next(), Some(HEADER));
        assert_eq!(text.lines().count(), 2);
        assert!(text.ends_with("unfinished,true\n"));
        assert_eq!(HEADER.split(',').count(), text.lines().nth(1).unwrap().split(',').count());
    }
}
