//! Progress bars on a terminal (indicatif), silent when output goes to a file, a CI log or a
//! terminal that says it is dumb (`TERM=dumb`).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Shows a bar only when stderr is a terminal and the work has lasted a moment, so quick runs
/// and logs stay clean.
pub struct Bar {
    bar: Option<ProgressBar>,
    started: Instant,
    label: String,
    delay: Duration,
}

impl Bar {
    /// A bar for `label` that appears after `delay`.
    pub fn new(label: impl Into<String>, delay: Duration) -> Bar {
        Bar { bar: None, started: Instant::now(), label: label.into(), delay }
    }

    /// Reports `done` of `total` with a short message.
    pub fn update(&mut self, done: u64, total: u64, message: String) {
        if self.bar.is_none() {
            // TERM=dumb marks a terminal that is really a log (a serial console, say).
            let dumb = std::env::var_os("TERM").is_some_and(|t| t == "dumb");
            if !std::io::stderr().is_terminal() || dumb || self.started.elapsed() < self.delay {
                return;
            }
            let bar = ProgressBar::new(total);
            // The time left is indicatif's estimate from the recent rate: a long search or run
            // says when it will end, not only how far it got.
            let style = ProgressStyle::with_template(
                "{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}, ~{eta} left)",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar.set_prefix(self.label.clone());
            self.bar = Some(bar);
        }
        if let Some(bar) = &self.bar {
            bar.set_length(total);
            bar.set_position(done);
            bar.set_message(message);
        }
    }

    /// Removes the bar.
    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
