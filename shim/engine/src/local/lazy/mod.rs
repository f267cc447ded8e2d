//! Memory on demand (`checkpoint.lazy_pages`): a restore whose processes run before their
//! memory is all there.
//!
//! The restore (conmon's `restore` verb) makes a view of the statepoint's dump that leaves every
//! lazily restorable page to a page server ([`view`]), starts the server (`planarian
//! __lazy-pages`, a session of its own that outlives the verb: [`Worker`]), and runs CRIU's
//! restore with `--lazy-pages`. The server ([`server`]) installs each page when a process first
//! touches it and the rest in the background. Then it settles ([`settle`]) and ends.
//!
//! **Settling keeps Algorithm 1 true.** Every page the server installs after the pre-resume hook
//! cleared the soft-dirty bits is soft-dirty (the kernel marks what `UFFDIO_COPY` installs dirty),
//! so the next dump would be nearly full. Once every page is in, the server notes each restored
//! process's soft-dirty pages and clears the bits (frozen, an instant), compares those pages with
//! the dump (running), and writes back one byte of each page that differs and was not written
//! since (frozen): afterwards exactly the pages that differ from the statepoint are soft-dirty, as
//! after an eager restore. A snapshot, rollback or spare freeze waits for that ([`settled`]).
//!
//! **The background work waits for idle CPU time** ([`pace`]): forks made side by side are not
//! slowed by each other's page copies; a fault is served at once, and a wait for the memory (a
//! snapshot, rollback or spare) has the rest done without waiting.
//!
//! **A server that fails loses pages.** Once its userfaultfd is closed, the kernel gives a page
//! nobody installed as zeros. So a server that fails (an image it cannot read, a kernel error)
//! kills the restored container's first process, and with it its PID namespace, and records why
//! in the store's marker; a server that dies without a word is found dead by the next operation,
//! which does the same. The container then shows as exited in Podman, and the next snapshot or
//! rollback of it says why. A restore that fails kills its server.

pub mod pace;
pub mod server;
pub mod view;

use crate::local::freezer::{FreezeGuard, Freezer};
use crate::store::ContainerStore;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use sys::proc::{Proc, PAGE_SIZE};

/// The file in a container's store while its memory is being served or settled ([`Pending`]).
pub const MARKER: &str = "lazy-pages.json";
/// Present while settling holds the container frozen; names its cgroup. Its own, not the
/// snapshot's: an operation that recovers what a killed planarian left frozen must not thaw a
/// settling under way (it waits for it instead).
const FROZEN: &str = "lazy-pages-frozen";
/// The server's log, in the restore's work directory: what it served and how settling went.
pub const LOG: &str = "lazy-pages.log";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot {what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Image(#[from] criu_hooks::images::ReadError),
    #[error("the page server: {0}")]
    Serve(String),
    #[error("the container's memory was being restored on demand and was lost: {0}")]
    Lost(String),
    #[error("cannot start the page server: {0}")]
    Start(String),
    #[error(transparent)]
    Local(#[from] Box<crate::local::Error>),
}

impl Error {
    pub fn io(what: &'static str, path: &Path, source: std::io::Error) -> Error {
        Error::Io { what, path: path.to_path_buf(), source }
    }
}

impl From<crate::local::Error> for Error {
    fn from(e: crate::local::Error) -> Error {
        Error::Local(Box::new(e))
    }
}

impl From<sys::IoError> for Error {
    fn from(e: sys::IoError) -> Error {
        Error::Local(Box::new(e.into()))
    }
}

/// What [`MARKER`] holds: the server (its PID and start time), the restored container's first
/// process, the dump it was restored from, and why it failed when it did.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Pending {
    pub server: i32,
    pub server_start: u64,
    pub init: i32,
    pub init_start: u64,
    pub images: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
    /// The server hears a wait for its memory ([`pace::hurry`]); one of an older planarian
    /// would die of the signal.
    #[serde(default)]
    pub hurry: bool,
}

impl Pending {
    fn read(store: &ContainerStore) -> Option<Pending> {
        serde_json::from_slice(&std::fs::read(store.dir.join(MARKER)).ok()?).ok()
    }

    fn write(&self, store: &ContainerStore) -> Result<(), Error> {
        let text = serde_json::to_vec_pretty(self).expect("a marker serialises");
        Ok(sys::write_atomic(&store.dir.join(MARKER), &text, 0o644)?)
    }

    /// Whether this marker is the one in the store (a later restore writes its own).
    fn current(&self, store: &ContainerStore) -> bool {
        Pending::read(store).is_some_and(|m| m.server == self.server && m.server_start == self.server_start)
    }

    fn alive(pid: i32, start: u64) -> bool {
        sys::proc::start_time(pid) == Some(start)
    }

    /// Kills the restored container (its first process, and so its PID namespace) and records
    /// why, when this marker is still the store's.
    fn fail(mut self, store: &ContainerStore, why: String) -> Error {
        if Pending::alive(self.init, self.init_start) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.init), nix::sys::signal::Signal::SIGKILL);
        }
        // (a settling that died frozen: the cgroup thawed, for Podman to clean up)
        if let Ok(dir) = std::fs::read_to_string(store.dir.join(FROZEN)) {
            let _ = Freezer::at(PathBuf::from(dir.trim())).thaw();
            let _ = std::fs::remove_file(store.dir.join(FROZEN));
        }
        if self.current(store) {
            self.failed = Some(why.clone());
            let _ = self.write(store);
        }
        Error::Lost(why)
    }
}

