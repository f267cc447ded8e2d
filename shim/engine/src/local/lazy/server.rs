//! planarian's page server for a lazy restore: it answers CRIU's `restore --lazy-pages` on the
//! socket `lazy-pages.socket` of the restore's work directory, as CRIU's `lazy-pages` daemon
//! does, and serves each restored process's missing pages over userfaultfd from the statepoint's
//! chain of dumps (which CRIU's daemon cannot: see [`super::view`]).
//!
//! The protocol is CRIU's (`criu/uffd.c`): for each process the restore sends its PID (an `int`)
//! and then its userfaultfd (with one byte); a negative PID is a zombie, with no descriptor; at the
//! end it sends `RESTORE_FINISHED`. Then the server installs, for each process, every page its
//! view leaves lazy: the faulting ones first, the rest in the background, and returns once every
//! page is in (or its process gone). It follows the processes' forks (a child starts with what
//! its parent still misses), `mremap`s (a moved page keeps its content) and unmappings.

use super::Error;
use criu_hooks::images::{self, PageRun};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use sys::proc::PAGE_SIZE;

/// What the restore sends once every process is restored ("RSTF").
const RESTORE_FINISHED: u32 = 0x5253_5446;
/// The socket's name in the restore's work directory (CRIU's).
pub const SOCKET: &str = "lazy-pages.socket";
/// Pages installed at once in the background (and after a fault, from the faulting page on).
const BACKGROUND_CHUNK: u64 = 64;
const FAULT_CHUNK: u64 = 16;

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

nix::ioctl_read!(uffdio_wake, 0xAA, 0x02, UffdioRange);
nix::ioctl_readwrite!(uffdio_copy, 0xAA, 0x03, UffdioCopy);
nix::ioctl_readwrite!(uffdio_zeropage, 0xAA, 0x04, UffdioZeropage);

const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_FORK: u8 = 0x13;
const EVENT_REMAP: u8 = 0x14;
const EVENT_REMOVE: u8 = 0x15;
const EVENT_UNMAP: u8 = 0x16;

/// What a serving did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Served {
    pub processes: usize,
    pub lazy_pages: u64,
    pub on_fault: u64,
    pub in_background: u64,
    pub zero_pages: u64,
    pub forks: u64,
    /// Background runs made as the idle class ([`super::pace`]).
    pub idle_runs: u64,
    /// Someone waited for the memory before it was all in (the rest went normal).
    pub hurried: bool,
}

/// The pages a process still misses: start → (end, the address their content had in the dump).
#[derive(Debug, Clone, Default, PartialEq)]
struct Pending(BTreeMap<u64, (u64, u64)>);

impl Pending {
    fn insert(&mut self, start: u64, end: u64, img: u64) {
        if start < end {
            self.0.insert(start, (end, img));
        }
    }

    /// Takes `[lo, hi)` out: the pieces it held, as (start, end, dump address).
    fn take(&mut self, lo: u64, hi: u64) -> Vec<(u64, u64, u64)> {
        let hit: Vec<u64> = self.0.range(..hi).rev().take_while(|(_, (end, _))| *end > lo).map(|(s, _)| *s).collect();
        let mut out = Vec::new();
        for s in hit.into_iter().rev() {
            let (e, img) = self.0.remove(&s).expect("a key just listed");
            self.insert(s, lo.max(s).min(e), img);
            self.insert(hi.max(s).min(e), e, img + (hi.max(s).min(e) - s));
            let (a, b) = (s.max(lo), e.min(hi));
            if a < b {
                out.push((a, b, img + (a - s)));
            }
        }
        out
    }

    fn first(&self) -> Option<(u64, u64, u64)> {
        self.0.iter().next().map(|(s, (e, img))| (*s, *e, *img))
    }

    fn covering(&self, a: u64) -> Option<(u64, u64, u64)> {
        self.0.range(..=a).next_back().filter(|(_, (e, _))| *e > a).map(|(s, (e, img))| (*s, *e, *img))
    }

    fn pages(&self) -> u64 {
        self.0.iter().map(|(s, (e, _))| (e - s) / PAGE_SIZE).sum()
    }
}

