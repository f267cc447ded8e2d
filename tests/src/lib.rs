//! Helpers for the system tests: real Podman, conmon and crun, driven through `--runtime`.
//!
//! The tests need a host that can run containers (tests/vm/run provides one). Where the stack is
//! missing, a test reports SKIPPED on stderr and returns; with `PLANARIAN_REQUIRE_SYSTEM=1`
//! (set by tests/run inside the guest) a missing stack fails the test instead, so nothing is
//! silently skipped where it matters.

pub mod sandbox;

use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub const BUSYBOX: &str = "localhost/planarian-test/busybox";
pub const DEBIAN: &str = "localhost/planarian-test/debian";

/// The planarian binary the tests run: the installed one if present (what Podman calls),
/// else the one cargo built.
pub fn planarian_bin() -> PathBuf {
    let installed = PathBuf::from("/usr/local/bin/planarian");
    if installed.exists() {
        return installed;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/planarian")
}

/// The Python SDK as a user installs it (`pip install ./python`; tests/run installs it into
/// `target/sdk`): the guest tests import it from there, from another directory, never from the
/// source tree, so a module the package does not ship fails them.
pub fn installed_sdk() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/sdk");
    assert!(
        p.join("planarian/__init__.py").exists(),
        "the installed Python SDK is missing ({}): tests/run installs it with pip",
        p.display()
    );
    p
}

/// Runs the planarian command line (its own verbs: snapshot, rollback, ledger, …).
pub fn planarian(args: &[&str]) -> Run {
    cmd(planarian_bin().to_str().unwrap(), args)
}

fn stack_problem() -> Option<String> {
    static PROBLEM: OnceLock<Option<String>> = OnceLock::new();
    PROBLEM
        .get_or_init(|| {
            if !nix::unistd::geteuid().is_root() {
                return Some("not root".into());
            }
            // Where the stack is required (the guests), a container is not started to find out:
            // a suite's first Podman command fails loudly if it is missing, and the probe cost
            // each of the run's suites a `podman run` on the bridge (26 s at a slow hour).
            if std::env::var_os("PLANARIAN_REQUIRE_SYSTEM").is_some() {
                return None;
            }
            let out = Command::new("podman").args(["--runtime", "planarian", "run", "--rm", BUSYBOX, "true"]).output();
            match out {
                Err(e) => Some(format!("podman: {e}")),
                Ok(o) if !o.status.success() => Some(format!(
                    "podman --runtime planarian cannot run a container here: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Ok(_) => None,
            }
        })
        .clone()
}

/// True when the real stack is here. Otherwise prints SKIPPED (or panics when the stack is
/// required) and returns false.
pub fn stack_available(test: &str) -> bool {
    match stack_problem() {
        None => true,
        Some(why) => {
            if std::env::var_os("PLANARIAN_REQUIRE_SYSTEM").is_some() {
                panic!("{test}: the real stack is required here but missing: {why}");
            }
            // Straight to the stderr handle: libtest captures eprintln!, and a skip must be seen.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: needs Podman + crun able to run containers (tests/run uses the guest): {why}"
            );
            false
        }
    }
}

#[macro_export]
macro_rules! require_stack {
    () => {
        if !$crate::stack_available(module_path!()) {
            return;
        }
    };
}

/// The result of one command.
#[derive(Debug, Clone)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn ok(&self) -> &Self {
        assert_eq!(self.code, Some(0), "command failed: {self:?}");
        self
    }
    pub fn out(&self) -> String {
        self.stdout.trim().to_string()
    }
}

