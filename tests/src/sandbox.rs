//! A sandbox with known memory and files, driven through Podman and planarian.

use crate::*;
use std::process::Command;
use std::time::Duration;

/// Where planarian keeps a store for each container (by its ID).
pub const STORES: &str = "/var/lib/planarian/containers";

/// A sandbox process that holds `MiB` of seeded random memory and a counter, and acts on commands
/// written to /tmp/cmd: `SEQ tick` (counter + 1), `SEQ dirty OFFSET LEN` (rewrites memory),
/// `SEQ fork SEED [PID]` (a child forked without exec, with PID when given, whose first MiB is
/// rewritten from SEED; it answers /tmp/childcmd with `SEQ MD5(its memory)` in /tmp/childstate)
/// and `SEQ reap` (kills the child). After each command it publishes `SEQ COUNTER MD5(memory)`
/// to /tmp/state atomically. (MD5: a check against corruption, not against an adversary; in the
/// emulated test machines SHA-256 costs 15 times as much, 4.5 s against 0.3 s for 32 MiB, and the
/// workloads checksum their whole memory after every command.)
pub const WORKLOAD: &str = r#"
import hashlib, os, random, sys, time
random.seed(7)
buf = bytearray(random.randbytes(int(sys.argv[1]) << 20))
n = 0
seq = 0
def publish():
    with open("/tmp/.state", "w") as f:
        f.write("%d %d %s\n" % (seq, n, hashlib.md5(buf).hexdigest()))
    os.rename("/tmp/.state", "/tmp/state")
publish()
while True:
    try:
        cmd = open("/tmp/cmd").read().split()
    except FileNotFoundError:
        time.sleep(0.2)
        continue
    os.remove("/tmp/cmd")
    seq = int(cmd[0])
    if cmd[1] == "tick":
        n += 1
    elif cmd[1] == "dirty":
        off, ln = int(cmd[2]), int(cmd[3])
        buf[off:off + ln] = os.urandom(ln)
    elif cmd[1] == "fork":
        if len(cmd) > 3:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(int(cmd[3]) - 1))
        child = os.fork()
        if child == 0:
            buf[0:1 << 20] = random.Random(int(cmd[2])).randbytes(1 << 20)
            while True:
                try:
                    c = open("/tmp/childcmd").read().split()
                except FileNotFoundError:
                    time.sleep(0.2)
                    continue
                os.remove("/tmp/childcmd")
                with open("/tmp/.childstate", "w") as f:
                    f.write("%s %d %s\n" % (c[0], os.getpid(), hashlib.md5(buf).hexdigest()))
                os.rename("/tmp/.childstate", "/tmp/childstate")
    elif cmd[1] == "reap":
        os.kill(child, 9)
        os.waitpid(child, 0)
    publish()
"#;

/// How long the workload is given to answer (start, a command, its child): a backstop for a
/// hang. The emulated test machines' speed moves 3-5x over a day, and zfs-fuse's daemon stalls
/// for tens of seconds under load: a minute was too short there.
const PATIENCE: Duration = Duration::from_secs(600);

pub struct Sandbox {
    pub name: String,
    pub seq: u64,
    ctr: Ctr,
    _cleanup: Cleanup,
}