/// Where the content of each page of one process lies, by its address in the dump.
struct Contents {
    runs: Vec<PageRun>,
}

/// The image files a dump's pages are read from, each opened once, and mapped (read-only) once
/// pages are installed straight from it.
#[derive(Default)]
pub(crate) struct DumpFiles {
    files: HashMap<PathBuf, DumpFile>,
    /// An image mapped but did not read through its mapping: none is mapped any more.
    read_only: bool,
}

struct DumpFile {
    file: std::fs::File,
    /// `None` until asked for; `Some(None)` when it cannot be mapped (then pages are read).
    map: Option<Option<Mapped>>,
}

/// A whole image file mapped read-only (shared: its pages are the page cache's).
struct Mapped {
    addr: *mut nix::libc::c_void,
    len: usize,
}

impl Mapped {
    fn new(file: &std::fs::File) -> Option<Mapped> {
        let len = usize::try_from(file.metadata().ok()?.len()).ok().filter(|&l| l > 0)?;
        let (prot, flags) = (nix::libc::PROT_READ, nix::libc::MAP_SHARED);
        // SAFETY: a new mapping of our own descriptor, read-only; its address is ours until Drop.
        let addr = unsafe { nix::libc::mmap(std::ptr::null_mut(), len, prot, flags, file.as_raw_fd(), 0) };
        (addr != nix::libc::MAP_FAILED).then_some(Mapped { addr, len })
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { nix::libc::munmap(self.addr, self.len) };
    }
}

impl DumpFiles {
    fn open(&mut self, path: &Path) -> Result<&mut DumpFile, Error> {
        if !self.files.contains_key(path) {
            let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
            self.files.insert(path.to_path_buf(), DumpFile { file, map: None });
        }
        Ok(self.files.get_mut(path).expect("just opened"))
    }

    /// Reads into `buf` the dump's content from address `addr` on, by `runs` (a process's, from
    /// [`images::memory`]); false when part of it is in no image (then `buf` is not all read).
    pub(crate) fn read(&mut self, runs: &[PageRun], addr: u64, buf: &mut [u8]) -> Result<bool, Error> {
        let mut done = 0usize;
        while done < buf.len() {
            let a = addr + done as u64;
            let at = runs.partition_point(|r| r.end() <= a);
            let Some(r) = runs.get(at).filter(|r| r.vaddr <= a) else { return Ok(false) };
            let n = ((r.end() - a) as usize).min(buf.len() - done);
            let f = &self.open(&r.file)?.file;
            f.read_exact_at(&mut buf[done..done + n], r.loc.offset + (a - r.vaddr))
                .map_err(|e| Error::io("read", &r.file, e))?;
            done += n;
        }
        Ok(true)
    }

    /// Pages are read from now on, never from a mapping.
    fn no_mapping(&mut self) {
        self.read_only = true;
        self.files.values_mut().for_each(|f| f.map = None);
    }

    /// Where the dump's `len` bytes from address `addr` on are in this process, when they are
    /// consecutive in one image and it maps: the kernel then copies them from the page cache
    /// into the restored process once (read into a buffer first, they would be copied twice).
    /// `None`: read them.
    pub(crate) fn mapped(&mut self, runs: &[PageRun], addr: u64, len: usize) -> Result<Option<u64>, Error> {
        let at = runs.partition_point(|r| r.end() <= addr);
        let end = addr.checked_add(len as u64);
        let Some(r) = runs.get(at).filter(|r| r.vaddr <= addr && end.is_some_and(|e| e <= r.end())) else {
            return Ok(None);
        };
        if self.read_only {
            return Ok(None);
        }
        let f = self.open(&r.file)?;
        let map = f.map.get_or_insert_with(|| Mapped::new(&f.file));
        // (an offset or a length past the file, as a damaged image could say: read, and fail there)
        let from = r.loc.offset.checked_add(addr - r.vaddr);
        let inside = |m: &&Mapped| from.and_then(|f| f.checked_add(len as u64)).is_some_and(|e| e <= m.len as u64);
        Ok(map.as_ref().filter(inside).map(|m| m.addr as u64 + from.expect("inside")))
    }
}

