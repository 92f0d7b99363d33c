//! Drives the data plane's handshake state machines with arbitrary byte streams over real
//! loopback sockets: a stranger's bytes sent to an endpoint's port (the accepting side), and a
//! "server" answering an endpoint's dial with them (the connecting side). Either way the
//! endpoint refuses with an error within its timeout, never panics, and keeps serving.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_agent::dataplane::frame::Channel;
use limpet_agent::{DataPlaneConfig, Endpoint};
use std::io::{Read, Write};
use std::sync::OnceLock;
use std::time::Duration;

fn config(node: u64) -> DataPlaneConfig {
    let mut c = DataPlaneConfig::new(7, node, b"fuzz-secret-0123456789".to_vec());
    c.timeout = Duration::from_millis(200);
    c
}

static SERVER: OnceLock<Endpoint> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let Some((&role, bytes)) = data.split_first() else { return };
    if role % 2 == 0 {
        let server =
            SERVER.get_or_init(|| Endpoint::bind("127.0.0.1:0".parse().unwrap(), config(1)).unwrap());
        let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
        let _ = s.write_all(bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
        let _ = s.read(&mut [0u8; 256]);
    } else {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let bytes = bytes.to_vec();
        let fake = std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
                let _ = s.read(&mut [0u8; 256]);
                let _ = s.write_all(&bytes);
            }
        });
        let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), config(2)).unwrap();
        // Answering needs the server's proof over the client's fresh nonce, made with the
        // secret: a success would be a forged answer.
        assert!(client.connect(&addr, 1, 1, Channel::Ring).is_err(), "an answer without the secret passed");
        drop(client);
        let _ = fake.join();
    }
});