/// A running container's namespaces, where a test reads and changes its files and processes.
pub struct Ctr {
    pub name: String,
    /// The container's ID and the host PID of its first process, once looked up.
    proc: std::cell::RefCell<Option<(String, u32)>>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct State {
    pub counter: u64,
    pub checksum: String,
}

impl Sandbox {
    /// Starts the workload with `mib` MiB. Without a `--network` in `extra` the sandbox has no
    /// network (`--network none`): Podman's bridge costs seconds at every start, restore and
    /// removal under emulation, and is tested where it is the point (TCP, the demo, a sandbox's
    /// isolation from the host, Podman's output, the runtime comparisons). (The MCP sidecar is
    /// the host's: its sandboxes have no network either.)
    pub fn start(tag: &str, mib: u32, extra: &[&str]) -> Sandbox {
        let name = name(tag);
        let mib = mib.to_string();
        let mut args = vec!["run", "-d", "--name", &name];
        if !extra.iter().any(|a| a.starts_with("--network")) {
            args.extend_from_slice(&["--network", "none"]);
        }
        args.extend_from_slice(extra);
        args.extend_from_slice(&[DEBIAN, "python3", "-c", WORKLOAD, &mib]);
        podman("planarian", &args).ok();
        let sb = Sandbox { name: name.clone(), seq: 0, ctr: Ctr::new(&name), _cleanup: Cleanup(name) };
        // (a workload whose container stopped is said at once, not after the backstop)
        let mut gone = false;
        let started = wait_for(PATIENCE, || {
            sb.read().is_some() || {
                gone = sb.ctr.found().is_none();
                gone
            }
        }) && !gone;
        if !started {
            let logs = podman("planarian", &["logs", &sb.name]);
            let why = match gone {
                true => "its container stopped".to_string(),
                false => format!("no state published in {} s", PATIENCE.as_secs()),
            };
            panic!("workload did not start ({why}); its output: {}{}", logs.stdout, logs.stderr);
        }
        sb
    }

    /// A sandbox that already runs (e.g. a fork), removed at the end of the test.
    pub fn attach(name: &str) -> Sandbox {
        let mut sb =
            Sandbox { name: name.to_string(), seq: 0, ctr: Ctr::new(name), _cleanup: Cleanup(name.to_string()) };
        sb.seq = sb.read().expect("the workload runs").0;
        sb
    }

    /// Memory pages CRIU wrote for a statepoint, and where its dump sits in its chain.
    pub fn pages(&self, sp: &str) -> u64 {
        self.manifest(sp)["measurements"]["pages-written"].as_u64().unwrap()
    }

    pub fn chain(&self, sp: &str) -> serde_json::Value {
        self.manifest(sp)["chain"].clone()
    }

    /// An incremental dump at `depth`: fewer than `max_pages` pages written, a parent recorded.
    pub fn assert_incremental(&self, sp: &str, depth: u64, max_pages: u64) {
        let (p, c) = (self.pages(sp), self.chain(sp));
        assert!(p < max_pages, "{sp} should be incremental: {p} pages, chain {c}");
        assert!(c["prev-images-dir"].is_string(), "{sp}: {c}");
        assert_eq!(c["depth"], depth, "{sp}: {c}");
    }

    /// A full dump (more than `min_pages` pages) whose recorded reason contains `why`.
    pub fn assert_full(&self, sp: &str, why: &str, min_pages: u64) {
        let (p, c) = (self.pages(sp), self.chain(sp));
        assert!(p > min_pages, "{sp} should be a full dump: {p} pages, chain {c}");
        assert!(c["prev-images-dir"].is_null() && c["full-reason"].as_str().unwrap_or("").contains(why), "{sp}: {c}");
    }

    /// The sandbox's store, planarian's directory for its container.
    pub fn store(&self) -> std::path::PathBuf {
        std::path::Path::new(STORES).join(self.ctr.id())
    }

    /// Its container's full ID.
    pub fn id(&self) -> String {
        self.ctr.id()
    }
}

/// The store of container `name`, planarian's directory for it.
pub fn store_of(name: &str) -> std::path::PathBuf {
    std::path::Path::new(STORES).join(Ctr::new(name).id())
}

/// Whether the cgroup of container `name`, which runs, is frozen (its `cgroup.events` says so).
pub fn cgroup_frozen(name: &str) -> bool {
    let found = Ctr::new(name).found();
    found.unwrap_or_else(|| panic!("{name}: not running in a cgroup of its own")).1
}

impl Sandbox {
    pub fn read(&self) -> Option<(u64, State)> {
        let text = self.ctr.read("tmp/state")?;
        let mut f = text.split_whitespace();
        let seq = f.next()?.parse().ok()?;
        let counter = f.next()?.parse().ok()?;
        let checksum = f.next()?.to_string();
        Some((seq, State { counter, checksum }))
    }

