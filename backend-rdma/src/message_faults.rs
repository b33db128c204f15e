//! Message faults of a real cluster (`pdkv cluster --lose-messages`, `--duplicate-messages`,
//! `--delay-messages`): the flags' syntax and limits, and the injector each sending process
//! runs on the control messages its node asked it to send.
//!
//! The vocabulary is the simulator's (`LoseMessages`, `DuplicateMessages`,
//! `DelayMessages(delay_ms)` on a rank pattern such as `P0.dp*.tp1`, with an optional `count`):
//! a message is affected when the pattern matches its sender or its receiver. The fault layer
//! only loses, duplicates or delays bytes a node asked to send; it never changes what the node
//! decides. Each sending process decides for its own messages, so a `count` is per sending rank
//! (the scheduler counts the dispatches), and a probability is drawn from the run's `--seed`,
//! a stream per rank and life (start of its process), so which messages are hit repeats for the same order of
//! messages.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use pdkv_core::ids::{RankId, TransferId};
use pdkv_core::rng::Stream;
use pdkv_core::topology::Deployment;
use pdkv_engine::target::{parse_target, TargetPattern};
use serde::{Deserialize, Serialize};

/// Most message-fault flags one run takes (each is checked against every message sent).
pub const MAX_MESSAGE_FAULTS: usize = 32;
/// Largest `=COUNT` of a message fault.
pub const MAX_MESSAGE_COUNT: u32 = 1_000_000;
/// Longest delay of `--delay-messages` (a day, as the cluster's timeouts): a longer one is a
/// loss, and would overflow the clocks' arithmetic.
pub const MAX_MESSAGE_DELAY_MS: u64 = 86_400_000;
/// Probabilities are kept in millionths, so they compare and travel exactly.
pub const PROBABILITY_SCALE: u32 = 1_000_000;

/// The control messages a fault can hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MessageKind {
    /// A decode rank's handshake dial (`get_meta_msg`) to a prefill rank's handshake listener.
    HandshakeRequest,
    /// A prefill rank's answer to it (metadata and layer descriptors).
    HandshakeReply,
    /// A decode rank's release to a prefill rank's notify listener.
    Release,
    /// A decode rank's read lease to a prefill rank's notify listener.
    Lease,
    /// The scheduler's dispatch of a prefilled request to a decode DP group (the proxy's
    /// decode request); it names the prefill DP group that holds the KV and goes to every
    /// rank of the decode group.
    Dispatch,
}

impl MessageKind {
    /// Every kind, in the order the flags list them.
    pub const ALL: [MessageKind; 5] = [
        MessageKind::HandshakeRequest,
        MessageKind::HandshakeReply,
        MessageKind::Release,
        MessageKind::Lease,
        MessageKind::Dispatch,
    ];

    /// The kinds a fault without `:KINDS` hits: every message between two ranks, as the
    /// simulator's message faults; a dispatch only when named.
    pub const BETWEEN_RANKS: [MessageKind; 4] = [
        MessageKind::HandshakeRequest,
        MessageKind::HandshakeReply,
        MessageKind::Release,
        MessageKind::Lease,
    ];

    /// The name the flags use.
    pub fn name(self) -> &'static str {
        match self {
            MessageKind::HandshakeRequest => "handshake-request",
            MessageKind::HandshakeReply => "handshake-reply",
            MessageKind::Release => "release",
            MessageKind::Lease => "lease",
            MessageKind::Dispatch => "dispatch",
        }
    }

    /// The name in a report line.
    pub fn words(self) -> &'static str {
        match self {
            MessageKind::HandshakeRequest => "handshake request",
            MessageKind::HandshakeReply => "handshake reply",
            MessageKind::Release => "release",
            MessageKind::Lease => "read lease",
            MessageKind::Dispatch => "dispatch",
        }
    }

    /// [`MessageKind::words`] for `n` of them.
    pub fn counted(self, n: u64) -> String {
        if n == 1 {
            return format!("1 {}", self.words());
        }
        let plural = match self {
            MessageKind::HandshakeRequest => "handshake requests",
            MessageKind::HandshakeReply => "handshake replies",
            MessageKind::Release => "releases",
            MessageKind::Lease => "read leases",
            MessageKind::Dispatch => "dispatches",
        };
        format!("{n} {plural}")
    }
}

