//! Measures the TCP data plane against a plain TCP socket copy of the same bytes on the same
//! machine, in one run: an 8K-token DeepSeek-R1 MLA transfer (61 layers × 8192 tokens × 576
//! bytes, about 288 MB) read by the decode side as one read per layer.
//!
//! Run with `cargo run --release -p pdkv-rdma --example tcp_bench`.

#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use pdkv_rdma::memory::Regions;
use pdkv_rdma::tcp::{TcpReadServer, TcpTransport};
use pdkv_rdma::transport::{Endpoint, Transport};

const LAYERS: u64 = 61;
const TOKENS: u64 = 8192;
const BYTES_PER_TOKEN: u64 = 576;
const LAYER_BYTES: u64 = TOKENS * BYTES_PER_TOKEN;
const TOTAL: u64 = LAYERS * LAYER_BYTES;
const ROUNDS: usize = 5;
const BASE: u64 = 0x7f00_0000_0000;

fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

fn mb_per_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / 1e6 / d.as_secs_f64()
}

type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

/// The decode side of the data plane, against a server holding the whole cache in one region.
struct DataPlane {
    server: TcpReadServer,
    transport: TcpTransport,
    peer: Endpoint,
}

impl DataPlane {
    fn start() -> Fallible<DataPlane> {
        let mut regions = Regions::new();
        regions.register(BASE, TOTAL)?;
        for (i, b) in regions.slice_mut(BASE, TOTAL)?.iter_mut().enumerate() {
            *b = pattern(i as u64);
        }
        let regions = Arc::new(RwLock::new(regions));
        let server = TcpReadServer::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), regions)?;
        let peer = Endpoint { host: "127.0.0.1".into(), port: server.local_addr().port() };
        Ok(DataPlane { server, transport: TcpTransport::new(), peer })
    }

    /// One transfer as the decode side does it: one read per layer.
    fn round(&mut self, into: &mut [u8]) -> Fallible<Duration> {
        let start = Instant::now();
        for (layer, chunk) in into.chunks_exact_mut(LAYER_BYTES as usize).enumerate() {
            let range = (BASE + layer as u64 * LAYER_BYTES, LAYER_BYTES);
            self.transport.read(&self.peer, &[range], chunk)?;
        }
        Ok(start.elapsed())
    }
}

/// A plain socket copy: for each one-byte request a thread writes the whole buffer with
/// `write_all` (request 1) or with one `write_all` per layer (request 2); the client reads it
/// with one `read_exact`.
struct SocketCopy {
    stream: TcpStream,
    sender: thread::JoinHandle<std::io::Result<()>>,
}

impl SocketCopy {
    fn start() -> Fallible<SocketCopy> {
        let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
        let addr = listener.local_addr()?;
        let sender = thread::spawn(move || -> std::io::Result<()> {
            let source: Vec<u8> = (0..TOTAL).map(pattern).collect();
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            let mut go = [0u8; 1];
            // One request per transfer, so both measurements include a request round trip.
            while s.read(&mut go)? == 1 {
                if go[0] == 1 {
                    s.write_all(&source)?;
                } else {
                    for layer in source.chunks(LAYER_BYTES as usize) {
                        s.write_all(layer)?;
                    }
                }
            }
            Ok(())
        });
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(SocketCopy { stream, sender })
    }

    /// One copy: the whole buffer in one `write_all`, or (`per_layer`) one `write_all` per layer.
    fn round(&mut self, into: &mut [u8], per_layer: bool) -> Fallible<Duration> {
        let start = Instant::now();
        self.stream.write_all(&[if per_layer { 2 } else { 1 }])?;
        self.stream.read_exact(into)?;
        Ok(start.elapsed())
    }
}

fn summary(name: &str, times: &[Duration]) -> f64 {
    let total: Duration = times.iter().sum();
    let best = times.iter().min().copied().unwrap_or(total);
    let agg = mb_per_s(TOTAL * times.len() as u64, total);
    println!("{name:<30} {agg:>9.0} MB/s   (best round {:>9.0} MB/s)", mb_per_s(TOTAL, best));
    agg
}

fn main() -> Fallible<()> {
    println!(
        "8K-token DeepSeek-R1 MLA transfer: {LAYERS} layers x {TOKENS} tokens x {BYTES_PER_TOKEN} B = {:.1} MB, \
         {ROUNDS} rounds each, interleaved",
        TOTAL as f64 / 1e6
    );
    let mut into = vec![0u8; TOTAL as usize];
    let mut dp = DataPlane::start()?;
    let mut raw = SocketCopy::start()?;
    // Warm-up: connections, page faults of the destination; and check the bytes once.
    dp.round(&mut into)?;
    if into.iter().enumerate().any(|(i, &b)| b != pattern(i as u64)) {
        return Err("the data plane delivered wrong bytes".into());
    }
    raw.round(&mut into, false)?;
    raw.round(&mut into, true)?;
    // Alternate the two so that frequency scaling and other load hit both alike.
    let (mut dp_times, mut raw_times, mut layered_times) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        dp_times.push(dp.round(&mut into)?);
        raw_times.push(raw.round(&mut into, false)?);
        layered_times.push(raw.round(&mut into, true)?);
    }
    dp.server.shutdown()?;
    drop(raw.stream);
    raw.sender.join().map_err(|_| "sender panicked")??;
    let a = summary("TcpTransport (61 reads)", &dp_times);
    let b = summary("plain socket copy", &raw_times);
    let c = summary("  same, per-layer writes", &layered_times);
    println!("ratio {:.2} against the plain copy (target >= 0.80)", a / b);
    println!("ratio {:.2} against the faster of the two copies", a / b.max(c));
    Ok(())
}