/// Why the memory of the container whose store is `store` was lost, when it was.
pub fn lost(store: &ContainerStore) -> Option<String> {
    Pending::read(store)?.failed
}

/// Waits until the memory of the container whose store is `store` is all there and settled:
/// at once when it was not restored on demand. An error when it was lost (the container was
/// killed; see the module's documentation).
pub fn settled(store: &ContainerStore) -> Result<(), Error> {
    loop {
        let Some(p) = Pending::read(store) else { return Ok(()) };
        if let Some(why) = &p.failed {
            // (the container lost its memory and was stopped; running again, it started anew)
            if !Pending::alive(p.init, p.init_start) {
                let _ = std::fs::remove_file(store.dir.join(MARKER));
                return Ok(());
            }
            return Err(Error::Lost(why.clone()));
        }
        if !Pending::alive(p.server, p.server_start) {
            // (it may have ended between the two reads)
            if Pending::read(store).as_ref() != Some(&p) {
                continue;
            }
            let why = format!(
                "its page server (process {}) died before every page was in; the container was stopped",
                p.server
            );
            return Err(p.fail(store, why));
        }
        // (the rest of the memory, left to idle CPU time, is waited for now)
        if p.hurry {
            pace::hurry(p.server);
        }
        crate::runtime::exec::wait_for_exit(p.server, None);
    }
}

/// The page server of one restore, started before CRIU's restore (it must listen first) and
/// told the restored first process after it; killed when dropped before.
pub struct Worker {
    child: std::process::Child,
    go: Option<OwnedFd>,
    store: ContainerStore,
    images: PathBuf,
}

impl Worker {
    /// Starts `exe __lazy-pages` serving `view` for the restore working in `work`, and waits
    /// until it listens.
    pub fn start(exe: &Path, store: &ContainerStore, images: &Path, view: &Path, work: &Path) -> Result<Worker, Error> {
        // (close-on-exec: what this verb starts next — CRIU, a sidecar — must not hold them, or the
        // server would wait for their end; the server's own two are opened for it across exec)
        let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| Error::Start(format!("pipe: {e}")));
        let (ready_r, ready_w) = pipe()?;
        let (go_r, go_w) = pipe()?;
        let keep = [ready_w.as_raw_fd(), go_r.as_raw_fd()];
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("__lazy-pages")
            .arg(keep[0].to_string())
            .arg(keep[1].to_string())
            .arg(&store.dir)
            .arg(images)
            .arg(view)
            .arg(work)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // The server is a session of its own (a signal to the verb's group does not reach it; its
        // process group, its serving child included, is killed as one), and keeps its two pipe
        // ends, and nothing else, across exec.
        crate::tools::detach_keeping(&mut cmd, &keep);
        let child = cmd.spawn().map_err(|e| Error::Start(format!("{}: {e}", exe.display())))?;
        drop(ready_w);
        drop(go_r);
        // (dropped unready, it is killed)
        let w = Worker { child, go: Some(go_w), store: store.clone(), images: images.to_path_buf() };
        let mut b = [0u8; 1];
        match nix::unistd::read(&ready_r, &mut b) {
            Ok(1) => Ok(w),
            _ => Err(Error::Start(format!("it did not listen (see {})", work.join(LOG).display()))),
        }
    }

    /// The restore succeeded: records the server in the store and tells it the first process.
    pub fn restored(mut self, init: i32) -> Result<(), Error> {
        let server = self.child.id() as i32;
        let p = Pending {
            server,
            server_start: sys::proc::start_time(server).unwrap_or(0),
            init,
            init_start: sys::proc::start_time(init).unwrap_or(0),
            images: self.images.clone(),
            failed: None,
            hurry: true,
        };
        p.write(&self.store)?;
        let told = nix::unistd::write(self.go.as_ref().expect("told once"), format!("{init}\n").as_bytes());
        if let Err(e) = told {
            // (the server is killed as this is dropped: no marker names it)
            let _ = std::fs::remove_file(self.store.dir.join(MARKER));
            return Err(Error::Start(format!("pipe: {e}")));
        }
        self.go = None;
        // (dropped without a wait: its own session, reparented when this verb ends and reaped by
        // whoever adopts it)
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.go.is_some() {
            // (the group: its serving child too, which may wait in accept for a restore that failed)
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = self.child.wait();
        }
    }
}