/// One restored process (or a child it forked since) and its userfaultfd.
struct Task {
    pid: i32,
    /// Closed once the process is gone (a workload that forks much would run out of descriptors).
    uffd: Option<OwnedFd>,
    pending: Pending,
    contents: Rc<Contents>,
    gone: bool,
}

impl Task {
    /// The process is gone: nothing more to serve it, and its userfaultfd closed.
    fn end(&mut self) {
        self.gone = true;
        self.uffd = None;
    }
}

/// The server: the view it serves from (its page maps say which pages are lazy), the dump the
/// contents are read through, and the files those are in.
pub struct Server {
    view: PathBuf,
    files: DumpFiles,
    tasks: Vec<Task>,
    served: Served,
    buf: Vec<u8>,
    next: usize,
    /// The tests' hold on the background transfer: while this file exists, only faults are served.
    held: Option<PathBuf>,
    /// The restore said it finished: every mapping is in place and registered.
    finished: bool,
    /// The serving thread's pace (none: nothing idle).
    pace: Option<Rc<super::pace::Pace>>,
}

impl Server {
    pub fn new(view: &Path, pace: Option<Rc<super::pace::Pace>>) -> Server {
        Server {
            view: view.to_path_buf(),
            files: DumpFiles::default(),
            tasks: Vec::new(),
            served: Served::default(),
            buf: vec![0u8; (BACKGROUND_CHUNK * PAGE_SIZE) as usize],
            next: 0,
            held: None,
            finished: false,
            pace,
        }
    }

    /// Every page is in: the processes' userfaultfds closed (their ranges unregistered). Until
    /// then a process's fork, munmap, mremap or madvise waits for its event to be read, and
    /// nothing reads it once serving has ended.
    pub fn release(&mut self) {
        self.tasks.iter_mut().for_each(Task::end);
    }

    /// Listens at the work directory's socket, says so on `ready` (one byte), takes the
    /// restore's connection and serves until every page is in.
    /// (`&mut`: the processes' userfaultfds stay open, and a fault waits, until the caller has
    /// killed the container when serving failed; closed, a missing page would read as zeros.)
    pub fn run(&mut self, work: &Path, ready: Option<OwnedFd>) -> Result<Served, Error> {
        let path = work.join(SOCKET);
        // (by its name in the work directory, as CRIU connects: the whole path may be longer than
        // a socket address holds)
        std::env::set_current_dir(work).map_err(|e| Error::io("enter", work, e))?;
        let _ = std::fs::remove_file(SOCKET);
        let listener = UnixListener::bind(SOCKET).map_err(|e| Error::io("listen on", &path, e))?;
        if let Some(r) = ready {
            let _ = nix::unistd::write(&r, b"r");
        }
        let (conn, _) = listener.accept().map_err(|e| Error::io("accept on", &path, e))?;
        drop(listener);
        let _ = std::fs::remove_file(&path);
        self.serve(conn, &work.join(super::LOG))
    }