    pub fn state(&self) -> State {
        self.read().expect("state readable").1
    }

    /// Sends a command and waits for the workload to publish its effect.
    pub fn send(&mut self, cmd: &str) -> State {
        self.seq += 1000;
        let seq = self.seq;
        let root =
            self.ctr.root().unwrap_or_else(|| panic!("{} is not running (or frozen): cannot send {cmd}", self.name));
        std::fs::write(root.join("tmp/.cmd"), format!("{seq} {cmd}\n")).unwrap();
        std::fs::rename(root.join("tmp/.cmd"), root.join("tmp/cmd")).unwrap();
        let mut last = None;
        assert!(
            wait_for(PATIENCE, || {
                last = self.read();
                last.as_ref().is_some_and(|(s, _)| *s == seq)
            }),
            "command {cmd} not acknowledged: {last:?}"
        );
        last.unwrap().1
    }

    /// Runs a shell script in the sandbox's namespaces ([`Ctr::sh`]).
    pub fn sh(&self, script: &str) -> Run {
        self.ctr.sh(script)
    }

    /// Runs a shell script in the sandbox through `podman exec`, as an agent's tool call does.
    pub fn exec(&self, script: &str) -> Run {
        podman("planarian", &["exec", &self.name, "sh", "-c", script])
    }

    pub fn snapshot(&self, name: &str) -> String {
        let r = cmd(planarian_bin().to_str().unwrap(), ["snapshot", &self.name, "--name", name]);
        r.ok();
        r.out()
    }

    pub fn rollback(&mut self, sp: &str) {
        let r = cmd(planarian_bin().to_str().unwrap(), ["rollback", &self.name, sp]);
        r.ok();
        // Running and thawed (its first process, seen without asking Podman: a Podman command
        // costs seconds under emulation; Podman's own word is asserted where it is the point)
        assert!(self.ctr.pid().is_some(), "{}: not running thawed after the rollback", self.name);
        // The restored process continues from the statepoint's sequence number.
        self.seq = self.read().expect("state after rollback").0;
    }

    /// Asks the forked child for (its pid, the checksum of its memory), computed now.
    pub fn child(&mut self) -> (u64, String) {
        self.seq += 1000;
        let seq = self.seq;
        self.sh(&format!("echo {seq} > /tmp/.childcmd && mv /tmp/.childcmd /tmp/childcmd")).ok();
        let mut last = String::new();
        assert!(
            wait_for(PATIENCE, || {
                last = self.sh("cat /tmp/childstate 2>/dev/null").stdout;
                last.split_whitespace().next() == Some(&seq.to_string())
            }),
            "the child did not answer: {last:?}"
        );
        let f: Vec<&str> = last.split_whitespace().collect();
        (f[1].parse().unwrap(), f[2].to_string())
    }

    /// The manifest of one statepoint.
    pub fn manifest(&self, sp: &str) -> serde_json::Value {
        self.statepoints()
            .into_iter()
            .find(|m| m["statepoint-id"] == sp)
            .unwrap_or_else(|| panic!("no statepoint {sp}"))
    }

    pub fn statepoints(&self) -> Vec<serde_json::Value> {
        let r = cmd(planarian_bin().to_str().unwrap(), ["statepoint", "list", &self.name, "--json"]);
        r.ok();
        serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap().as_array().unwrap().clone()
    }
}

impl Ctr {
    pub fn new(name: &str) -> Ctr {
        Ctr { name: name.to_string(), proc: Default::default() }
    }

    /// The workload's root, `/proc/PID/root` of the container's first process, while it runs
    /// and is not frozen (a frozen or paused container answers nothing, as `podman exec` would
    /// not). The workload's files are read and written there, not through a `podman exec` each:
    /// under emulation an exec costs a second or more, and a test sends hundreds of commands.
    /// Its PID is looked up again when a restore gave the container another one.
    pub fn root(&self) -> Option<std::path::PathBuf> {
        Some(sys::proc::Proc::of(self.pid()? as i32).root())
    }

