//! The forger (`pdkv cluster --forge-messages`): a process outside the deployment that sends
//! forged releases and read leases to every prefill rank's notify listener, for each transfer
//! the scheduler tells it of, to show that only the deployment's own ranks change a transfer's
//! fate.
//!
//! It models the strongest attacker short of one holding the deployment's key: one that sniffs
//! the network. The scheduler feeds it each transfer's id the moment the transfer is registered
//! (when a real `kv_transfer_params` would leave for the proxy), and it knows the decode ranks'
//! sender keys (engine id, DP and TP rank) and the prefill notify ports, as anyone reading the
//! traffic would. For each id and each prefill notify listener it sends, as a plain MoRIIO peer:
//! one release per decode sender key with no MAC and one with a wrong MAC, the legacy
//! plain-string completion, and a read lease of `u32::MAX` ms (49 days) with no MAC and one with
//! a wrong MAC. Under `--control-auth require` every one is refused; under `open` the releases
//! free blocks under live reads, which the run's checks catch.
//!
//! The forger is `pdkv forge` (hidden), spawned by the scheduler with the targets and senders on
//! its command line. It reads transfer ids on its standard input, one per line, and writes on
//! its standard output `from <address>` for each connection it opens (so that the scheduler can
//! tell the forger's refused messages from any other's) and, after each id, `sent <releases>
//! <leases>` (the totals so far).

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::thread;
use std::time::Duration;

use pdkv_core::auth::{Mac, MAC_BYTES};
use pdkv_core::ids::TransferId;
use pdkv_core::release::{Release, ReleaseSender};
use pdkv_core::wire::{self, ControlMessage, ReadLease};
use serde::Serialize;

use super::errors::{SpawnError, Spawned};
use super::Ev;
use crate::zmtp::{Connection, SocketType};

/// How long the forger waits to connect to, or write to, one notify listener.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Transfer ids queued for the forger and not yet written to its input; more are dropped (and
/// counted): the forger is a test's attacker, and never slows the run.
const MAX_QUEUED_IDS: usize = 4096;
/// Longest line the forger reads or the scheduler reads from it.
const MAX_LINE_BYTES: u64 = 4096;
/// Most forger addresses the scheduler remembers (a forger reconnects only after a failure).
const MAX_ADDRESSES: usize = 1024;

/// What the forger sends, and to whom.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForgerPlan {
    /// Every prefill rank's notify listener.
    pub targets: Vec<SocketAddr>,
    /// Every decode rank's sender key, with its engine's TP size (the release's
    /// `consumer_tp_size`).
    pub senders: Vec<(ReleaseSender, u16)>,
}

impl ForgerPlan {
    /// The forger's command-line arguments for this plan (`--target`, `--sender`).
    fn args(&self) -> Vec<String> {
        let mut args = Vec::new();
        for target in &self.targets {
            args.extend(["--target".to_string(), target.to_string()]);
        }
        for (sender, tp) in &self.senders {
            args.extend([
                "--sender".to_string(),
                format!("{},{},{},{tp}", sender.engine_id, sender.dp_rank, sender.tp_rank),
            ]);
        }
        args
    }
}

/// Why a `--sender` value is not a sender key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SenderError {
    /// Not four comma-separated parts.
    Shape {
        /// The value.
        text: String,
    },
    /// A part that should be a number is not one.
    Number {
        /// The value.
        text: String,
        /// Which part.
        what: &'static str,
        /// The part.
        part: String,
        /// Why.
        error: std::num::ParseIntError,
    },
}

impl fmt::Display for SenderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SenderError::Shape { text } => {
                write!(f, "{text:?}: expected <engine id>,<dp>,<tp>,<consumer tp size>")
            }
            SenderError::Number { text, what, part, error } => {
                write!(f, "{text:?}: {what} {part:?}: {error}")
            }
        }
    }
}

impl std::error::Error for SenderError {}

/// Parses a `--sender` value, `<engine id>,<dp>,<tp>,<consumer tp size>`.
pub fn parse_sender(text: &str) -> Result<(ReleaseSender, u16), SenderError> {
    let parts: Vec<&str> = text.rsplitn(4, ',').collect();
    let [tp_size, tp, dp, engine_id] = parts.as_slice() else {
        return Err(SenderError::Shape { text: text.to_owned() });
    };
    let number = |what: &'static str, part: &str| {
        part.parse::<u16>().map_err(|error| SenderError::Number {
            text: text.to_owned(),
            what,
            part: part.to_owned(),
            error,
        })
    };
    Ok((
        ReleaseSender {
            engine_id: engine_id.to_string(),
            dp_rank: number("dp", dp)?,
            tp_rank: number("tp", tp)?,
        },
        number("consumer tp size", tp_size)?,
    ))
}