    /// Serves; `log` says "hurried" as soon as someone waits for the memory (the whole of what
    /// was served is written there at the end).
    fn serve(&mut self, mut conn: UnixStream, log: &Path) -> Result<Served, Error> {
        let mut open = true;
        loop {
            let finished = self.finished;
            let missing = self.tasks.iter().any(|t| !t.gone && !t.pending.0.is_empty());
            if finished && !missing {
                break;
            }
            // (the background transfer waits for the restore's end: until CRIU's restorer has put
            // each mapping where it belongs and registered it, a copy there fails)
            let background = finished && missing;
            let held = self.held.as_ref().is_some_and(|p| p.exists());
            let live: Vec<usize> = (0..self.tasks.len()).filter(|&i| !self.tasks[i].gone).collect();
            let mut fds: Vec<PollFd> = live
                .iter()
                .filter_map(|&i| Some(PollFd::new(self.tasks[i].uffd.as_ref()?.as_fd(), PollFlags::POLLIN)))
                .collect();
            if open {
                fds.push(PollFd::new(conn.as_fd(), PollFlags::POLLIN));
            }
            let timeout = match (background, held) {
                // (held: the hold's end is looked for every 50 ms)
                (true, true) => PollTimeout::from(50u16),
                (true, false) => PollTimeout::ZERO,
                (false, _) => PollTimeout::NONE,
            };
            let seen = self.pace.as_ref().map(|p| p.seen());
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(Error::Serve(format!("poll: {e}"))),
            }
            let ready: Vec<bool> = fds.iter().map(|f| f.revents().is_some_and(|r| !r.is_empty())).collect();
            drop(fds);
            if open && ready[live.len()] {
                match self.restore_message(&mut conn)? {
                    Message::Task => {}
                    Message::Finished => {
                        self.finished = true;
                        // (the tests' fault points: a server that dies with pages still to serve, and
                        // one that serves only faults for a while)
                        crate::fault::point("lazy.serving").map_err(|e| Error::Serve(e.to_string()))?;
                        self.held = crate::fault::hold("lazy.background");
                    }
                    Message::Closed if finished => open = false,
                    Message::Closed => return Err(Error::Serve("the restore ended before it finished".into())),
                }
            }
            for (k, &i) in live.iter().enumerate() {
                if ready[k] {
                    self.events(i)?;
                }
            }
            if !self.served.hurried && super::pace::hurried() {
                self.served.hurried = true;
                let _ = std::fs::write(log, "hurried\n");
            }
            if background && !held {
                // (as the idle class; a wake of the watcher since the look: an event may wait,
                // looked for first)
                match (self.pace.clone(), seen) {
                    (Some(p), Some(seen)) => match p.idle(seen, || self.background()) {
                        None => continue,
                        Some((r, idle)) => {
                            r?;
                            self.served.idle_runs += u64::from(idle);
                        }
                    },
                    _ => self.background()?,
                }
            }
        }
        Ok(self.served.clone())
    }

    /// One message from the restore: a process and its userfaultfd, a zombie, or the end.
    fn restore_message(&mut self, conn: &mut UnixStream) -> Result<Message, Error> {
        let mut word = [0u8; 4];
        match conn.read_exact(&mut word) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Message::Closed),
            Err(e) => return Err(Error::Serve(format!("reading the restore's socket: {e}"))),
        }
        let v = u32::from_ne_bytes(word);
        if v == RESTORE_FINISHED {
            return Ok(Message::Finished);
        }
        let pid = v as i32;
        if pid < 0 {
            return Ok(Message::Task);
        }
        let uffd = receive_fd(conn)?;
        let pending = lazy_of(&self.view, pid as u32)?;
        let runs = images::memory(&self.view, pid as u32)?;
        self.served.processes += 1;
        self.served.lazy_pages += pending.pages();
        if let Some(p) = &self.pace {
            p.watch(uffd.as_fd());
        }
        self.tasks.push(Task { pid, uffd: Some(uffd), pending, contents: Rc::new(Contents { runs }), gone: false });
        Ok(Message::Task)
    }

    /// Reads and answers task `i`'s userfaultfd events.
    fn events(&mut self, i: usize) -> Result<(), Error> {
        let mut msg = [0u8; 32];
        loop {
            let Some(uffd) = &self.tasks[i].uffd else { return Ok(()) };
            let n = match nix::unistd::read(uffd, &mut msg) {
                Ok(n) => n,
                Err(nix::errno::Errno::EAGAIN) => return Ok(()),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    return Err(Error::Serve(format!("process {}: reading its userfaultfd: {e}", self.tasks[i].pid)))
                }
            };
            if n == 0 {
                self.tasks[i].end();
                return Ok(());
            }
            let word = |at: usize| u64::from_ne_bytes(msg[at..at + 8].try_into().expect("8 bytes"));
            match msg[0] {
                EVENT_PAGEFAULT => self.fault(i, word(16) & !(PAGE_SIZE - 1))?,
                EVENT_FORK => {
                    // SAFETY: the kernel installed this descriptor in this process for this event.
                    let ufd =
                        unsafe { OwnedFd::from_raw_fd(u32::from_ne_bytes(msg[8..12].try_into().unwrap()) as RawFd) };
                    let parent = &self.tasks[i];
                    let child = Task {
                        pid: parent.pid,
                        uffd: Some(ufd),
                        pending: parent.pending.clone(),
                        contents: parent.contents.clone(),
                        gone: false,
                    };
                    self.served.forks += 1;
                    if let (Some(p), Some(u)) = (&self.pace, &child.uffd) {
                        p.watch(u.as_fd());
                    }
                    self.tasks.push(child);
                }
                EVENT_REMAP => {
                    let (from, to, len) = (word(8), word(16), word(24));
                    let moved = self.tasks[i].pending.take(from, from + len);
                    for (s, e, img) in moved {
                        self.tasks[i].pending.insert(s - from + to, e - from + to, img);
                    }
                }
                EVENT_REMOVE | EVENT_UNMAP => {
                    let _ = self.tasks[i].pending.take(word(8), word(16));
                }
                _ => {}
            }
        }
    }

    /// A fault at page `page` of task `i`: its pages from there on when they are lazy, else a
    /// zero page (memory the dump did not hold, or the process dropped since).
    fn fault(&mut self, i: usize, page: u64) -> Result<(), Error> {
        match self.tasks[i].pending.covering(page) {
            Some((_, end, _)) => {
                let pieces = self.tasks[i].pending.take(page, end.min(page + FAULT_CHUNK * PAGE_SIZE));
                for p in pieces {
                    self.served.on_fault += self.install(i, p)?;
                }
            }
            None => {
                let Some(fd) = self.tasks[i].uffd.as_ref().map(|f| f.as_raw_fd()) else { return Ok(()) };
                let mut z = UffdioZeropage { range: UffdioRange { start: page, len: PAGE_SIZE }, mode: 0, zeropage: 0 };
                // SAFETY: a userfaultfd and a struct of the kernel's layout.
                match unsafe { uffdio_zeropage(fd, &mut z) } {
                    Ok(_) => self.served.zero_pages += 1,
                    Err(nix::errno::Errno::ESRCH | nix::errno::Errno::ENOSPC) => self.tasks[i].end(),
                    // (there already, or the mapping changed: let the thread fault again)
                    Err(_) => wake(fd, page, PAGE_SIZE),
                }
            }
        }
        Ok(())
    }

    /// Installs the next run of pages of the next task that misses some.
    fn background(&mut self) -> Result<(), Error> {
        let n = self.tasks.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            if self.tasks[i].gone {
                continue;
            }
            if let Some((s, e, _)) = self.tasks[i].pending.first() {
                let pieces = self.tasks[i].pending.take(s, e.min(s + BACKGROUND_CHUNK * PAGE_SIZE));
                for p in pieces {
                    self.served.in_background += self.install(i, p)?;
                }
                self.next = i + 1;
                return Ok(());
            }
        }
        Ok(())
    }

    /// Copies the pages of `(start, end, dump address)` into task `i`, page by page where some
    /// are there already. The pages installed; what could not be yet goes back to its pending.
    fn install(&mut self, i: usize, (start, end, img): (u64, u64, u64)) -> Result<u64, Error> {
        let len = (end - start) as usize;
        let contents = self.tasks[i].contents.clone();
        let mapped = self.files.mapped(&contents.runs, img, len)?;
        let src = match mapped {
            Some(at) => at,
            None => {
                self.read(&contents, img, len)?;
                self.buf.as_ptr() as u64
            }
        };
        let Some(fd) = self.tasks[i].uffd.as_ref().map(|f| f.as_raw_fd()) else { return Ok(0) };
        let mut c = UffdioCopy { dst: start, src, len: len as u64, mode: 0, copy: 0 };
        // SAFETY: a userfaultfd, a struct of the kernel's layout, and `len` readable bytes: of our
        // buffer, or of an image's mapping, which lives as long as `self.files`.
        match unsafe { uffdio_copy(fd, &mut c) } {
            Ok(_) => Ok(len as u64 / PAGE_SIZE),
            Err(nix::errno::Errno::ESRCH | nix::errno::Errno::ENOSPC) => {
                self.tasks[i].end();
                Ok(0)
            }
            // An image that maps but does not read through its mapping (nothing was copied: the
            // kernel says EFAULT only then): images are read from now on.
            Err(nix::errno::Errno::EFAULT) if mapped.is_some() => {
                self.files.no_mapping();
                self.install(i, (start, end, img))
            }
            // The kernel copies within one mapping: a run across two (their boundary moved since
            // the dump) goes page by page.
            Err(nix::errno::Errno::ENOENT) if end - start > PAGE_SIZE => {
                let mut n = 0;
                for k in 0..(end - start) / PAGE_SIZE {
                    let at = k * PAGE_SIZE;
                    n += self.install(i, (start + at, start + at + PAGE_SIZE, img + at))?;
                }
                Ok(n)
            }
            // Before the restore finished: the mapping is not in place yet, the page goes back.
            // After: the page's mapping is gone or changed under us (its unmap event follows); a
            // thread that faulted there is woken to fault again.
            Err(nix::errno::Errno::ENOENT) => {
                match self.finished {
                    false => self.tasks[i].pending.insert(start, end, img),
                    true => wake(fd, start, end - start),
                }
                Ok(0)
            }
            Err(e @ (nix::errno::Errno::EEXIST | nix::errno::Errno::EAGAIN)) => {
                let done = c.copy.max(0) as u64 / PAGE_SIZE * PAGE_SIZE;
                // A page there already (the process wrote it since) is woken and skipped; one the
                // kernel could not take yet (its map changing) is tried again later.
                let skip = if e == nix::errno::Errno::EEXIST { PAGE_SIZE } else { 0 };
                let at = start + done;
                if skip > 0 {
                    wake(fd, at, PAGE_SIZE);
                }
                self.tasks[i].pending.insert(at + skip, end, img + done + skip);
                Ok(done / PAGE_SIZE)
            }
            Err(e) => {
                Err(Error::Serve(format!("process {}: installing pages {start:#x}..{end:#x}: {e}", self.tasks[i].pid)))
            }
        }
    }

    /// Reads `len` bytes of the dump's content from dump address `img` into the buffer.
    fn read(&mut self, contents: &Contents, img: u64, len: usize) -> Result<(), Error> {
        match self.files.read(&contents.runs, img, &mut self.buf[..len])? {
            true => Ok(()),
            false => {
                Err(Error::Serve(format!("pages from {img:#x} are lazy in the view and in no image of the chain")))
            }
        }
    }
}