    /// The host PID of the container's first process, while it runs and is not frozen. A restore
    /// that serves memory on demand freezes the container for a moment once its pages are all in
    /// (settling, after the runtime verb returned, under planarian's marker `lazy-pages-frozen`):
    /// that freeze is waited out (two minutes at most), any other is not.
    pub fn pid(&self) -> Option<u32> {
        let settling = |id: &str| std::path::Path::new(STORES).join(id).join("lazy-pages-frozen").exists();
        let mut last = None;
        wait_for(Duration::from_secs(120), || {
            last = self.found();
            !matches!(&last, Some((_, true, id)) if settling(id))
        });
        last.and_then(|(pid, frozen, _)| (!frozen).then_some(pid))
    }

    /// The container's ID: the one looked up with its PID, or asked of Podman.
    pub fn id(&self) -> String {
        if let Some((id, _)) = &*self.proc.borrow() {
            return id.clone();
        }
        podman("planarian", &["inspect", "--format", "{{.Id}}", &self.name]).ok().out()
    }

    /// (the host PID of the container's first process, whether its cgroup is frozen, the
    /// container's ID), while it runs.
    fn found(&self) -> Option<(u32, bool, String)> {
        // (its cgroup, while PID is the container's first process: PID 1 in its namespace; a
        // restore gives that process another host PID, which another of its processes may reuse)
        let cgroup = |id: &str, pid: u32| {
            let p = sys::proc::Proc::of(pid as i32);
            (p.status().ok()?.number("NSpid")? == 1).then_some(())?;
            let c = p.read("cgroup").ok()?;
            let path = c.lines().find_map(|l| l.strip_prefix("0::"))?.to_string();
            path.contains(id).then_some(path)
        };
        let known = self.proc.borrow().clone().and_then(|(id, pid)| Some((pid, cgroup(&id, pid)?)));
        let (pid, path) = match known {
            Some(p) => p,
            None => {
                let out = podman("planarian", &["inspect", "--format", "{{.Id}} {{.State.Pid}}", &self.name]).stdout;
                let (id, pid) = out.trim().split_once(' ')?;
                let pid: u32 = pid.parse().ok().filter(|&p| p > 0)?;
                *self.proc.borrow_mut() = Some((id.to_string(), pid));
                (pid, cgroup(id, pid)?)
            }
        };
        let events = std::fs::read_to_string(format!("/sys/fs/cgroup{path}/cgroup.events")).ok()?;
        let id = self.proc.borrow().as_ref().map(|(id, _)| id.clone())?;
        Some((pid, events.lines().any(|l| l == "frozen 1"), id))
    }

    /// Runs a shell script in the container's namespaces (`nsenter` into those of its first
    /// process: its mounts, root, PIDs, network), as root, for the files and processes a test
    /// reads and changes. Under emulation a `podman exec` costs seconds; it is used where it is
    /// the point ([`Sandbox::exec`]). The container runs and is not frozen; the script runs
    /// outside its cgroup, and does not wait for a snapshot as an exec does: not for a script that
    /// runs while one may be taken.
    pub fn sh(&self, script: &str) -> Run {
        let pid = self.pid().unwrap_or_else(|| panic!("{} is not running (or frozen): cannot run {script}", self.name));
        let args = ["-t", &pid.to_string(), "-a", "-r", "-w", "sh", "-c", script].map(std::ffi::OsString::from);
        let mut nsenter = Command::new("nsenter");
        nsenter
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .env("HOME", "/root");
        run(&mut nsenter, "nsenter", &args)
    }

    /// A file of the container, read in its root (`PATH` relative to it), while it runs.
    pub fn read(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(self.root()?.join(path)).ok()
    }
}