/// `planarian __lazy-pages READY GO STORE IMAGES VIEW WORK`: serves the restore's pages, then
/// settles them; on a failure, kills the restored container and says why in the store.
///
/// The serving runs in a child, which alone holds the processes' userfaultfds: when it dies
/// (killed, crashed), this process, which waits for it, kills the container before any of its
/// processes runs long on pages nobody installed. This process also hands the child the first
/// process the restore tells (a pipe has one reader).
pub fn work(ready: OwnedFd, go: OwnedFd, store: &Path, images: &Path, view: &Path, work: &Path) -> Result<(), Error> {
    use nix::sys::wait::{waitpid, WaitStatus};
    use nix::unistd::ForkResult;
    let store = ContainerStore { dir: store.to_path_buf() };
    let (fwd_r, fwd_w) = nix::unistd::pipe().map_err(|e| Error::Serve(format!("pipe: {e}")))?;
    // (a wait for the memory is said to the whole session: the serving child hurries, this one
    // must not die of it; before the fork, so before anyone knows the session)
    pace::ignore_hurry();
    // SAFETY: this process is single-threaded (just started): the child may run anything.
    match unsafe { nix::unistd::fork() }.map_err(|e| Error::Serve(format!("fork: {e}")))? {
        ForkResult::Child => {
            drop((go, fwd_w));
            let r = serve_and_settle(ready, fwd_r, &store, images, view, work);
            std::process::exit(i32::from(r.is_err()));
        }
        ForkResult::Parent { child } => {
            drop((ready, fwd_r));
            let init = read_line(go);
            let _ = nix::unistd::write(&fwd_w, init.as_bytes());
            drop(fwd_w);
            let status = loop {
                match waitpid(child, None) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    s => break s,
                }
            };
            if matches!(status, Ok(WaitStatus::Exited(..))) {
                return Ok(());
            }
            let pending = Pending::read(&store);
            let note = format!("the server ended: {status:?}; the store's marker: {pending:?}\n");
            let _ = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(work.join(LOG))
                .and_then(|mut f| std::io::Write::write_all(&mut f, note.as_bytes()));
            match pending.filter(|p| p.server == std::process::id() as i32 && p.failed.is_none()) {
                Some(p) => {
                    Err(p.fail(&store, format!("its page server was killed ({status:?}); the container was stopped")))
                }
                None => Ok(()),
            }
        }
    }
}

/// One line from `fd` (what was there at its end, if it ended first).
fn read_line(fd: OwnedFd) -> String {
    let mut line = String::new();
    let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(std::fs::File::from(fd)), &mut line);
    line
}

