//! A local cluster's nodes each in a network namespace of their own, with an address of
//! their own on one bridge (a veth pair each), so that what is counted per address
//! (connection caps, a node's sockets and ports) behaves as on a fleet of hosts, and traffic
//! still never leaves the machine. The driver reaches every node through the bridge's own
//! address. Linux and root (CAP_SYS_ADMIN, CAP_NET_ADMIN) only; the namespaces and links go
//! when the fleet is dropped, and those a driver that died left behind are swept at the next
//! start.

use anyhow::Context;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// Names are made from the driver's pid: one fleet a process at a time.
static IN_USE: AtomicBool = AtomicBool::new(false);

/// The bridge and the namespaces of one driver process.
pub struct Fleet {
    tag: u32,
    bridge: String,
    net: u8,
    spaces: Vec<String>,
}

/// Runs `ip` with `args`; its output, or an error naming the command and what it said.
fn ip(args: &[&str]) -> limpet_daemon::Result<String> {
    let out = Command::new("ip").args(args).output().context("running ip (iproute2)")?;
    if !out.status.success() {
        limpet_daemon::fail!(
            "`ip {}` failed: {} (network namespaces need root and iproute2)",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Removes the namespaces and bridges of drivers no longer running.
fn sweep() {
    let alive = |pid: &str| std::path::Path::new(&format!("/proc/{pid}")).exists();
    for line in ip(&["netns", "list"]).unwrap_or_default().lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let pid = name.strip_prefix("limpet-").and_then(|r| r.split('-').next()).unwrap_or_default();
        if !pid.is_empty() && pid.chars().all(|c| c.is_ascii_digit()) && !alive(pid) {
            let _ = ip(&["netns", "del", name]);
        }
    }
    for line in ip(&["-o", "link", "show", "type", "bridge"]).unwrap_or_default().lines() {
        let name = line.split(':').nth(1).unwrap_or_default().trim();
        if let Some(pid) = name.strip_prefix("lmb").filter(|p| p.chars().all(|c| c.is_ascii_digit())) {
            if !alive(pid) {
                let _ = ip(&["link", "del", name]);
            }
        }
    }
}

/// The kernel's IPv4 neighbour (ARP) table is one for every namespace, and its hard limit
/// is 1,024 entries by default; a fleet of N namespaces on one bridge fills about N² (the
/// leader and the driver reach every node), so from 32 nodes new entries were refused
/// ("neighbor table overflow"), packets to unresolved peers dropped and heartbeats lost.
/// Raised, never lowered, to fit 256 nodes; left so after (another fleet may be running, and
/// a larger table costs nothing until it fills).
const NEIGHBOUR_LIMITS: [(&str, u64); 3] =
    [("gc_thresh1", 8192), ("gc_thresh2", 32768), ("gc_thresh3", 65536)];

fn raise_neighbour_table() {
    for (key, want) in NEIGHBOUR_LIMITS {
        let path = format!("/proc/sys/net/ipv4/neigh/default/{key}");
        let Some(now) = std::fs::read_to_string(&path).ok().and_then(|v| v.trim().parse::<u64>().ok()) else {
            continue;
        };
        if now < want {
            match std::fs::write(&path, want.to_string()) {
                Ok(()) => eprintln!(
                    "limpet-lab: raised {path} from {now} to {want} (the fleet's namespaces share it)"
                ),
                Err(e) => eprintln!("limpet-lab: could not raise {path} from {now} to {want}: {e}"),
            }
        }
    }
}

impl Fleet {
    /// A bridge on a /16 of 10.0.0.0/8 that no interface of this machine uses.
    pub fn new() -> limpet_daemon::Result<Fleet> {
        if IN_USE.swap(true, Ordering::SeqCst) {
            limpet_daemon::fail!("this process already runs a cluster in network namespaces");
        }
        let fleet = Fleet::make();
        if fleet.is_err() {
            IN_USE.store(false, Ordering::SeqCst);
        }
        fleet
    }

    fn make() -> limpet_daemon::Result<Fleet> {
        // One driver at a time picks its /16 and takes it (two would pick the same).
        let lock = std::fs::File::create(std::env::temp_dir().join("limpet-netns.lock"))?;
        let _held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| anyhow::anyhow!("locking limpet-netns.lock: {e}"))?;
        sweep();
        raise_neighbour_table();
        let tag = std::process::id();
        // Addresses and routes both: a route to a 10.x network (a VPN, a peered VPC) must
        // not be shadowed.
        let used = ip(&["-o", "-4", "addr", "show"])? + &ip(&["-4", "route", "show"])?;
        let taken = |n: u8| {
            let net = format!("10.{n}.");
            used.lines().any(|l| l.starts_with(&net) || l.contains(&format!(" {net}")))
        };
        let net = (100..=250u8)
            .find(|&n| !taken(n))
            .context("every 10.100-250.0.0/16 is in use on this machine")?;
        let bridge = format!("lmb{tag}");
        // A driver that died with this pid (reused since) may have left its names.
        let _ = ip(&["link", "del", &bridge]);
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        let fleet = Fleet { tag, bridge, net, spaces: Vec::new() };
        ip(&["addr", "add", &format!("10.{net}.0.1/16"), "dev", &fleet.bridge])?;
        ip(&["link", "set", &fleet.bridge, "up"])?;
        Ok(fleet)
    }

    /// Node `index`'s address (1 and up; at most 62,000 nodes).
    pub fn address(&self, index: u64) -> String {
        format!("10.{}.{}.{}", self.net, index / 250, index % 250 + 2)
    }

    /// A namespace for node `index`, its end of a veth pair on the bridge at its address,
    /// and its loopback up: the namespace's name and the address.
    pub fn add(&mut self, index: u64) -> limpet_daemon::Result<(String, String)> {
        let (ns, veth, addr) =
            (format!("limpet-{}-{index}", self.tag), format!("lm{}v{index}", self.tag), self.address(index));
        let _ = ip(&["netns", "del", &ns]);
        ip(&["netns", "add", &ns])?;
        self.spaces.push(ns.clone());
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
        ip(&["link", "set", &veth, "master", &self.bridge, "up"])?;
        ip(&["-n", &ns, "addr", "add", &format!("{addr}/16"), "dev", "eth0"])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        Ok((ns, addr))
    }

    /// A command that runs `program` inside namespace `ns` (`ip netns exec` execs it: the
    /// child's pid is the program's).
    pub fn command(ns: &str, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(program);
        c
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // A namespace's veth end goes with it, and the bridge's end with that.
        for ns in &self.spaces {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
        // The kernel takes a namespace's links down after its last process is gone, on a
        // work queue of its own: the next fleet of this process reuses the names, and found
        // one still there (`bench scale` at 16 synthetic hosts, its second fleet at once).
        let prefix = format!("lm{}v", self.tag);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < deadline
            && ip(&["-o", "link", "show"]).is_ok_and(|l| l.contains(&format!(": {prefix}")))
        {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        IN_USE.store(false, Ordering::SeqCst);
    }
}