// ------------------------------------------------------------------------- the forger's side

/// What the forger sent, for its last line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// Releases (map and legacy string forms).
    pub releases: u64,
    /// Read leases.
    pub leases: u64,
}

/// The forged messages for one transfer, as they go on the wire, each tagged release or lease.
fn forged(plan: &ForgerPlan, transfer_id: &TransferId, wrong: &mut u64) -> Vec<(bool, Vec<u8>)> {
    // Any 16 bytes are a wrong MAC for an attacker without the key; these differ per message.
    let mut wrong_mac = || {
        *wrong += 1;
        let mut mac = [0u8; MAC_BYTES];
        mac[..8].copy_from_slice(&wrong.to_le_bytes());
        mac[8..].copy_from_slice(&wrong.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
        Mac(mac)
    };
    let mut out = Vec::new();
    for (sender, tp_size) in &plan.senders {
        for mac in [None, Some(wrong_mac())] {
            let release = Release {
                transfer_id: transfer_id.clone(),
                consumer_tp_size: Some(*tp_size),
                sender: Some(sender.clone()),
                incarnation: None,
                mac,
            };
            out.push((true, wire::encode(&ControlMessage::Release(release))));
        }
    }
    out.push((true, wire::encode(&ControlMessage::LegacyCompletion(transfer_id.clone()))));
    for mac in [None, Some(wrong_mac())] {
        let lease =
            ReadLease { transfer_id: transfer_id.clone(), lease_ms: u32::MAX, incarnation: None, mac };
        out.push((false, wire::encode(&ControlMessage::ReadLease(lease))));
    }
    out
}

/// Why the forger stopped: its standard input or output failed.
#[derive(Debug)]
pub enum ForgerError {
    /// Reading a transfer id failed.
    Stdin(io::Error),
    /// Saying what it did failed.
    Stdout(io::Error),
}

impl fmt::Display for ForgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ForgerError::Stdin(e) => write!(f, "stdin: {e}"),
            ForgerError::Stdout(e) => write!(f, "stdout: {e}"),
        }
    }
}

impl std::error::Error for ForgerError {}

/// Runs the forger: for each transfer id read from `input`, sends the forged messages to every
/// target, and says on `output` where it sends from and how much it sent so far. A target it cannot reach loses that message (it tries again for the next id).
pub fn run_forger(plan: &ForgerPlan, input: impl Read, mut output: impl Write) -> Result<Sent, ForgerError> {
    let mut conns: BTreeMap<SocketAddr, Connection> = BTreeMap::new();
    let mut sent = Sent::default();
    let mut wrong = 0u64;
    let mut reader = BufReader::new(input);
    let say = |line: String, output: &mut dyn Write| {
        writeln!(output, "{line}").and_then(|()| output.flush()).map_err(ForgerError::Stdout)
    };
    loop {
        let mut line = Vec::new();
        match (&mut reader).take(MAX_LINE_BYTES).read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => return Err(ForgerError::Stdin(e)),
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let transfer_id = TransferId::new(text.to_string());
        let messages = forged(plan, &transfer_id, &mut wrong);
        for &target in &plan.targets {
            let conn = match conns.entry(target) {
                std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
                std::collections::btree_map::Entry::Vacant(entry) => {
                    let Ok(conn) = Connection::connect(target, SocketType::Dealer, None, SEND_TIMEOUT) else {
                        continue;
                    };
                    if let Ok(local) = conn.local_addr() {
                        say(format!("from {local}"), &mut output)?;
                    }
                    entry.insert(conn)
                }
            };
            let mut broken = false;
            for (release, bytes) in &messages {
                if conn.send(&[bytes]).is_err() {
                    broken = true;
                    break;
                }
                if *release {
                    sent.releases += 1;
                } else {
                    sent.leases += 1;
                }
            }
            if broken {
                conns.remove(&target);
            }
        }
        // The totals so far after each id, so that a forger killed at the end of the run has
        // still told what it sent.
        say(format!("sent {} {}", sent.releases, sent.leases), &mut output)?;
    }
    Ok(sent)
}