enum Message {
    Task,
    Finished,
    Closed,
}

fn wake(fd: RawFd, start: u64, len: u64) {
    let mut r = UffdioRange { start, len };
    // SAFETY: a userfaultfd and a struct of the kernel's layout.
    let _ = unsafe { uffdio_wake(fd, &mut r) };
}

/// The descriptor the restore sends after a PID (with one byte).
fn receive_fd(conn: &UnixStream) -> Result<OwnedFd, Error> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(conn.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| Error::Serve(format!("receiving a userfaultfd: {e}")))?;
    for c in msg.cmsgs().map_err(|e| Error::Serve(format!("receiving a userfaultfd: {e}")))? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            if let Some(&fd) = fds.first() {
                // SAFETY: a descriptor SCM_RIGHTS just gave this process.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Err(Error::Serve("the restore sent a process without its userfaultfd".into()))
}

/// The pages of process `pid` its view's page map leaves lazy, cut where its mappings begin and
/// end (the kernel installs a run within one mapping only).
fn lazy_of(view: &Path, pid: u32) -> Result<Pending, Error> {
    let (_, entries) = images::pagemap(view, pid)?;
    let bounds: Vec<u64> = images::mm(view, pid)?.vmas.iter().flat_map(|v| [v.start, v.end]).collect();
    let mut p = Pending::default();
    for e in entries.iter().filter(|e| e.flags & images::PE_LAZY != 0) {
        let (lo, hi) = (e.vaddr, e.vaddr + e.nr_pages * PAGE_SIZE);
        let mut cuts: Vec<u64> = bounds.iter().copied().filter(|b| lo < *b && *b < hi).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut at = lo;
        for c in cuts.into_iter().chain([hi]) {
            p.0.insert(at, (c, at));
            at = c;
        }
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_pages_are_taken_split_and_moved_with_their_content() {
        let mut p = Pending::default();
        p.insert(0x10000, 0x20000, 0x10000);
        assert_eq!(p.take(0x12000, 0x14000), vec![(0x12000, 0x14000, 0x12000)]);
        assert_eq!(p.pages(), 14);
        assert_eq!(p.covering(0x13000), None);
        assert_eq!(p.covering(0x14000), Some((0x14000, 0x20000, 0x14000)));
        // An mremap of 0x14000..0x18000 to 0x40000: the pages keep their dump addresses.
        for (s, e, img) in p.take(0x14000, 0x18000) {
            p.insert(s - 0x14000 + 0x40000, e - 0x14000 + 0x40000, img);
        }
        assert_eq!(p.covering(0x41000), Some((0x40000, 0x44000, 0x14000)));
        assert_eq!(p.first(), Some((0x10000, 0x12000, 0x10000)));
        assert_eq!(p.take(0x0, 0x100000).len(), 3);
        assert_eq!(p.pages(), 0);
    }

    /// A dump's pages as its images' mappings give them are what reading the images gives; a
    /// range across two runs, past what an image holds, or at an offset that overflows, is left
    /// to reading.
    #[test]
    fn mapped_pages_are_the_images_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("pages-1.img"), dir.path().join("pages-2.img"));
        let page = |k: u8| vec![k; PAGE_SIZE as usize];
        std::fs::write(&a, [page(1), page(2), page(3), page(4)].concat()).unwrap();
        std::fs::write(&b, [page(7), page(8)].concat()).unwrap();
        let run = |vaddr: u64, nr_pages: u64, file: &Path, offset: u64| PageRun {
            vaddr,
            nr_pages,
            file: file.to_path_buf(),
            loc: images::Location { dev: 0, ino: 0, offset },
            lazy: true,
        };
        // 0x10000..0x12000 from pages 2 and 3 of the first image, 0x12000 from the second's first;
        // then a run that says more pages than its image holds, and one at an offset that wraps.
        let runs = [
            run(0x10000, 2, &a, PAGE_SIZE),
            run(0x12000, 1, &b, 0),
            run(0x20000, 2, &b, PAGE_SIZE),
            run(0x30000, 1, &b, u64::MAX - 100),
        ];
        let mut files = DumpFiles::default();
        let mut bytes = |addr: u64, len: usize| {
            // SAFETY: `len` bytes of an image's mapping, alive as long as `files`.
            files
                .mapped(&runs, addr, len)
                .unwrap()
                .map(|at| unsafe { std::slice::from_raw_parts(at as *const u8, len) }.to_vec())
        };
        let (one, two) = (PAGE_SIZE as usize, 2 * PAGE_SIZE as usize);
        assert_eq!(bytes(0x10000, two), Some([page(2), page(3)].concat()));
        assert_eq!(bytes(0x11000, one), Some(page(3)));
        assert_eq!(bytes(0x12000, one), Some(page(7)));
        assert_eq!(bytes(0x11000, two), None, "across two runs");
        assert_eq!(bytes(0x13000, one), None, "in no run");
        assert_eq!(bytes(0x20000, one), Some(page(8)));
        assert_eq!(bytes(0x20000, two), None, "past the image's end");
        assert_eq!(bytes(0x30000, one), None, "an offset that wraps");
        let mut buf = vec![0u8; two];
        assert!(files.read(&runs, 0x11000, &mut buf).unwrap());
        assert_eq!(buf, [page(3), page(7)].concat());
        files.no_mapping();
        assert_eq!(files.mapped(&runs, 0x10000, two).unwrap(), None, "read only");
    }
}