/// What a fault does to the messages it hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MessageAction {
    /// The message is never sent.
    Lose,
    /// The message is sent twice.
    Duplicate,
    /// The message is sent this much later.
    Delay {
        /// Extra delay.
        delay_ms: u64,
    },
}

/// Which flag a fault comes from (the delay is part of the flag's value).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// `--lose-messages`.
    Lose,
    /// `--duplicate-messages`.
    Duplicate,
    /// `--delay-messages`.
    Delay,
}

impl Verb {
    /// The command-line flag.
    pub fn flag(self) -> &'static str {
        match self {
            Verb::Lose => "--lose-messages",
            Verb::Duplicate => "--duplicate-messages",
            Verb::Delay => "--delay-messages",
        }
    }
}

/// One message fault, as a flag gives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageFault {
    /// Lose, duplicate or delay.
    pub action: MessageAction,
    /// The rank pattern, as written (`P0.dp*.tp1`): a message sent by or to a matching rank is
    /// hit.
    pub target: String,
    /// The kinds named, or `None` for [`MessageKind::BETWEEN_RANKS`].
    pub kinds: Option<Vec<MessageKind>>,
    /// At most this many messages of each sending rank are hit; `None` for all.
    pub count: Option<u32>,
    /// Each message the fault could hit is hit with this probability, in millionths; `None`
    /// for every one.
    pub probability_ppm: Option<u32>,
}

/// Why a message-fault flag was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MessageFaultError {
    /// The value does not have the flag's shape.
    Shape {
        /// The shape expected.
        expected: &'static str,
    },
    /// The rank pattern does not parse.
    Pattern {
        /// The pattern as written.
        pattern: String,
    },
    /// A kind that is not one of [`MessageKind::ALL`] (or `handshake`).
    Kind {
        /// The kind as written.
        kind: String,
    },
    /// `--duplicate-messages` names dispatches.
    DuplicateDispatch,
    /// The count is not a number in range.
    Count {
        /// The count as written.
        count: String,
    },
    /// The delay is not a number in range.
    Delay {
        /// The delay as written.
        delay: String,
    },
    /// The probability is not a number in (0, 1].
    Probability {
        /// The probability as written.
        probability: String,
    },
    /// The pattern matches no rank of the deployment.
    NoRank {
        /// The deployment's notation.
        deployment: String,
    },
}

const PATTERN_SYNTAX: &str = "P<engine>.dp<rank>.tp<rank> or D<engine>.dp<rank>.tp<rank>, each number \
                              or `*`, e.g. P0.dp*.tp1";

impl fmt::Display for MessageFaultError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MessageFaultError::Shape { expected } => write!(f, "expected {expected}"),
            MessageFaultError::Pattern { pattern } => {
                write!(f, "`{}` is not a rank pattern; expected {PATTERN_SYNTAX}", pattern.escape_debug())
            }
            MessageFaultError::Kind { kind } => {
                let names: Vec<&str> = MessageKind::ALL.iter().map(|k| k.name()).collect();
                write!(
                    f,
                    "`{}` is not a message kind; expected handshake (both halves) or one of {}, \
                     separated by commas",
                    kind.escape_debug(),
                    names.join(", ")
                )
            }
            MessageFaultError::DuplicateDispatch => f.write_str(
                "a dispatch cannot be duplicated: the proxy hands each request to decode once, and a \
                 decode group takes each request id once",
            ),
            MessageFaultError::Count { count } => {
                write!(f, "count `{}` must be a number from 1 to {MAX_MESSAGE_COUNT}", count.escape_debug())
            }
            MessageFaultError::Delay { delay } => write!(
                f,
                "delay `{}` must be a number of milliseconds from 1 to {MAX_MESSAGE_DELAY_MS}",
                delay.escape_debug()
            ),
            MessageFaultError::Probability { probability } => write!(
                f,
                "probability `{}` must be a number above 0 (at least 0.000001) and at most 1",
                probability.escape_debug()
            ),
            MessageFaultError::NoRank { deployment } => {
                write!(f, "the pattern matches no rank of {deployment}")
            }
        }
    }
}

impl std::error::Error for MessageFaultError {}