// ---------------------------------------------------------------------- the scheduler's side

/// What the forger said.
#[derive(Debug)]
pub(super) enum ForgerEvent {
    /// It opened a connection from this address.
    From(String),
    /// It sent this much so far.
    Sent(Sent),
    /// Its output closed.
    Closed,
}

/// What the run's forger did and what the prefill ranks made of it, for the result.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Forged {
    /// Transfer ids given to the forger.
    pub ids_fed: u64,
    /// Transfer ids not given to it because it was behind (its queue was full).
    pub ids_dropped: u64,
    /// Releases it sent (as it counted them; 0 when it never said).
    pub releases_sent: u64,
    /// Leases it sent.
    pub leases_sent: u64,
    /// Of the messages the prefill ranks refused, those that came from the forger.
    pub refused: u64,
    /// The addresses it sent from.
    pub from: Vec<String>,
}

/// The running forger.
pub(super) struct Forger {
    child: Child,
    pgid: u32,
    input: Option<SyncSender<TransferId>>,
    pub(super) report: Forged,
    pub(super) closed: bool,
    /// Whether [`Forger::finish`] reaped it.
    reaped: bool,
}

impl Forger {
    /// Starts `exe forge` with `plan`; its lines arrive on `tx` as [`Ev::Forger`].
    pub(super) fn start(
        exe: &std::path::Path,
        plan: &ForgerPlan,
        tx: Sender<Ev>,
    ) -> Result<Forger, SpawnError> {
        let mut command = Command::new(exe);
        command.arg("forge").args(plan.args()).process_group(0).stdin(Stdio::piped()).stdout(Stdio::piped());
        crate::signals::die_with_parent(&mut command);
        let mut child = command.spawn().map_err(|error| SpawnError {
            what: Spawned::Forger,
            program: exe.to_path_buf(),
            error,
        })?;
        let stdin = child.stdin.take().expect("stdin was piped");
        let stdout = child.stdout.take().expect("stdout was piped");
        thread::spawn(move || read_lines(stdout, &tx));
        let (input, ids) = mpsc::sync_channel(MAX_QUEUED_IDS);
        thread::spawn(move || write_ids(stdin, &ids));
        Ok(Forger {
            pgid: child.id(),
            child,
            input: Some(input),
            report: Forged::default(),
            closed: false,
            reaped: false,
        })
    }

    /// Gives the forger a transfer id, never waiting for it.
    pub(super) fn feed(&mut self, transfer_id: &TransferId) {
        let Some(input) = self.input.as_ref() else { return };
        match input.try_send(transfer_id.clone()) {
            Ok(()) => self.report.ids_fed += 1,
            Err(TrySendError::Full(_)) => self.report.ids_dropped += 1,
            Err(TrySendError::Disconnected(_)) => self.input = None,
        }
    }

    /// Takes in one thing the forger said.
    pub(super) fn on_event(&mut self, event: ForgerEvent) {
        match event {
            ForgerEvent::From(address) => {
                if self.report.from.len() < MAX_ADDRESSES && !self.report.from.contains(&address) {
                    self.report.from.push(address);
                }
            }
            ForgerEvent::Sent(sent) => {
                self.report.releases_sent = sent.releases;
                self.report.leases_sent = sent.leases;
            }
            ForgerEvent::Closed => self.closed = true,
        }
    }

    /// Ends the forger's input: it sends what it has, says how much it sent, and exits.
    pub(super) fn close_input(&mut self) {
        self.input = None;
    }

