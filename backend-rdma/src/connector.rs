//! One rank's connector process (`pdkv connector`): joins the cluster's scheduler, then drives a
//! prefill or decode node of the core over real sockets until told to shut down.
//!
//! Every connector is one thread that owns its node and a handful of I/O threads (listeners,
//! dialers, the data plane) that turn socket activity into [`Input`]s on one channel. The node
//! thread handles one input at a time, in arrival order, and carries out the node's actions;
//! timers come from the node's `poll_timeout`. The connector decides nothing about routing or
//! release counting: every address it dials and every quorum it keeps comes from a node action
//! or from the scheduler, which got it from a node (see ARCHITECTURE.md).
//!
//! If the scheduler's connection closes, the connector exits at once: a rank never outlives
//! its cluster, so a killed `pdkv cluster` leaves no process behind.

use std::fmt;
use std::io::BufReader;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use pdkv_core::ids::{Incarnation, RankId, Role};
use pdkv_core::ports::Endpoint;
use pdkv_core::time::Instant;
use pdkv_core::topology::Deployment;

use crate::sched::{read_frame, write_frame, FrameError, FromRank, Setup, ToRank, HEARTBEAT_INTERVAL};

/// How long a connector waits to reach its scheduler and hear its setup.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(20);

/// Why a connector stopped with an error.
#[derive(Debug)]
pub enum ConnectorError {
    /// The command line named a rank the deployment does not have.
    NoSuchRank {
        /// The rank asked for.
        rank: RankId,
        /// The deployment.
        deployment: String,
    },
    /// The scheduler could not be reached or spoke nonsense.
    Scheduler {
        /// What was being done.
        op: &'static str,
        /// The error.
        detail: String,
    },
    /// A listener or the data plane could not start.
    Setup(String),
    /// The scheduler did not admit this process (see [`crate::sched::ToRank::Refused`]).
    Refused(String),
}

impl fmt::Display for ConnectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectorError::NoSuchRank { rank, deployment } => {
                write!(f, "deployment {deployment} has no rank {rank}")
            }
            ConnectorError::Scheduler { op, detail } => write!(f, "scheduler: {op}: {detail}"),
            ConnectorError::Setup(detail) => write!(f, "cannot start: {detail}"),
            ConnectorError::Refused(reason) => write!(f, "the scheduler refused this connector: {reason}"),
        }
    }
}

impl std::error::Error for ConnectorError {}

/// The process clock, in the core's terms: nanoseconds since the connector started.
#[derive(Clone, Copy, Debug)]
pub struct Clock(std::time::Instant);

impl Clock {
    /// A clock starting now.
    pub fn start() -> Clock {
        Clock(std::time::Instant::now())
    }

    /// Now, for the core.
    pub fn now(&self) -> Instant {
        Instant(self.0.elapsed().as_nanos() as u64)
    }

    /// How long from now until `at` (zero if it passed).
    pub fn until(&self, at: Instant) -> Duration {
        Duration::from_nanos(at.0.saturating_sub(self.now().0))
    }
}

/// The write half of the scheduler connection, shared by the node thread and the heartbeat
/// thread (a lock keeps their frames whole).
pub struct SchedLink {
    stream: Arc<Mutex<TcpStream>>,
}

impl SchedLink {
    /// Sends one message; an error means the scheduler is gone, and the caller exits.
    pub fn send(&mut self, msg: &FromRank) -> Result<(), ConnectorError> {
        let mut stream = self.stream.lock().unwrap_or_else(PoisonError::into_inner);
        write_frame(&mut *stream, msg)
            .map_err(|e| ConnectorError::Scheduler { op: "send", detail: e.to_string() })
    }

    /// Sends a heartbeat every [`HEARTBEAT_INTERVAL`] from a thread of its own until the
    /// scheduler is gone (the process then exits anyway).
    fn start_heartbeat(&self) {
        let mut link = SchedLink { stream: self.stream.clone() };
        thread::spawn(move || loop {
            thread::sleep(HEARTBEAT_INTERVAL);
            if link.send(&FromRank::Heartbeat).is_err() {
                return;
            }
        });
    }
}