impl MessageFault {
    /// Parses the value of a message-fault flag:
    /// `PATTERN[:KINDS][=COUNT][@PROBABILITY]`, and for [`Verb::Delay`]
    /// `PATTERN[:KINDS]:DELAY_MS[=COUNT][@PROBABILITY]`. `KINDS` is a comma-separated list of
    /// [`MessageKind::name`]s (`handshake` for both halves of a handshake).
    pub fn parse(verb: Verb, text: &str) -> Result<MessageFault, MessageFaultError> {
        let expected = match verb {
            Verb::Lose | Verb::Duplicate => {
                "PATTERN[:KINDS][=COUNT][@PROBABILITY], e.g. D0.dp0.tp1:release=2"
            }
            Verb::Delay => "PATTERN[:KINDS]:DELAY_MS[=COUNT][@PROBABILITY], e.g. P0.dp*.tp*:dispatch:500",
        };
        let shape = || MessageFaultError::Shape { expected };
        let (rest, probability) = match text.split_once('@') {
            Some((rest, p)) => (rest, Some(p)),
            None => (text, None),
        };
        let (rest, count) = match rest.split_once('=') {
            Some((rest, n)) => (rest, Some(n)),
            None => (rest, None),
        };
        let mut parts: Vec<&str> = rest.split(':').collect();
        let action = match verb {
            Verb::Lose => MessageAction::Lose,
            Verb::Duplicate => MessageAction::Duplicate,
            Verb::Delay => {
                if parts.len() < 2 {
                    return Err(shape());
                }
                let delay = parts.pop().expect("two parts at least");
                let bad = || MessageFaultError::Delay { delay: delay.to_string() };
                let delay_ms = plain_number(delay).ok_or_else(bad)?;
                if !(1..=MAX_MESSAGE_DELAY_MS).contains(&delay_ms) {
                    return Err(bad());
                }
                MessageAction::Delay { delay_ms }
            }
        };
        let (target, kinds) = match parts.as_slice() {
            [target] => (*target, None),
            [target, kinds] => (*target, Some(parse_kinds(kinds)?)),
            _ => return Err(shape()),
        };
        if parse_target(target).is_none() {
            return Err(MessageFaultError::Pattern { pattern: target.to_string() });
        }
        if verb == Verb::Duplicate && kinds.as_ref().is_some_and(|k| k.contains(&MessageKind::Dispatch)) {
            return Err(MessageFaultError::DuplicateDispatch);
        }
        let count = count
            .map(|n| {
                let bad = || MessageFaultError::Count { count: n.to_string() };
                let value = plain_number(n).ok_or_else(bad)?;
                u32::try_from(value).ok().filter(|v| (1..=MAX_MESSAGE_COUNT).contains(v)).ok_or_else(bad)
            })
            .transpose()?;
        let probability_ppm = probability.map(parse_probability).transpose()?;
        Ok(MessageFault { action, target: target.to_string(), kinds, count, probability_ppm })
    }

    /// The kinds the fault hits.
    pub fn kinds(&self) -> &[MessageKind] {
        self.kinds.as_deref().unwrap_or(&MessageKind::BETWEEN_RANKS)
    }

    /// The flag it came from.
    pub fn verb(&self) -> Verb {
        match self.action {
            MessageAction::Lose => Verb::Lose,
            MessageAction::Duplicate => Verb::Duplicate,
            MessageAction::Delay { .. } => Verb::Delay,
        }
    }

    /// The parsed pattern (it parsed when the fault was made).
    fn pattern(&self) -> TargetPattern {
        parse_target(&self.target).expect("a message fault's pattern was checked when it was parsed")
    }

    /// Checks that the pattern names a rank of `d`.
    pub fn check(&self, d: &Deployment) -> Result<(), MessageFaultError> {
        let pattern = self.pattern();
        let any = [pdkv_core::ids::Role::Prefill, pdkv_core::ids::Role::Decode]
            .into_iter()
            .flat_map(|role| d.ranks(role))
            .any(|rank| pattern.matches(rank));
        if any {
            Ok(())
        } else {
            Err(MessageFaultError::NoRank { deployment: d.notation() })
        }
    }