    /// Kills what is left of the forger's process group and reaps it, once: the group is
    /// killed before its leader is reaped, so that its id cannot have been reused meanwhile,
    /// and never after.
    pub(super) fn finish(&mut self) {
        self.input = None;
        if self.reaped {
            return;
        }
        crate::signals::kill_group(self.pgid, crate::signals::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reaped = true;
    }
}

impl Drop for Forger {
    /// A run that ends without [`Forger::finish`] (a panic) still takes the forger down.
    fn drop(&mut self) {
        self.finish();
    }
}

/// Writes the ids to the forger's input until the queue or the input closes.
fn write_ids(stdin: ChildStdin, ids: &Receiver<TransferId>) {
    let mut stdin = std::io::BufWriter::new(stdin);
    loop {
        // Write what is queued, then flush before waiting, so no id waits in the buffer.
        let Ok(id) = ids.recv() else { return };
        if writeln!(stdin, "{id}").is_err() {
            return;
        }
        while let Ok(id) = ids.try_recv() {
            if writeln!(stdin, "{id}").is_err() {
                return;
            }
        }
        if stdin.flush().is_err() {
            return;
        }
    }
}

/// Reads the forger's lines until it closes its output; a line that is not one of its two
/// forms is ignored (the forger is pdkv's own, and a wrong line only loses a count).
fn read_lines(stdout: impl Read, tx: &Sender<Ev>) {
    let mut reader = BufReader::new(stdout);
    loop {
        let mut line = Vec::new();
        match (&mut reader).take(MAX_LINE_BYTES).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&line);
        let words: Vec<&str> = text.split_whitespace().collect();
        let event = match words.as_slice() {
            ["from", address] => ForgerEvent::From(address.to_string()),
            ["sent", releases, leases] => match (releases.parse(), leases.parse()) {
                (Ok(releases), Ok(leases)) => ForgerEvent::Sent(Sent { releases, leases }),
                _ => continue,
            },
            _ => continue,
        };
        if tx.send(Ev::Forger(event)).is_err() {
            return;
        }
    }
    let _ = tx.send(Ev::Forger(ForgerEvent::Closed));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_sender(text: &str, expected: Result<(&str, u16, u16, u16), &str>) {
        let got = parse_sender(text).map(|(s, tp)| (s.engine_id, s.dp_rank, s.tp_rank, tp));
        match expected {
            Ok((engine, dp, tp, size)) => assert_eq!(got, Ok((engine.to_string(), dp, tp, size)), "{text}"),
            Err(needle) => {
                let error = got.expect_err(text).to_string();
                assert!(error.contains(needle), "{text}: {error}");
            }
        }
    }

    #[test]
    fn sender_keys_parse_or_say_what_is_wrong() {
        check_sender("127.0.0.1:40100,0,1,2", Ok(("127.0.0.1:40100", 0, 1, 2)));
        check_sender("a,b:1,3,0,8", Ok(("a,b:1", 3, 0, 8)));
        check_sender("127.0.0.1:40100,0,1", Err("expected <engine id>"));
        check_sender("e,x,1,2", Err("dp \"x\""));
        check_sender("e,0,70000,2", Err("tp \"70000\""));
    }

    #[test]
    fn the_forger_sends_every_kind_for_each_sender_and_each_id() {
        let plan = ForgerPlan {
            targets: vec![],
            senders: vec![
                (ReleaseSender { engine_id: "d:1".into(), dp_rank: 0, tp_rank: 0 }, 2),
                (ReleaseSender { engine_id: "d:1".into(), dp_rank: 0, tp_rank: 1 }, 2),
            ],
        };
        let id = TransferId::new("t-1");
        let mut wrong = 0;
        let messages = forged(&plan, &id, &mut wrong);
        let decoded: Vec<ControlMessage> = messages.iter().map(|(_, b)| wire::decode(b).unwrap()).collect();
        // Two releases per sender (no MAC, a wrong one), the legacy string, two leases.
        assert_eq!(messages.len(), 7);
        assert_eq!(messages.iter().filter(|(release, _)| *release).count(), 5);
        let macs: Vec<Option<Mac>> = decoded
            .iter()
            .filter_map(|m| match m {
                ControlMessage::Release(r) => Some(r.mac),
                ControlMessage::ReadLease(l) => {
                    assert_eq!(l.lease_ms, u32::MAX);
                    Some(l.mac)
                }
                ControlMessage::LegacyCompletion(t) => {
                    assert_eq!(t, &id);
                    None
                }
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(macs.iter().filter(|m| m.is_none()).count(), 3);
        let wrong_macs: std::collections::BTreeSet<_> = macs.iter().flatten().map(|m| m.0).collect();
        assert_eq!(wrong_macs.len(), 3, "each wrong MAC differs");
        // Nothing to send to: the forger reads its input, sends nothing, and says so.
        let mut out = Vec::new();
        let sent = run_forger(&plan, &b"t-1\nt-2\n"[..], &mut out).unwrap();
        assert_eq!(sent, Sent::default());
        assert_eq!(String::from_utf8(out).unwrap(), "sent 0 0\nsent 0 0\n");
    }
}