impl From<Output> for Run {
    fn from(o: Output) -> Run {
        Run {
            code: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

/// Runs a command and returns what it did.
pub fn cmd<I, S>(program: &str, args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    run(&mut Command::new(program), program, &args)
}

/// Runs `command` (PROGRAM with ARGS, set up as the caller wants) and returns what it did.
pub(crate) fn run(command: &mut Command, program: &str, args: &[std::ffi::OsString]) -> Run {
    let started = Instant::now();
    let run: Run =
        command.args(args).stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("cannot run {program}: {e}")).into();
    trace(program, args, started);
    run
}

/// With PLANARIAN_TEST_TRACE=FILE, each command's time is appended to FILE (where a suite's
/// time goes).
fn trace(program: &str, args: &[std::ffi::OsString], started: Instant) {
    let Some(file) = std::env::var_os("PLANARIAN_TEST_TRACE") else { return };
    let words: Vec<String> = args.iter().take(4).map(|a| a.to_string_lossy().chars().take(40).collect()).collect();
    let line = format!(
        "{:.2} {} {}\n",
        started.elapsed().as_secs_f64(),
        program.rsplit('/').next().unwrap_or(program),
        words.join(" ")
    );
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(file) {
        let _ = f.write_all(line.as_bytes());
    }
}

/// `podman --runtime RUNTIME ARGS…`.
pub fn podman(runtime: &str, args: &[&str]) -> Run {
    let mut all = vec!["--runtime", runtime];
    all.extend_from_slice(args);
    cmd("podman", all)
}

/// A container name unique to this test process.
pub fn name(tag: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("pltest-{tag}-{}-{n}", std::process::id())
}

/// Removes a container when dropped, so a failing test leaves nothing running.
pub struct Cleanup(pub String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove(std::slice::from_ref(&self.0));
    }
}

/// Removes containers (those that exist) when dropped, in one Podman call.
pub struct Cleanups(pub Vec<String>);

impl Drop for Cleanups {
    fn drop(&mut self) {
        remove(&self.0);
    }
}

fn remove(names: &[String]) {
    let _ = Command::new("podman")
        .args(["rm", "-f", "-t", "0", "--ignore"])
        .args(names)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Whether some process waits for a `flock` of the file at `path` (a blocked lock in
/// `/proc/locks`, on its inode).
pub fn lock_waited_for(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(inode) = std::fs::metadata(path).map(|m| m.ino()) else { return false };
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let on = format!(":{inode} ");
    locks.lines().any(|l| l.contains("->") && l.contains("FLOCK") && l.contains(&on))
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    f()
}

/// Runs a command on a new pseudo-terminal as its controlling terminal, waits until the terminal
/// shows `ready` (a shell's prompt), types `input` into it, and returns everything the terminal
/// showed and the exit code.
pub fn run_on_pty(program: &str, args: &[&str], ready: &str, input: &str, timeout: Duration) -> (String, Option<i32>) {
    use nix::pty::openpty;
    use std::io::{Read, Write};
    use std::os::unix::process::CommandExt;
    use std::sync::mpsc::RecvTimeoutError;

    let pty = openpty(None, None).expect("openpty");
    let slave_fd = pty.slave.as_raw_fd();
    let mut child = unsafe {
        Command::new(program)
            .args(args)
            .stdin(Stdio::from(pty.slave.try_clone().unwrap()))
            .stdout(Stdio::from(pty.slave.try_clone().unwrap()))
            .stderr(Stdio::from(pty.slave.try_clone().unwrap()))
            .pre_exec(move || {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                if nix::libc::ioctl(slave_fd, nix::libc::TIOCSCTTY as _, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
            .spawn()
            .expect("spawn on pty")
    };
    drop(pty.slave);
    let mut master = std::fs::File::from(pty.master);
    // Read on a thread, chunk by chunk: the master returns EIO once every slave fd is closed.
    let mut reader = master.try_clone().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let end = Instant::now() + timeout;
    let mut all = Vec::new();
    // Type only once the program is ready to read.
    while !String::from_utf8_lossy(&all).contains(ready) {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok(chunk) => all.extend_from_slice(&chunk),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                let _ = child.kill();
                let _ = child.wait();
                return (String::from_utf8_lossy(&all).into_owned(), None);
            }
        }
    }
    master.write_all(input.as_bytes()).unwrap();
    let code = loop {
        while let Ok(chunk) = rx.try_recv() {
            all.extend_from_slice(&chunk);
        }
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > end {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(master);
    // What the terminal still held when the program exited.
    while let Ok(chunk) = rx.recv_timeout(Duration::from_secs(5)) {
        all.extend_from_slice(&chunk);
    }
    (String::from_utf8_lossy(&all).into_owned(), code)
}

/// A planarian.conf drop-in for the duration of one test.
pub struct DropIn(PathBuf);

impl DropIn {
    pub fn new(name: &str, content: &str) -> DropIn {
        let p = PathBuf::from(format!("/etc/planarian/planarian.conf.d/{name}.conf"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, content).unwrap();
        DropIn(p)
    }
}

impl Drop for DropIn {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `<pool>/sandboxes`, the parent dataset the tests' containers get their datasets under, made
/// when missing, with the Debian test image's base copied into it ahead by `planarian zfs-base`
/// (as the README says to: the first container's create would copy it inside Podman's time
/// limit). The demo's parent too: a guest that ran it has the base already (a copy is minutes
/// under emulation). Once a test process (no test removes it: each suite's later tests find it
/// made; `zfs-base` asks Podman for the image, seconds under emulation).
pub fn zfs_parent(pool: &str) -> String {
    static MADE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let p = format!("{pool}/sandboxes");
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if made.contains(&p) {
        return p;
    }
    if cmd("zfs", ["list", "-H", &p]).code != Some(0) {
        cmd("zfs", ["create", &p]).ok();
    }
    planarian(&["zfs-base", DEBIAN, "--parent-dataset", &p]).ok();
    made.push(p.clone());
    p
}

/// The test pool (the guest makes one), or a loud skip / a failure where the stack is required.
pub fn zfs_test_pool() -> Option<String> {
    match std::env::var("PLANARIAN_TEST_ZPOOL") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            if std::env::var_os("PLANARIAN_REQUIRE_SYSTEM").is_some() {
                panic!("a ZFS test pool is required here (PLANARIAN_TEST_ZPOOL, made by the guest)");
            }
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no ZFS test pool (set PLANARIAN_TEST_ZPOOL; tests/run uses the guest)"
            );
            None
        }
    }
}

/// Writes an executable script at `path`, from another process: a write descriptor this process
/// held while a child forks would make executing it fail with ETXTBSY.
pub fn write_executable(path: &std::path::Path, body: &str) {
    cmd("sh", ["-c", "printf '%s' \"$1\" > \"$2\" && chmod 755 \"$2\"", "sh", body, path.to_str().unwrap()]).ok();
}