    /// What the fault does, in a sentence for the fault log.
    pub fn describe(&self) -> String {
        let kinds: Vec<&str> = self.kinds().iter().map(|k| k.words()).collect();
        let kinds = match kinds.split_last() {
            Some((last, [])) => last.to_string(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        };
        let (what, how) = match self.action {
            MessageAction::Lose => ("lose", String::new()),
            MessageAction::Duplicate => ("send twice", String::new()),
            MessageAction::Delay { delay_ms } => ("send", format!(" {delay_ms} ms late")),
        };
        let mut s = format!("{self}: {what} each {kinds} sent by or to a rank {} names{how}", self.target);
        if let Some(ppm) = self.probability_ppm {
            s.push_str(&format!(" with probability {}", probability_text(ppm)));
        }
        if let Some(n) = self.count {
            s.push_str(&format!(", at most {n} per sending rank"));
        }
        s
    }
}

impl fmt::Display for MessageFault {
    /// The flag and its value, as the command line takes it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.verb().flag(), self.target)?;
        if let Some(kinds) = &self.kinds {
            let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
            write!(f, ":{}", names.join(","))?;
        }
        if let MessageAction::Delay { delay_ms } = self.action {
            write!(f, ":{delay_ms}")?;
        }
        if let Some(n) = self.count {
            write!(f, "={n}")?;
        }
        if let Some(ppm) = self.probability_ppm {
            write!(f, "@{}", probability_text(ppm))?;
        }
        Ok(())
    }
}

/// Decimal digits only (no sign, no spaces), as a u64.
fn plain_number(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn parse_kinds(text: &str) -> Result<Vec<MessageKind>, MessageFaultError> {
    let mut kinds = Vec::new();
    for name in text.split(',') {
        match name {
            "handshake" => kinds.extend([MessageKind::HandshakeRequest, MessageKind::HandshakeReply]),
            _ => match MessageKind::ALL.iter().find(|k| k.name() == name) {
                Some(&kind) => kinds.push(kind),
                None => return Err(MessageFaultError::Kind { kind: name.to_string() }),
            },
        }
    }
    kinds.sort();
    kinds.dedup();
    Ok(kinds)
}

/// A probability written `0.25` or `1`, at most six decimals, above 0 and at most 1, in
/// millionths.
fn parse_probability(text: &str) -> Result<u32, MessageFaultError> {
    let bad = || MessageFaultError::Probability { probability: text.to_string() };
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(fraction) || fraction.len() > 6 || text.ends_with('.') {
        return Err(bad());
    }
    let whole: u64 = whole.parse().map_err(|_| bad())?;
    let fraction: u64 = format!("{fraction:0<6}").parse().map_err(|_| bad())?;
    let ppm = whole.saturating_mul(u64::from(PROBABILITY_SCALE)).saturating_add(fraction);
    u32::try_from(ppm).ok().filter(|p| (1..=PROBABILITY_SCALE).contains(p)).ok_or_else(bad)
}

/// Millionths as the shortest decimal that reads back to them.
fn probability_text(ppm: u32) -> String {
    if ppm >= PROBABILITY_SCALE {
        return "1".into();
    }
    let digits = format!("{ppm:06}");
    format!("0.{}", digits.trim_end_matches('0'))
}

/// What the faults did to one message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fate {
    /// Not sent at all.
    pub lost: bool,
    /// Copies sent (2 when duplicated).
    pub copies: u8,
    /// Sent this much later (the sum of the delays that hit it).
    pub delay_ms: u64,
    /// The faults that hit it, by their place among the run's message faults.
    pub faults: Vec<u16>,
}

impl Fate {
    /// How to send the message: `None` when lost, else the copies and the delay.
    pub fn sending(&self) -> Option<(usize, Duration)> {
        (!self.lost).then(|| (usize::from(self.copies), Duration::from_millis(self.delay_ms)))
    }

    /// What happened, in words: `lost`, `duplicated`, `delayed 250 ms`, or both of the last.
    pub fn words(&self) -> String {
        if self.lost {
            return "lost".into();
        }
        match (self.copies > 1, self.delay_ms) {
            (true, 0) => "duplicated".into(),
            (false, ms) => format!("delayed {ms} ms"),
            (true, ms) => format!("duplicated and delayed {ms} ms"),
        }
    }

    /// Whether the message arrived once, on time, only with a copy more (which excuses
    /// nothing: a duplicate must be counted once).
    pub fn only_duplicated(&self) -> bool {
        !self.lost && self.delay_ms == 0
    }
}