/// Resolves an endpoint the core computed (host and port) to a socket address.
pub fn resolve(endpoint: &Endpoint) -> Result<SocketAddr, String> {
    (endpoint.host.as_str(), endpoint.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {endpoint}: {e}"))?
        .next()
        .ok_or_else(|| format!("{endpoint} resolves to no address"))
}

/// Joins the scheduler at `scheduler` as `rank` of `deployment`, then runs the rank's node until
/// the scheduler says shut down (Ok) or goes away (Err).
pub fn run(deployment: &str, rank: RankId, scheduler: SocketAddr) -> Result<(), ConnectorError> {
    let parsed = Deployment::parse(deployment).map_err(|e| ConnectorError::Setup(e.to_string()))?;
    let exists = usize::from(rank.engine.index) < parsed.engines(rank.engine.role).len() && {
        let layout = parsed.layout(rank.engine);
        rank.dp < layout.dp && rank.tp < layout.tp
    };
    if !exists {
        return Err(ConnectorError::NoSuchRank { rank, deployment: deployment.to_owned() });
    }
    let sched_err = |op| move |e: std::io::Error| ConnectorError::Scheduler { op, detail: e.to_string() };
    let stream = TcpStream::connect_timeout(&scheduler, JOIN_TIMEOUT).map_err(sched_err("connect"))?;
    stream.set_nodelay(true).map_err(sched_err("configure"))?;
    let mut link =
        SchedLink { stream: Arc::new(Mutex::new(stream.try_clone().map_err(sched_err("configure"))?)) };
    let token = std::env::var(crate::sched::TOKEN_ENV).unwrap_or_default();
    link.send(&FromRank::Hello { rank, pid: std::process::id(), token })?;
    let mut reader = BufReader::new(stream);
    let setup = await_setup(&mut reader, scheduler, JOIN_TIMEOUT)?;
    link.start_heartbeat();
    let deployment = parsed.with_model(setup.model.clone());
    let (tx, rx) = mpsc::channel();
    let sched_tx = tx.clone();
    thread::spawn(move || loop {
        match read_frame::<ToRank>(&mut reader) {
            Ok(msg) => {
                if sched_tx.send(Input::Sched(msg)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = sched_tx.send(Input::SchedGone(e));
                return;
            }
        }
    });
    let incarnation = draw_incarnation();
    let ctx = Context { deployment, rank, setup, link, tx, rx, clock: Clock::start(), incarnation };
    match rank.engine.role {
        Role::Prefill => crate::prefill_rank::run(ctx),
        Role::Decode => crate::decode_rank::run(ctx),
    }
}

/// Waits up to `timeout` for the scheduler's answer to the hello: the setup, or why not, in
/// words (a scheduler that accepted the connection and then said nothing is named as such, not
/// as the socket's `EAGAIN`).
fn await_setup(
    reader: &mut BufReader<TcpStream>,
    scheduler: SocketAddr,
    timeout: Duration,
) -> Result<Setup, ConnectorError> {
    let configure = |e: std::io::Error| ConnectorError::Scheduler { op: "configure", detail: e.to_string() };
    reader.get_ref().set_read_timeout(Some(timeout)).map_err(configure)?;
    let join = |detail: String| ConnectorError::Scheduler { op: "join", detail };
    let setup = match read_frame::<ToRank>(reader) {
        Ok(ToRank::Setup(setup)) => setup,
        Ok(ToRank::Refused { reason }) => return Err(ConnectorError::Refused(reason)),
        Ok(other) => return Err(join(format!("expected setup, got {}", other.name()))),
        Err(FrameError::Io(e))
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
        {
            return Err(join(format!(
                "the scheduler at {scheduler} accepted the connection but sent nothing within {} s \
                 (is it a pdkv cluster, and is it running?)",
                timeout.as_secs_f64()
            )));
        }
        Err(FrameError::Closed) => {
            return Err(join(format!(
                "the scheduler at {scheduler} closed the connection without answering the hello"
            )));
        }
        Err(e) => return Err(join(e.to_string())),
    };
    reader.get_ref().set_read_timeout(None).map_err(configure)?;
    Ok(setup)
}

/// What a rank's driver starts with.
pub struct Context {
    /// The deployment, with the model the scheduler set.
    pub deployment: Deployment,
    /// This rank.
    pub rank: RankId,
    /// The scheduler's setup.
    pub setup: Setup,
    /// Messages to the scheduler.
    pub link: SchedLink,
    /// A sender for I/O threads.
    pub tx: Sender<Input>,
    /// The node thread's inputs.
    pub rx: Receiver<Input>,
    /// The process clock.
    pub clock: Clock,
    /// This process's incarnation, drawn at start: a prefill rank names it in its handshake
    /// metadata, and its engine in every answer of a transfer the rank holds.
    pub incarnation: Incarnation,
}

/// A fresh incarnation for this process: 64 bits from the operating system's random source,
/// folded into the protocol's range. Where `/dev/urandom` cannot be read, the bits come from the
/// standard library's per-process random hash keys mixed with the process id and the time, which
/// differ between any two starts of a rank.
pub fn draw_incarnation() -> Incarnation {
    use std::hash::{BuildHasher, Hasher};
    use std::io::Read;
    let mut bytes = [0u8; 8];
    let from_os = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).is_ok();
    let bits = if from_os {
        u64::from_le_bytes(bytes)
    } else {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        hasher.write_u128(now.as_nanos());
        hasher.finish()
    };
    Incarnation::from_bits(bits)
}

/// One thing that happened, for the node thread.
pub enum Input {
    /// A message from the scheduler.
    Sched(ToRank),
    /// The scheduler connection ended.
    SchedGone(FrameError),
    /// Prefill: a handshake request arrived on connection `conn`; the reply goes to `reply`.
    HandshakeRequest {
        /// The connection's number (the core's opaque peer handle).
        conn: u64,
        /// The dialler, when the identity it announced names a rank (pdkv's decode ranks
        /// announce theirs); message faults match it.
        peer: Option<RankId>,
        /// Where the reply messages go: each reply sent on the connection in order (two when a
        /// fault duplicated it).
        reply: Sender<Vec<HandshakeReply>>,
    },
    /// Prefill: one frame arrived on the notify listener.
    Notify {
        /// The frame.
        frame: Vec<u8>,
        /// The address of the connection it came on, if the socket knew it (named when the
        /// message is refused).
        from: Option<String>,
    },
    /// Decode: a handshake dial ended.
    Dialled {
        /// The session the dial was for.
        session: pdkv_core::ports::SessionKey,
        /// The rank dialled.
        peer: RankId,
        /// Both reply payloads decoded, or why not.
        result: crate::decode_rank::Dialled,
    },
    /// Decode: a read finished.
    ReadDone(crate::decode_rank::ReadResult),
    /// Something an I/O thread wants reported.
    Problem(String),
}

/// A control message's name, for reports (its fields can be long and are not for people).
pub fn message_name(message: &pdkv_core::wire::ControlMessage) -> &'static str {
    use pdkv_core::wire::ControlMessage;
    match message {
        ControlMessage::Release(_) => "release",
        ControlMessage::LegacyCompletion(_) => "legacy completion",
        ControlMessage::RemoteBlocks(_) => "remote blocks",
        ControlMessage::WriteDone(_) => "write done",
        ControlMessage::ReadLease(_) => "read lease",
        ControlMessage::HandshakeRequest => "handshake request",
        ControlMessage::HandshakeMetadata(_) => "handshake metadata",
    }
}

