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

use std::io::BufReader;
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use pdkv_core::ids::{Incarnation, RankId, Role};
use pdkv_core::topology::Deployment;

pub use crate::rank_io::ConnectorError;
use crate::rank_io::{Clock, Context, Input, LinkError, SchedLink, SetupError};
use crate::sched::{read_frame, FrameError, FromRank, Setup, ToRank};

/// How long a connector waits to reach its scheduler and hear its setup.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(20);

/// Joins the scheduler at `scheduler` as `rank` of `deployment`, then runs the rank's node until
/// the scheduler says shut down (Ok) or goes away (Err).
pub fn run(deployment: &str, rank: RankId, scheduler: SocketAddr) -> Result<(), ConnectorError> {
    let parsed =
        Deployment::parse(deployment).map_err(|e| ConnectorError::Setup(SetupError::Deployment(e)))?;
    let exists = usize::from(rank.engine.index) < parsed.engines(rank.engine.role).len() && {
        let layout = parsed.layout(rank.engine);
        rank.dp < layout.dp && rank.tp < layout.tp
    };
    if !exists {
        return Err(ConnectorError::NoSuchRank { rank, deployment: deployment.to_owned() });
    }
    let sched_err = |op| move |e| ConnectorError::Scheduler { op, error: LinkError::Io(e) };
    let stream = TcpStream::connect_timeout(&scheduler, JOIN_TIMEOUT).map_err(sched_err("connect"))?;
    stream.set_nodelay(true).map_err(sched_err("configure"))?;
    let mut link = SchedLink::new(stream.try_clone().map_err(sched_err("configure"))?);
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
    let ctx =
        Context { deployment, rank, setup, link, tx, rx, clock: Clock::start(), incarnation, staged: None };
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
    let configure = |e| ConnectorError::Scheduler { op: "configure", error: LinkError::Io(e) };
    reader.get_ref().set_read_timeout(Some(timeout)).map_err(configure)?;
    let join = |error| ConnectorError::Scheduler { op: "join", error };
    let setup = match read_frame::<ToRank>(reader) {
        Ok(ToRank::Setup(setup)) => *setup,
        Ok(ToRank::Refused { reason }) => return Err(ConnectorError::Refused(reason)),
        Ok(other) => return Err(join(LinkError::NotSetup { got: other.name() })),
        Err(FrameError::Io(e))
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
        {
            return Err(join(LinkError::Silent { scheduler, timeout }));
        }
        Err(FrameError::Closed) => return Err(join(LinkError::Closed { scheduler })),
        Err(e) => return Err(join(LinkError::Frame(e))),
    };
    reader.get_ref().set_read_timeout(None).map_err(configure)?;
    Ok(setup)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::write_frame;
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