/// A message a rank's fault layer changed, for the scheduler's fault log and excuses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageHit {
    /// Which message.
    pub kind: MessageKind,
    /// Its sender.
    pub from: RankId,
    /// Its receiver, when the sender knows it (a dialler that named itself).
    pub to: Option<RankId>,
    /// The transfer it is about (releases and leases).
    pub transfer_id: Option<TransferId>,
    /// What happened to it.
    pub fate: Fate,
}

/// The message faults one sending process applies, with what its earlier lives used of
/// each count.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SenderFaults {
    /// The run's `--seed`.
    pub seed: u64,
    /// This sender's stream of that seed.
    pub stream: u64,
    /// Each fault with its place among the run's message faults; `count` is what is left of it
    /// for this sender.
    pub faults: Vec<(u16, MessageFault)>,
}

struct Active {
    index: u16,
    pattern: TargetPattern,
    kinds: Vec<MessageKind>,
    action: MessageAction,
    remaining: Option<u32>,
    probability_ppm: Option<u32>,
}

/// Decides the fate of each message one process sends.
pub struct Injector {
    faults: Vec<Active>,
    stream: Stream,
}

impl Injector {
    /// The injector of a sender.
    pub fn new(setup: &SenderFaults) -> Injector {
        let faults = setup
            .faults
            .iter()
            .map(|(index, f)| Active {
                index: *index,
                pattern: f.pattern(),
                kinds: f.kinds().to_vec(),
                action: f.action,
                remaining: f.count,
                probability_ppm: f.probability_ppm,
            })
            .collect();
        Injector { faults, stream: Stream::new(setup.seed, setup.stream) }
    }

    /// What the faults do to one message of `kind` between `ranks` (its sender and, when
    /// known, its receivers): `None` when none hit it, so it is sent once, now. As in the
    /// simulator, faults are tried in flag order: a loss ends the search, delays add up, a
    /// duplicate makes two copies. A fault with a probability draws once per message it could
    /// hit; one whose count is used up hits nothing more.
    pub fn fate(&mut self, kind: MessageKind, ranks: &[RankId]) -> Option<Fate> {
        let mut fate = Fate { lost: false, copies: 1, delay_ms: 0, faults: Vec::new() };
        let Injector { faults, stream } = self;
        for f in faults.iter_mut() {
            if f.remaining == Some(0)
                || !f.kinds.contains(&kind)
                || !ranks.iter().any(|r| f.pattern.matches(*r))
            {
                continue;
            }
            if let Some(ppm) = f.probability_ppm {
                if stream.below(u64::from(PROBABILITY_SCALE)) >= u64::from(ppm) {
                    continue;
                }
            }
            if let Some(n) = &mut f.remaining {
                *n -= 1;
            }
            fate.faults.push(f.index);
            match f.action {
                MessageAction::Lose => {
                    fate.lost = true;
                    break;
                }
                MessageAction::Duplicate => fate.copies = 2,
                MessageAction::Delay { delay_ms } => fate.delay_ms = fate.delay_ms.saturating_add(delay_ms),
            }
        }
        (!fate.faults.is_empty()).then_some(fate)
    }
}

/// Messages held back by a delay, each due at its time: a sending loop waits on its inputs no
/// longer than [`Later::wait`] and sends what [`Later::pop_due`] gives, so a delay never blocks
/// it.
pub struct Later<T> {
    queue: BTreeMap<(Instant, u64), T>,
    next: u64,
}

impl<T> Default for Later<T> {
    fn default() -> Self {
        Later { queue: BTreeMap::new(), next: 0 }
    }
}

impl<T> Later<T> {
    /// Holds `item` until `delay` from now (items due at the same moment keep their order).
    pub fn push(&mut self, delay: Duration, item: T) {
        let now = Instant::now();
        let at = now.checked_add(delay).unwrap_or(now + Duration::from_millis(MAX_MESSAGE_DELAY_MS));
        self.queue.insert((at, self.next), item);
        self.next += 1;
    }

    /// How long until the first item is due; `None` when nothing is held.
    pub fn wait(&self) -> Option<Duration> {
        let (&(at, _), _) = self.queue.first_key_value()?;
        Some(at.saturating_duration_since(Instant::now()))
    }

    /// The first item that is due, if any.
    pub fn pop_due(&mut self) -> Option<T> {
        let (&(at, _), _) = self.queue.first_key_value()?;
        if at > Instant::now() {
            return None;
        }
        self.queue.pop_first().map(|(_, item)| item)
    }