/// The child of [`work`]: serves, then settles.
fn serve_and_settle(
    ready: OwnedFd,
    go: OwnedFd,
    store: &ContainerStore,
    images: &Path,
    view: &Path,
    work: &Path,
) -> Result<(), Error> {
    let store = store.clone();
    // (before it says it listens: from then on a restore, and then a waiter, may know it)
    pace::listen();
    let pace = pace::Pace::new().map(std::rc::Rc::new);
    let mut server = server::Server::new(view, pace.clone());
    let began = std::time::Instant::now();
    let served = server.run(work, Some(ready));
    let serving = began.elapsed();
    let log = work.join(LOG);
    if let Err(e) = &served {
        let _ = std::fs::write(&log, format!("{e}\n"));
    }
    // The restore tells the first process once it has ended (nothing: it failed, and kills this).
    let init: i32 = read_line(go).trim().parse().map_err(|_| Error::Serve("the restore did not end".into()))?;
    let Some(p) = Pending::read(&store).filter(|p| p.init == init) else { return Ok(()) };
    match served {
        // (the killing first: the userfaultfds, closed with the server, would give zeros)
        Err(e) => Err(p.fail(&store, e.to_string())),
        Ok(s) => {
            // (every page is in: nothing to serve, and events nobody reads would hold the
            // container's processes while settling runs)
            server.release();
            let began = std::time::Instant::now();
            let settled = settle(&store, p.init, images, pace.as_deref());
            let (serving, settling) = (serving.as_millis(), began.elapsed().as_millis());
            let _ = std::fs::write(
                &log,
                format!("{s:?}\n{settled:?}\nlistened and served for {serving} ms, settled in {settling} ms\n"),
            );
            if let Err(e) = &settled {
                // The bits may be cleared with some changed pages unmarked: the next dump is full.
                crate::chain::invalidate_base(
                    &store,
                    p.init_start,
                    &format!("settling lazily restored memory failed: {e}"),
                );
            }
            if p.current(&store) {
                let _ = std::fs::remove_file(store.dir.join(MARKER));
            }
            settled.map(|_| ())
        }
    }
}

/// What settling found: the soft-dirty pages of the restored processes, and how many of them
/// differ from the dump (marked again).
#[derive(Debug, Default, PartialEq)]
pub struct Settled {
    pub soft_dirty: u64,
    pub differ: u64,
}

/// Leaves soft-dirty, in each process of the container whose first process is `init` that the
/// dump in `images` holds, exactly the pages that differ from the dump (see the module's
/// documentation).
pub fn settle(store: &ContainerStore, init: i32, images: &Path, pace: Option<&pace::Pace>) -> Result<Settled, Error> {
    let freezer = Freezer::of_pid(init)?;
    let store_marker = store.dir.join(FROZEN);
    let dumped: std::collections::HashMap<u32, ()> =
        criu_hooks::images::pstree(images)?.iter().map(|p| (p.pid, ())).collect();
    let procs: Vec<(i32, u32)> = crate::local::inplace::cgroup_pids(freezer.dir())
        .into_iter()
        .filter_map(|pid| Some((pid, virtual_pid(pid)?)))
        .filter(|(_, v)| dumped.contains_key(v))
        .collect();
    let mut out = Settled::default();
    // 1. frozen: each process's soft-dirty pages, then the bits cleared.
    let mut dirty = Vec::new();
    {
        let _frozen = FreezeGuard::freeze(&freezer, store_marker.clone())?;
        // (the tests' fault point: the window held open, for a `pause` to come in it)
        crate::fault::point("lazy.settling").map_err(|e| Error::Serve(e.to_string()))?;
        for &(pid, _) in &procs {
            let pages = soft_dirty(pid)?;
            Proc::of(pid).clear_soft_dirty()?;
            out.soft_dirty += pages.len() as u64;
            dirty.push(pages);
        }
    }
    // 2. running: which of them differ from the dump (a page written meanwhile is soft-dirty again
    // anyway).
    let mut differ = Vec::new();
    for (&(pid, vpid), pages) in procs.iter().zip(&dirty) {
        differ.push(differing(pid, &criu_hooks::images::memory(images, vpid)?, pages, pace)?);
    }
    // 3. frozen: one byte of each, written back, where nothing wrote since.
    let _frozen = FreezeGuard::freeze(&freezer, store_marker)?;
    for (&(pid, _), pages) in procs.iter().zip(&differ) {
        out.differ += mark(pid, pages)?;
    }
    Ok(out)
}

fn virtual_pid(pid: i32) -> Option<u32> {
    Proc::of(pid).status().ok()?.number("NSpid").and_then(|v| u32::try_from(v).ok())
}