/// The two messages of a handshake reply, each a list of frames
/// ([`pdkv_core::wire::handshake_reply`]).
pub type HandshakeReply = [Vec<Vec<u8>>; 2];

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A scheduler that accepts and then does `behave` with the connection, and what a
    /// connector waiting for its setup reports.
    fn join_error(behave: fn(TcpStream)) -> (SocketAddr, String) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || behave(listener.accept().unwrap().0));
        let mut reader = BufReader::new(TcpStream::connect(addr).unwrap());
        let error = await_setup(&mut reader, addr, Duration::from_millis(300)).unwrap_err().to_string();
        drop(reader);
        server.join().unwrap();
        (addr, error)
    }

    #[test]
    fn a_scheduler_that_accepts_and_stays_silent_is_named_in_words() {
        let check = |behave: fn(TcpStream), expected: &str| {
            let (addr, error) = join_error(behave);
            assert_eq!(error, expected.replace("ADDR", &addr.to_string()));
        };
        // Silent until the connector gives up (the connection is held until it closes).
        check(
            |stream| {
                let _ = std::io::Read::read(&mut &stream, &mut [0u8; 1]);
            },
            "scheduler: join: the scheduler at ADDR accepted the connection but sent nothing within 0.3 s \
             (is it a pdkv cluster, and is it running?)",
        );
        check(
            drop,
            "scheduler: join: the scheduler at ADDR closed the connection without answering the hello",
        );
        check(
            |mut stream| {
                write_frame(&mut stream, &ToRank::Shutdown).unwrap();
            },
            "scheduler: join: expected setup, got shutdown",
        );
    }
}