    /// Items held.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// The shorter of two optional waits.
pub fn sooner(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::EngineId;

    #[test]
    fn flags_parse_and_print_back_or_say_what_is_wrong() {
        let check = |verb, text: &str, expected: Result<&str, MessageFaultError>| {
            let got = MessageFault::parse(verb, text);
            match expected {
                Ok(printed) => {
                    let fault = got.unwrap_or_else(|e| panic!("{text}: {e}"));
                    assert_eq!(fault.to_string(), printed, "{text}");
                    // What it prints parses back to the same fault.
                    let (_, value) = printed.split_once(' ').expect("flag and value");
                    assert_eq!(MessageFault::parse(verb, value), Ok(fault), "{printed}");
                }
                Err(e) => assert_eq!(got, Err(e), "{text}"),
            }
        };
        use MessageFaultError as E;
        check(Verb::Lose, "D0.dp0.tp1:release=2", Ok("--lose-messages D0.dp0.tp1:release=2"));
        check(Verb::Lose, "P*.dp*.tp*", Ok("--lose-messages P*.dp*.tp*"));
        check(
            Verb::Lose,
            "P0.dp*.tp1:lease,handshake@0.25",
            Ok("--lose-messages P0.dp*.tp1:handshake-request,handshake-reply,lease@0.25"),
        );
        check(
            Verb::Duplicate,
            "D0.dp*.tp*:release,handshake-reply",
            Ok("--duplicate-messages D0.dp*.tp*:handshake-reply,release"),
        );
        check(
            Verb::Delay,
            "P0.dp*.tp*:dispatch:500=10@1",
            Ok("--delay-messages P0.dp*.tp*:dispatch:500=10@1"),
        );
        check(Verb::Delay, "D0.dp0.tp0:250", Ok("--delay-messages D0.dp0.tp0:250"));
        check(Verb::Lose, "P0.dp0.tp0@0.000001", Ok("--lose-messages P0.dp0.tp0@0.000001"));
        let lose = "PATTERN[:KINDS][=COUNT][@PROBABILITY], e.g. D0.dp0.tp1:release=2";
        let delay = "PATTERN[:KINDS]:DELAY_MS[=COUNT][@PROBABILITY], e.g. P0.dp*.tp*:dispatch:500";
        check(Verb::Lose, "P0.dp0.tp0:release:5", Err(E::Shape { expected: lose }));
        check(Verb::Delay, "P0.dp0.tp0", Err(E::Shape { expected: delay }));
        check(Verb::Delay, "P0.dp0.tp0:release:dispatch:5", Err(E::Shape { expected: delay }));
        check(Verb::Lose, "P0.tp0", Err(E::Pattern { pattern: "P0.tp0".into() }));
        check(Verb::Lose, "X0.dp0.tp0", Err(E::Pattern { pattern: "X0.dp0.tp0".into() }));
        check(Verb::Lose, "P0.dp0.tp0:relese", Err(E::Kind { kind: "relese".into() }));
        check(Verb::Lose, "P0.dp0.tp0:", Err(E::Kind { kind: "".into() }));
        check(Verb::Duplicate, "P0.dp0.tp0:dispatch", Err(E::DuplicateDispatch));
        for count in ["0", "x", "-1", "1000001", "99999999999999999999", ""] {
            check(Verb::Lose, &format!("P0.dp0.tp0={count}"), Err(E::Count { count: count.into() }));
        }
        for ms in ["0", "86400001", "18446744073709551615", "18446744073709551616", "1e3", "+5"] {
            check(Verb::Delay, &format!("P0.dp0.tp0:{ms}"), Err(E::Delay { delay: ms.into() }));
        }
        for p in ["0", "0.0", "1.5", "2", "nan", "inf", "-0.5", ".5", "0.", "0.0000001", "0.25e1"] {
            check(Verb::Lose, &format!("P0.dp0.tp0@{p}"), Err(E::Probability { probability: p.into() }));
        }
        // The errors say what is wrong in words.
        assert_eq!(
            E::Delay { delay: "18446744073709551615".into() }.to_string(),
            "delay `18446744073709551615` must be a number of milliseconds from 1 to 86400000"
        );
    }

    #[test]
    fn a_pattern_must_name_a_rank_of_the_deployment() {
        let d = Deployment::parse("1P_DP2TP2:1D_TP4").unwrap();
        let check = |text: &str, ok: bool| {
            let fault = MessageFault::parse(Verb::Lose, text).unwrap();
            let expected =
                if ok { Ok(()) } else { Err(MessageFaultError::NoRank { deployment: d.notation() }) };
            assert_eq!(fault.check(&d), expected, "{text}");
        };
        check("P0.dp1.tp1", true);
        check("D0.dp0.tp3", true);
        check("P*.dp*.tp*", true);
        check("P1.dp0.tp0", false);
        check("P0.dp2.tp0", false);
        check("D0.dp*.tp4", false);
    }

    fn injector(faults: &[&str], seed: u64) -> Injector {
        let faults = faults
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let (flag, value) = text.split_once(' ').unwrap();
                let verb = [Verb::Lose, Verb::Duplicate, Verb::Delay]
                    .into_iter()
                    .find(|v| v.flag() == flag)
                    .unwrap();
                (i as u16, MessageFault::parse(verb, value).unwrap())
            })
            .collect();
        Injector::new(&SenderFaults { seed, stream: 7, faults })
    }

    #[test]
    fn fates_follow_pattern_kind_count_and_order() {
        let d1 = RankId::new(EngineId::decode(0), 0, 1);
        let d0 = RankId::new(EngineId::decode(0), 0, 0);
        let p0 = RankId::new(EngineId::prefill(0), 0, 0);
        let mut i = injector(
            &[
                "--delay-messages D0.dp0.tp1:release:200",
                "--duplicate-messages P0.dp0.tp0:release,lease=1",
                "--delay-messages P*.dp*.tp*:50",
                "--lose-messages D0.dp0.tp1:release=2",
            ],
            1,
        );
        let fate = |lost, copies, delay_ms, faults: &[u16]| {
            Some(Fate { lost, copies, delay_ms, faults: faults.to_vec() })
        };
        // A release of D0.dp0.tp1 to P0.dp0.tp0: both delays add, the duplicate makes two
        // copies, then the loss ends it (twice; its count is 2).
        assert_eq!(i.fate(MessageKind::Release, &[d1, p0]), fate(true, 2, 250, &[0, 1, 2, 3]));
        assert_eq!(i.fate(MessageKind::Release, &[d1, p0]), fate(true, 1, 250, &[0, 2, 3]));
        assert_eq!(i.fate(MessageKind::Release, &[d1, p0]), fate(false, 1, 250, &[0, 2]));
        // Another decode rank's lease: only the delay on every prefill rank; a dispatch is hit
        // only when named.
        assert_eq!(i.fate(MessageKind::Lease, &[d0, p0]), fate(false, 1, 50, &[2]));
        assert_eq!(i.fate(MessageKind::Dispatch, &[d0, p0]), None);
        assert_eq!(i.fate(MessageKind::HandshakeRequest, &[d0]), None);
    }

    #[test]
    fn probabilities_repeat_for_a_seed_and_hit_about_their_share() {
        let draws = |seed| {
            let mut i = injector(&["--lose-messages P*.dp*.tp*:release@0.25"], seed);
            let p0 = RankId::new(EngineId::prefill(0), 0, 0);
            (0..4000).map(|_| i.fate(MessageKind::Release, &[p0]).is_some()).collect::<Vec<bool>>()
        };
        let a = draws(3);
        assert_eq!(a, draws(3));
        assert_ne!(a, draws(4));
        let hits = a.iter().filter(|&&h| h).count();
        assert!((900..1100).contains(&hits), "{hits} of 4000 at 0.25");
    }

    #[test]
    fn held_messages_come_out_when_due_in_order() {
        let mut later = Later::default();
        assert_eq!(later.wait(), None);
        later.push(Duration::from_secs(3600), "late");
        later.push(Duration::ZERO, "first");
        later.push(Duration::ZERO, "second");
        // The longest delay does not overflow the clock.
        later.push(Duration::from_millis(MAX_MESSAGE_DELAY_MS), "a day");
        assert_eq!(later.wait(), Some(Duration::ZERO));
        assert_eq!(
            (later.pop_due(), later.pop_due(), later.pop_due()),
            (Some("first"), Some("second"), None)
        );
        assert!(later.wait().is_some_and(|w| w > Duration::from_secs(3500)));
        assert_eq!(later.len(), 2);
    }
}
