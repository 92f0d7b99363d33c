//! A TCP relay that delays every byte by a fixed one-way latency, both ways, and may cap each
//! direction's rate: the link between two zones or regions, emulated on one machine (this
//! kernel has no netem).
//!
//! Each accepted connection is forwarded to the target; each direction has a reader, which
//! stamps what it reads with the time it is due, and a writer, which sends it then, or once
//! the bytes before it have gone out at the capped rate (a link's serialization after its
//! propagation delay). Bytes keep their order and the relay adds no loss. The cap is each
//! connection's own, where a host's link to another zone would share one among its flows.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// A listening relay. Dropped, it stops listening; the connections it forwards end with
/// their ends.
pub struct DelayRelay {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl DelayRelay {
    /// Listens on a free loopback port and forwards each connection to `target`, `delay`
    /// later each way.
    /// `bytes_per_s`: each direction's rate (0: the machine's).
    pub fn start(target: SocketAddr, delay: Duration, bytes_per_s: u64) -> std::io::Result<DelayRelay> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        std::thread::Builder::new().name("delay-relay".into()).stack_size(256 << 10).spawn(move || {
            for inc in listener.incoming().flatten() {
                if stopped.load(Ordering::Relaxed) {
                    return;
                }
                if let Ok(out) = TcpStream::connect(target) {
                    let _ = inc.set_nodelay(true);
                    let _ = out.set_nodelay(true);
                    forward(&inc, &out, delay, bytes_per_s);
                    forward(&out, &inc, delay, bytes_per_s);
                }
            }
        })?;
        Ok(DelayRelay { addr, stop })
    }

    /// Where to connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for DelayRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accepting thread, which sees the flag and ends.
        let _ = TcpStream::connect(self.addr);
    }
}

/// Copies `from` to `to`, each read sent `delay` after it arrived; the end of one side
/// ends the other's direction.
fn forward(from: &TcpStream, to: &TcpStream, delay: Duration, bytes_per_s: u64) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else { return };
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
        let _ = std::thread::Builder::new().name(name.into()).stack_size(256 << 10).spawn(f);
    };
    spawn(
        "relay-read",
        Box::new(move || {
            let mut buf = vec![0u8; 64 << 10];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 || tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        }),
    );
    spawn(
        "relay-write",
        Box::new(move || {
            // When the link has sent what came before.
            let mut free = Instant::now();
            for (due, bytes) in rx {
                let at = due.max(free);
                if let Some(wait) = at.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                if to.write_all(&bytes).is_err() {
                    break;
                }
                if bytes_per_s > 0 {
                    free = at + Duration::from_secs_f64(bytes.len() as f64 / bytes_per_s as f64);
                }
            }
            let _ = to.shutdown(Shutdown::Write);
        }),
    );
}

#[cfg(test)]
mod tests {
    use super::DelayRelay;
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    /// A round trip through the relay takes two delays, and the bytes come back whole.
    #[test]
    fn a_round_trip_takes_two_delays() {
        let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = echo.accept().unwrap();
            let mut b = [0u8; 5];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
        });
        let relay = DelayRelay::start(target, Duration::from_millis(40), 0).unwrap();
        let mut c = std::net::TcpStream::connect(relay.addr()).unwrap();
        let t = Instant::now();
        c.write_all(b"hello").unwrap();
        let mut b = [0u8; 5];
        c.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hello");
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(80) && took < Duration::from_secs(2), "took {took:?}");
    }

    /// At a capped rate, a megabyte takes its serialization time on top of the delay.
    #[test]
    fn a_capped_rate_paces_the_bytes() {
        let sink = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let target = sink.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut s, _) = sink.accept().unwrap();
            let t = Instant::now();
            let mut b = vec![0u8; 1 << 20];
            s.read_exact(&mut b).unwrap();
            t.elapsed()
        });
        // 10 MB/s: 1 MiB takes about 105 ms, plus 10 ms of delay.
        let relay = DelayRelay::start(target, Duration::from_millis(10), 10_000_000).unwrap();
        let mut c = std::net::TcpStream::connect(relay.addr()).unwrap();
        c.write_all(&vec![7u8; 1 << 20]).unwrap();
        let took = reader.join().unwrap();
        assert!(took >= Duration::from_millis(90) && took < Duration::from_secs(3), "took {took:?}");
    }
}