/// The soft-dirty pages of process `pid` (present or swapped out).
fn soft_dirty(pid: i32) -> Result<Vec<u64>, Error> {
    use sys::proc::pagemap::{scan, PRESENT, SOFT_DIRTY, SWAPPED};
    let proc = Proc::of(pid);
    let pagemap = proc.open("pagemap")?;
    let mut out = Vec::new();
    for m in proc.maps()?.iter().filter(|m| m.path != "[vsyscall]") {
        let _ = scan(&pagemap, m.start, m.end, |a, e| {
            if e & SOFT_DIRTY != 0 && e & (PRESENT | SWAPPED) != 0 {
                out.push(a);
            }
            std::ops::ControlFlow::Continue(())
        })
        .map_err(|e| Error::io("read", &proc.path("pagemap"), e))?;
    }
    Ok(out)
}

/// Of `pages` (ascending), those whose content in process `pid` is not the dump's (`runs`), or
/// that the dump does not hold. Read in runs of up to 64 pages.
/// (Each run of pages as the idle class, as the transfer's: [`pace`].)
fn differing(
    pid: i32,
    runs: &[criu_hooks::images::PageRun],
    pages: &[u64],
    pace: Option<&pace::Pace>,
) -> Result<Vec<u64>, Error> {
    const MAX: usize = 64;
    let mem = Proc::of(pid).open("mem")?;
    let mut files = server::DumpFiles::default();
    let mut bufs = (vec![0u8; MAX * PAGE_SIZE as usize], vec![0u8; PAGE_SIZE as usize]);
    let mut out = Vec::new();
    let mut i = 0;
    while i < pages.len() {
        let mut step = || compare_run(&mem, runs, &mut files, &pages[i..], MAX, &mut bufs, &mut out);
        i += match pace.and_then(|p| p.idle(p.seen(), &mut step)) {
            Some((n, _)) => n?,
            None => step()?,
        };
    }
    Ok(out)
}

/// Compares the first run of consecutive `pages` (at most `max`) with the dump, into `out`
/// (those that differ); how many pages it took.
fn compare_run(
    mem: &std::fs::File,
    runs: &[criu_hooks::images::PageRun],
    files: &mut server::DumpFiles,
    pages: &[u64],
    max: usize,
    (now, then): &mut (Vec<u8>, Vec<u8>),
    out: &mut Vec<u64>,
) -> Result<usize, Error> {
    use std::os::unix::fs::FileExt;
    let mut n = 1;
    while n < pages.len() && n < max && pages[n] == pages[0] + n as u64 * PAGE_SIZE {
        n += 1;
    }
    let len = n * PAGE_SIZE as usize;
    if n > 1 && mem.read_exact_at(&mut now[..len], pages[0]).is_err() {
        // (part of it unmapped meanwhile: page by page)
        n = 1;
    }
    let len = n * PAGE_SIZE as usize;
    if n == 1 && mem.read_exact_at(&mut now[..len], pages[0]).is_err() {
        // (unreadable: marked if it is still there)
        out.push(pages[0]);
        return Ok(1);
    }
    for (k, chunk) in now[..len].chunks_exact(PAGE_SIZE as usize).enumerate() {
        let a = pages[k];
        // (a page the dump does not hold differs)
        if !files.read(runs, a, then)? || chunk != then.as_slice() {
            out.push(a);
        }
    }
    Ok(n)
}

/// Marks `pages` of the frozen process `pid` soft-dirty where they are there (present or swapped
/// out) and not already:
/// one byte read and written back as it was. How many were marked.
fn mark(pid: i32, pages: &[u64]) -> Result<u64, Error> {
    use std::os::unix::fs::FileExt;
    use sys::proc::pagemap::{PRESENT, SOFT_DIRTY, SWAPPED};
    let proc = Proc::of(pid);
    let pagemap = proc.open("pagemap")?;
    let mem = proc.open_mem_rw()?;
    let mut marked = 0;
    for &a in pages {
        let mut e = [0u8; 8];
        pagemap
            .read_exact_at(&mut e, a / PAGE_SIZE * 8)
            .map_err(|err| Error::io("read", &proc.path("pagemap"), err))?;
        let e = u64::from_le_bytes(e);
        if e & (PRESENT | SWAPPED) == 0 || e & SOFT_DIRTY != 0 {
            continue;
        }
        let mut b = [0u8; 1];
        mem.read_exact_at(&mut b, a).map_err(|err| Error::io("read", &proc.path("mem"), err))?;
        mem.write_all_at(&b, a).map_err(|err| Error::io("write", &proc.path("mem"), err))?;
        marked += 1;
    }
    Ok(marked)
}
