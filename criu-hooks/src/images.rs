//! Reading the CRIU images a rollback in place compares a running process tree with: the process
//! tree (`pstree.img`), each thread's registers and signal state (`core-TID.img`), each process's
//! memory mappings (`mm-PID.img`) and pages (`pagemap-PID.img` + `pages-N.img`, through the
//! `parent` links of an incremental chain), and its open files (`fdinfo-N.img`, `files.img`,
//! `pipes-data.img`).
//!
//! Only the fields planarian acts on are decoded (field numbers from CRIU's `images/*.proto`,
//! unchanged from 3.17 to 4.x); every image is checked for its magic. x86_64 only.

use crate::{read_varint, ImageError};
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub const COMMON_MAGIC: u32 = 0x5456_4319;
pub const PSTREE_MAGIC: u32 = 0x5027_3030;
pub const CORE_MAGIC: u32 = 0x5505_3847;
pub const FS_MAGIC: u32 = 0x5140_3912;
pub const MM_MAGIC: u32 = 0x5749_2820;
pub const PAGEMAP_MAGIC: u32 = 0x5608_4025;
pub const FDINFO_MAGIC: u32 = 0x5621_3732;
pub const FILES_MAGIC: u32 = 0x5630_3138;
pub const PIPES_DATA_MAGIC: u32 = 0x5645_3709;
pub const IDS_MAGIC: u32 = 0x5443_2030;

pub const PAGE_SIZE: u64 = 4096;

/// `pagemap_entry.flags`.
pub const PE_PARENT: u32 = 1;
pub const PE_PRESENT: u32 = 4;
/// The pages may be restored on demand (CRIU's `--lazy-pages`).
pub const PE_LAZY: u32 = 2;

/// `vma_entry.status` bits (CRIU's `criu/include/image.h`).
pub const VMA_AREA_REGULAR: u32 = 1;
pub const VMA_AREA_STACK: u32 = 1 << 1;
pub const VMA_AREA_VSYSCALL: u32 = 1 << 2;
pub const VMA_AREA_VDSO: u32 = 1 << 3;
pub const VMA_AREA_HEAP: u32 = 1 << 5;
pub const VMA_FILE_PRIVATE: u32 = 1 << 6;
pub const VMA_FILE_SHARED: u32 = 1 << 7;
pub const VMA_ANON_SHARED: u32 = 1 << 8;
pub const VMA_ANON_PRIVATE: u32 = 1 << 9;
pub const VMA_AREA_VVAR: u32 = 1 << 12;

/// `fd_types` of `fdinfo.proto`.
pub const FD_REG: u32 = 1;
pub const FD_PIPE: u32 = 2;
pub const FD_INETSK: u32 = 4;
pub const FD_UNIXSK: u32 = 5;
pub const FD_EVENTFD: u32 = 6;
pub const FD_EVENTPOLL: u32 = 7;
pub const FD_SIGNALFD: u32 = 9;
pub const FD_TIMERFD: u32 = 17;
pub const SK_QUEUES_MAGIC: u32 = 0x5626_4026;
pub const TCP_STREAM_MAGIC: u32 = 0x5146_5506;

/// Why an image could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: {source}", path.display())]
    Image { path: PathBuf, source: ImageError },
    #[error("{}: {what}", path.display())]
    Content { path: PathBuf, what: String },
}

type Result<T, E = ReadError> = std::result::Result<T, E>;

/// One decoded protobuf field.
#[derive(Debug, Clone, Copy)]
enum Value<'a> {
    Int(u64),
    Bytes(&'a [u8]),
}

/// The fields of one protobuf message, by number, in order.
struct Msg<'a>(Vec<(u64, Value<'a>)>);

impl<'a> Msg<'a> {
    fn parse(b: &'a [u8]) -> std::result::Result<Msg<'a>, ImageError> {
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < b.len() {
            let key = read_varint(b, &mut pos)?;
            let v = match key & 7 {
                0 => Value::Int(read_varint(b, &mut pos)?),
                1 => {
                    let w = b.get(pos..pos + 8).ok_or(ImageError::Protobuf("fixed64 runs past the end"))?;
                    pos += 8;
                    Value::Int(u64::from_le_bytes(w.try_into().unwrap()))
                }
                2 => {
                    let n = read_varint(b, &mut pos)? as usize;
                    let w = b
                        .get(pos..pos.checked_add(n).ok_or(ImageError::Protobuf("length overflows"))?)
                        .ok_or(ImageError::Protobuf("field runs past the end"))?;
                    pos += n;
                    Value::Bytes(w)
                }
                5 => {
                    let w = b.get(pos..pos + 4).ok_or(ImageError::Protobuf("fixed32 runs past the end"))?;
                    pos += 4;
                    Value::Int(u64::from(u32::from_le_bytes(w.try_into().unwrap())))
                }
                _ => return Err(ImageError::Protobuf("unsupported wire type")),
            };
            out.push((key >> 3, v));
        }
        Ok(Msg(out))
    }

    fn int(&self, n: u64) -> Option<u64> {
        self.0.iter().rev().find_map(|(f, v)| match v {
            Value::Int(i) if *f == n => Some(*i),
            _ => None,
        })
    }

    fn u(&self, n: u64) -> u64 {
        self.int(n).unwrap_or(0)
    }

    fn bytes(&self, n: u64) -> Option<&'a [u8]> {
        self.0.iter().rev().find_map(|(f, v)| match v {
            Value::Bytes(b) if *f == n => Some(*b),
            _ => None,
        })
    }

    fn msg(&self, n: u64) -> std::result::Result<Option<Msg<'a>>, ImageError> {
        self.bytes(n).map(Msg::parse).transpose()
    }

    fn msgs(&self, n: u64) -> std::result::Result<Vec<Msg<'a>>, ImageError> {
        self.0
            .iter()
            .filter_map(|(f, v)| match v {
                Value::Bytes(b) if *f == n => Some(Msg::parse(b)),
                _ => None,
            })
            .collect()
    }

    /// A repeated integer field, packed or not.
    fn ints(&self, n: u64) -> std::result::Result<Vec<u64>, ImageError> {
        let mut out = Vec::new();
        for (f, v) in &self.0 {
            if *f != n {
                continue;
            }
            match v {
                Value::Int(i) => out.push(*i),
                Value::Bytes(b) => {
                    let mut pos = 0;
                    while pos < b.len() {
                        out.push(read_varint(b, &mut pos)?);
                    }
                }
            }
        }
        Ok(out)
    }

    fn string(&self, n: u64) -> String {
        self.bytes(n).map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default()
    }
}

/// The entries of an image with the common header and `magic`; a missing file is `None`.
fn entries(path: &Path, magic: u32) -> Result<Option<Vec<Vec<u8>>>> {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ReadError::Io { path: path.to_path_buf(), source }),
    };
    let bad = |source| ReadError::Image { path: path.to_path_buf(), source };
    let word = |at: usize| data.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    let (w0, w1) = (word(0).ok_or(bad(ImageError::Short))?, word(4).ok_or(bad(ImageError::Short))?);
    if w0 != COMMON_MAGIC || w1 != magic {
        return Err(ReadError::Content {
            path: path.to_path_buf(),
            what: format!("not the image expected (magic {w0:#x} {w1:#x}, expected {COMMON_MAGIC:#x} {magic:#x})"),
        });
    }
    let mut at = 8;
    let mut out = Vec::new();
    while at < data.len() {
        let n = word(at).ok_or(bad(ImageError::Short))? as usize;
        let body =
            data.get(at + 4..at + 4 + n).ok_or(bad(ImageError::Length { declared: n, actual: data.len() - at - 4 }))?;
        at += 4 + n;
        // A pipe's or a socket's queued bytes follow its entry (their count in field 2); a TCP
        // stream's entry is followed by its queues' bytes and is the only one.
        if magic == PIPES_DATA_MAGIC || magic == SK_QUEUES_MAGIC {
            at += Msg::parse(body).map_err(bad)?.u(2) as usize;
        }
        out.push(body.to_vec());
        if magic == TCP_STREAM_MAGIC {
            break;
        }
    }
    Ok(Some(out))
}

fn required(path: &Path, magic: u32) -> Result<Vec<Vec<u8>>> {
    entries(path, magic)?
        .ok_or_else(|| ReadError::Io { path: path.to_path_buf(), source: std::io::ErrorKind::NotFound.into() })
}

fn decode<'a>(path: &Path, b: &'a [u8]) -> Result<Msg<'a>> {
    Msg::parse(b).map_err(|source| ReadError::Image { path: path.to_path_buf(), source })
}

/// One process of `pstree.img` (PIDs as the container's PID namespace sees them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    pub ppid: u32,
    pub pgid: u32,
    pub sid: u32,
    pub threads: Vec<u32>,
}

pub fn pstree(dir: &Path) -> Result<Vec<Process>> {
    let path = dir.join("pstree.img");
    required(&path, PSTREE_MAGIC)?
        .iter()
        .map(|e| {
            let m = decode(&path, e)?;
            let threads = m.ints(5).map_err(|source| ReadError::Image { path: path.clone(), source })?;
            Ok(Process {
                pid: m.u(1) as u32,
                ppid: m.u(2) as u32,
                pgid: m.u(3) as u32,
                sid: m.u(4) as u32,
                threads: threads.into_iter().map(|t| t as u32).collect(),
            })
        })
        .collect()
}

/// The FXSAVE part of a thread's FPU state and the upper halves of its AVX registers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FpRegs {
    /// 512 bytes in the layout of `struct user_fpregs_struct` (FXSAVE).
    pub fxsave: Vec<u8>,
    pub xstate_bv: Option<u64>,
    /// 256 bytes: the high 128 bits of ymm0..15, when dumped.
    pub ymmh: Vec<u8>,
}

/// What `core-TID.img` says of one thread.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Core {
    /// `struct user_regs_struct` order: r15 … gs (27 words).
    pub gpregs: Vec<u64>,
    /// 64-bit (native) registers.
    pub native: bool,
    pub fpregs: FpRegs,
    /// The process's state (`TASK_ALIVE`, …): in the thread group leader's image only.
    pub task_state: Option<u32>,
    pub blocked: u64,
    /// Signals queued to the thread (`signals_p`) or the process (`signals_s`).
    pub pending_signals: bool,
    /// Interval timers or POSIX timers armed.
    pub timers: bool,
    /// The thread's queued signals, each a raw `siginfo_t` (128 bytes), in queue order.
    pub signals: Vec<Vec<u8>>,
    /// The process's queued signals (in the thread group leader's image only).
    pub shared_signals: Vec<Vec<u8>>,
    /// The process's real, virtual and profiling interval timers (leader's image only).
    pub itimers: Option<[ITimer; 3]>,
    /// The process's POSIX timers (leader's image only).
    pub posix_timers: Vec<PosixTimer>,
    /// The process's signal dispositions, signals 1 to 64 without SIGKILL and SIGSTOP (leader's
    /// image only; empty in an image of before CRIU 3.0).
    pub sigactions: Vec<SigAction>,
    /// The thread's alternate signal stack: `ss_sp`, `ss_size`, `ss_flags`.
    pub altstack: Option<(u64, u64, u32)>,
    pub files_id: Option<u32>,
    pub comm: String,
    /// The thread's registered `struct rseq` (address, size): fields the kernel rewrites each
    /// time the thread returns to user space (the CPU it runs on).
    pub rseq: Option<(u64, u32)>,
    /// The process's personality (leader's image only).
    pub personality: u32,
    /// The process's resource limits, (soft, hard) by `RLIMIT_*` number (leader's image only).
    pub rlimits: Vec<(u64, u64)>,
    pub oom_score_adj: Option<i32>,
    pub child_subreaper: Option<bool>,
    /// The thread's nice value, scheduling policy and real-time priority.
    pub sched: Option<(i32, u32, u32)>,
    pub creds: Option<Creds>,
    /// The thread's seccomp mode (0 none, 1 strict, 2 filter), when the image says.
    pub seccomp_mode: Option<u32>,
}

/// A thread's credentials (`creds_entry`): user and group IDs (real, effective, saved,
/// filesystem), capability sets (64 bits each), supplementary groups, `no_new_privs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Creds {
    pub uids: [u32; 4],
    pub gids: [u32; 4],
    /// Inheritable, permitted, effective, bounding, ambient.
    pub caps: [u64; 5],
    pub groups: Vec<u32>,
    pub no_new_privs: Option<bool>,
}

pub const TASK_ALIVE: u32 = 1;
pub const TASK_DEAD: u32 = 2;

/// An interval timer (`itimer_entry`): its interval and the time left, in seconds and
/// microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ITimer {
    pub interval: (u64, u64),
    pub value: (u64, u64),
}

impl ITimer {
    pub fn armed(&self) -> bool {
        self.value != (0, 0) || self.interval != (0, 0)
    }
}

/// A POSIX timer (`posix_timer_entry`); times in seconds and nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PosixTimer {
    pub id: u32,
    pub clock: u32,
    pub signo: u32,
    /// `sigev_notify` (`SIGEV_SIGNAL`, `SIGEV_NONE`, `SIGEV_THREAD_ID`).
    pub notify: u32,
    pub sival: u64,
    pub overrun: u32,
    pub interval: (u64, u64),
    pub value: (u64, u64),
    /// For `SIGEV_THREAD_ID`, the thread (in the container's namespace).
    pub thread: Option<i32>,
}

/// A signal's disposition (`sa_entry`): the kernel's `struct sigaction` of `rt_sigaction`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SigAction {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
    /// A 32-bit (compat) disposition.
    pub compat: bool,
}

/// Thread `tid`'s `core-TID.img`: what a rollback in place reads of it. (Long: one decoding
/// step per field of CRIU's `CoreEntry` it uses, in the order of the protobuf; cut apart, each
/// piece would be a few lines taking the same decoded messages.)
pub fn core(dir: &Path, tid: u32) -> Result<Core> {
    let path = dir.join(format!("core-{tid}.img"));
    let e = required(&path, CORE_MAGIC)?;
    let body = e.first().ok_or_else(|| ReadError::Content { path: path.clone(), what: "no core entry".into() })?;
    let bad = |source| ReadError::Image { path: path.clone(), source };
    let m = decode(&path, body)?;
    if m.u(1) != 1 {
        return Err(ReadError::Content { path, what: format!("not an x86_64 image (machine type {})", m.u(1)) });
    }
    let mut c = Core::default();
    if let Some(ti) = m.msg(2).map_err(bad)? {
        if let Some(g) = ti.msg(2).map_err(bad)? {
            c.gpregs = (1..=27).map(|f| g.u(f)).collect();
            c.native = g.int(28).unwrap_or(1) == 1;
        }
        if let Some(f) = ti.msg(3).map_err(bad)? {
            let mut fx = Vec::with_capacity(512);
            fx.extend_from_slice(&(f.u(1) as u16).to_le_bytes());
            fx.extend_from_slice(&(f.u(2) as u16).to_le_bytes());
            fx.extend_from_slice(&(f.u(3) as u16).to_le_bytes());
            fx.extend_from_slice(&(f.u(4) as u16).to_le_bytes());
            fx.extend_from_slice(&f.u(5).to_le_bytes());
            fx.extend_from_slice(&f.u(6).to_le_bytes());
            fx.extend_from_slice(&(f.u(7) as u32).to_le_bytes());
            fx.extend_from_slice(&(f.u(8) as u32).to_le_bytes());
            let mut words = |n: u64, count: usize| -> std::result::Result<(), ImageError> {
                let mut v = f.ints(n)?;
                v.resize(count, 0);
                for w in v {
                    fx.extend_from_slice(&(w as u32).to_le_bytes());
                }
                Ok(())
            };
            words(9, 32).map_err(bad)?;
            words(10, 64).map_err(bad)?;
            words(11, 24).map_err(bad)?;
            c.fpregs.fxsave = fx;
            if let Some(x) = f.msg(13).map_err(bad)? {
                c.fpregs.xstate_bv = x.int(1);
                c.fpregs.ymmh = x.ints(2).map_err(bad)?.into_iter().flat_map(|w| (w as u32).to_le_bytes()).collect();
            }
        }
    }
    if let Some(tc) = m.msg(3).map_err(bad)? {
        c.task_state = Some(tc.u(1) as u32);
        c.blocked = tc.u(5);
        c.comm = tc.string(6);
        if let Some(t) = tc.msg(7).map_err(bad)? {
            let (it, posix) = timers(&t).map_err(bad)?;
            c.timers = it.iter().any(ITimer::armed) || posix.iter().any(|p| p.value != (0, 0));
            c.itimers = Some(it);
            c.posix_timers = posix;
        }
        c.shared_signals = signal_queue(tc.msg(10).map_err(bad)?);
        c.personality = tc.u(3) as u32;
        if let Some(r) = tc.msg(8).map_err(bad)? {
            c.rlimits = r.msgs(1).map_err(bad)?.iter().map(|l| (l.u(1), l.u(2))).collect();
        }
        c.oom_score_adj = tc.int(14).map(|v| v as i64 as i32);
        // (per thread since CRIU 3.x; an older image has the process's here)
        c.seccomp_mode = tc.int(11).map(|m| m as u32);
        c.child_subreaper = tc.int(18).map(|v| v != 0);
        c.sigactions = tc
            .msgs(15)
            .map_err(bad)?
            .iter()
            .map(|a| SigAction { handler: a.u(1), flags: a.u(2), restorer: a.u(3), mask: a.u(4), compat: a.u(5) != 0 })
            .collect();
    }
    if let Some(ids) = m.msg(4).map_err(bad)? {
        c.files_id = ids.int(2).map(|i| i as u32);
    }
    if let Some(th) = m.msg(5).map_err(bad)? {
        if let Some(b) = th.int(6) {
            c.blocked = b;
        }
        c.signals = signal_queue(th.msg(9).map_err(bad)?);
        if let Some(a) = th.msg(7).map_err(bad)? {
            c.altstack = Some((a.u(1), a.u(2), a.u(3) as u32));
        }
        if let Some(r) = th.msg(15).map_err(bad)? {
            if r.u(1) != 0 {
                c.rseq = Some((r.u(1), r.u(2) as u32));
            }
        }
        let comm = th.string(13);
        if !comm.is_empty() {
            c.comm = comm;
        }
        if let Some(nice) = th.int(3) {
            // (sint32: zigzag)
            let nice = ((nice >> 1) as i64 ^ -((nice & 1) as i64)) as i32;
            c.sched = Some((nice, th.u(4) as u32, th.u(5) as u32));
        }
        if let Some(mode) = th.int(11) {
            c.seccomp_mode = Some(mode as u32);
        }
        if let Some(cr) = th.msg(10).map_err(bad)? {
            let cap = |n: u64| -> std::result::Result<u64, ImageError> {
                let w = cr.ints(n)?;
                Ok(w.first().copied().unwrap_or(0) | w.get(1).copied().unwrap_or(0) << 32)
            };
            c.creds = Some(Creds {
                uids: [cr.u(1) as u32, cr.u(3) as u32, cr.u(5) as u32, cr.u(7) as u32],
                gids: [cr.u(2) as u32, cr.u(4) as u32, cr.u(6) as u32, cr.u(8) as u32],
                caps: [
                    cap(9).map_err(bad)?,
                    cap(10).map_err(bad)?,
                    cap(11).map_err(bad)?,
                    cap(12).map_err(bad)?,
                    cap(19).map_err(bad)?,
                ],
                groups: cr.ints(14).map_err(bad)?.into_iter().map(|g| g as u32).collect(),
                // (CRIU writes it only when it is set)
                no_new_privs: Some(cr.int(18).is_some_and(|v| v != 0)),
            });
        }
    }
    c.pending_signals = !c.signals.is_empty() || !c.shared_signals.is_empty();
    Ok(c)
}

/// The siginfos of a `signal_queue_entry`.
fn signal_queue(q: Option<Msg>) -> Vec<Vec<u8>> {
    let Some(q) = q else { return Vec::new() };
    q.0.iter()
        .filter(|(f, _)| *f == 1)
        .filter_map(|(_, v)| match v {
            Value::Bytes(e) => Msg::parse(e).ok()?.bytes(1).map(<[u8]>::to_vec),
            Value::Int(_) => None,
        })
        .collect()
}

/// A `task_timers_entry`: the real, virtual and profiling `itimer_entry`s (isec, iusec, vsec,
/// vusec) and the `posix_timer_entry`s.
fn timers(t: &Msg) -> std::result::Result<([ITimer; 3], Vec<PosixTimer>), ImageError> {
    let mut it = [ITimer::default(); 3];
    for (f, slot) in (1..=3).zip(it.iter_mut()) {
        if let Some(e) = t.msg(f)? {
            *slot = ITimer { interval: (e.u(1), e.u(2)), value: (e.u(3), e.u(4)) };
        }
    }
    let posix = t
        .msgs(4)?
        .iter()
        .map(|p| PosixTimer {
            id: p.u(1) as u32,
            clock: p.u(2) as u32,
            signo: p.u(3) as u32,
            notify: p.u(4) as u32,
            sival: p.u(5),
            overrun: p.u(6) as u32,
            interval: (p.u(7), p.u(8)),
            value: (p.u(9), p.u(10)),
            thread: p.int(11).map(|t| t as u32 as i32),
        })
        .collect();
    Ok((it, posix))
}

/// One memory mapping of `mm-PID.img`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    pub pgoff: u64,
    /// For a file mapping, the id of its file in `files.img`.
    pub shmid: u64,
    pub prot: u32,
    pub flags: u32,
    pub status: u32,
}

impl Vma {
    pub fn is(&self, status: u32) -> bool {
        self.status & status != 0
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mm {
    pub brk: u64,
    pub start_brk: u64,
    pub vmas: Vec<Vma>,
}

/// The id of process `pid`'s descriptor table (`ids-PID.img`, `task_kobj_ids_entry.files_id`).
/// A process's working and root directories (their IDs among the files) and umask
/// (`fs-PID.img`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fs {
    pub cwd_id: u32,
    pub root_id: u32,
    pub umask: Option<u32>,
}

pub fn fs(dir: &Path, pid: u32) -> Result<Fs> {
    let path = dir.join(format!("fs-{pid}.img"));
    let e = required(&path, FS_MAGIC)?;
    let body = e.first().ok_or_else(|| ReadError::Content { path: path.clone(), what: "no fs entry".into() })?;
    let m = decode(&path, body)?;
    Ok(Fs { cwd_id: m.u(1) as u32, root_id: m.u(2) as u32, umask: m.int(3).map(|u| u as u32) })
}

pub fn files_id(dir: &Path, pid: u32) -> Result<u32> {
    let path = dir.join(format!("ids-{pid}.img"));
    let e = required(&path, IDS_MAGIC)?;
    let body = e.first().ok_or_else(|| ReadError::Content { path: path.clone(), what: "no ids entry".into() })?;
    Ok(decode(&path, body)?.u(2) as u32)
}

pub fn mm(dir: &Path, pid: u32) -> Result<Mm> {
    let path = dir.join(format!("mm-{pid}.img"));
    let e = required(&path, MM_MAGIC)?;
    let body = e.first().ok_or_else(|| ReadError::Content { path: path.clone(), what: "no mm entry".into() })?;
    let m = decode(&path, body)?;
    let vmas = m
        .msgs(14)
        .map_err(|source| ReadError::Image { path: path.clone(), source })?
        .iter()
        .map(|v| Vma {
            start: v.u(1),
            end: v.u(2),
            pgoff: v.u(3),
            shmid: v.u(4),
            prot: v.u(5) as u32,
            flags: v.u(6) as u32,
            status: v.u(7) as u32,
        })
        .collect();
    Ok(Mm { brk: m.u(7), start_brk: m.u(6), vmas })
}

/// Writes a `pagemap-PID.img` at `path`: its pages image's id, then `entries` (each with its
/// flags and page count in the fields CRIU reads: 4 and 5; and the count again in field 2, which
/// proto2 requires).
pub fn write_pagemap(path: &Path, pages_id: u32, entries: &[PagemapEntry]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(16 + entries.len() * 20);
    out.extend_from_slice(&COMMON_MAGIC.to_le_bytes());
    out.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
    let mut body = Vec::new();
    let mut entry = |fields: &[(u64, u64)]| {
        body.clear();
        for &(f, v) in fields {
            crate::write_varint(&mut body, f << 3);
            crate::write_varint(&mut body, v);
        }
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
    };
    entry(&[(1, pages_id as u64)]);
    for e in entries {
        entry(&[(1, e.vaddr), (2, e.nr_pages as u32 as u64), (4, e.flags as u64), (5, e.nr_pages)]);
    }
    std::fs::write(path, out)
}

/// One entry of a `pagemap-PID.img`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagemapEntry {
    pub vaddr: u64,
    pub nr_pages: u64,
    pub flags: u32,
}

/// `pagemap-PID.img`: the id of its pages image and its entries.
pub fn pagemap(dir: &Path, pid: u32) -> Result<(u32, Vec<PagemapEntry>)> {
    let path = dir.join(format!("pagemap-{pid}.img"));
    let e = required(&path, PAGEMAP_MAGIC)?;
    let mut it = e.iter();
    let head = decode(
        &path,
        it.next().ok_or_else(|| ReadError::Content { path: path.clone(), what: "no pagemap head".into() })?,
    )?;
    let entries = it
        .map(|b| {
            let m = decode(&path, b)?;
            let flags = match (m.int(4), m.int(3)) {
                (_, Some(1)) => PE_PARENT,
                (Some(f), _) => f as u32,
                (None, _) => PE_PRESENT,
            };
            Ok(PagemapEntry { vaddr: m.u(1), nr_pages: m.int(5).unwrap_or_else(|| m.u(2)), flags })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((head.u(1) as u32, entries))
}

/// One open descriptor of `fdinfo-N.img`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fd {
    pub fd: u32,
    pub id: u32,
    pub kind: u32,
    pub flags: u32,
}

pub fn fdinfo(dir: &Path, files_id: u32) -> Result<Vec<Fd>> {
    let path = dir.join(format!("fdinfo-{files_id}.img"));
    required(&path, FDINFO_MAGIC)?
        .iter()
        .map(|b| {
            let m = decode(&path, b)?;
            Ok(Fd { id: m.u(1) as u32, flags: m.u(2) as u32, kind: m.u(3) as u32, fd: m.u(4) as u32 })
        })
        .collect()
}

/// What `files.img` says of one open file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum File {
    Regular {
        flags: u32,
        pos: u64,
        name: String,
    },
    Pipe {
        inode: u32,
        flags: u32,
    },
    EventFd {
        flags: u32,
        counter: u64,
    },
    /// Times in seconds and nanoseconds; `ticks`: expirations not read yet.
    TimerFd {
        flags: u32,
        clock: u32,
        ticks: u64,
        settime_flags: u32,
        value: (u64, u64),
        interval: (u64, u64),
    },
    SignalFd {
        flags: u32,
        mask: u64,
    },
    /// The interest list: (descriptor, events, data).
    EventPoll {
        flags: u32,
        targets: Vec<(u32, u32, u64)>,
    },
    /// A socket of the container: its inode, family (`AF_UNIX`, `AF_INET`, `AF_INET6`), type,
    /// and state (the kernel's `sk_state`: `TCP_ESTABLISHED`, `TCP_LISTEN`, `TCP_CLOSE`…).
    Socket {
        id: u32,
        ino: u32,
        family: u32,
        kind: u32,
        state: u32,
        /// The open file's flags.
        flags: u32,
        /// An Internet socket's local port.
        port: Option<u32>,
    },
    Other(u32),
}

/// `files.img`: every file object of the dump by its ID. (Long: one arm per kind of file CRIU
/// records that a rollback in place compares.)
pub fn files(dir: &Path) -> Result<HashMap<u32, File>> {
    let path = dir.join("files.img");
    let mut out = HashMap::new();
    for b in required(&path, FILES_MAGIC)? {
        let m = decode(&path, &b)?;
        let bad = |source| ReadError::Image { path: path.clone(), source };
        let kind = m.u(1) as u32;
        let f = match kind {
            FD_REG => match m.msg(3).map_err(bad)? {
                Some(r) => File::Regular { flags: r.u(2) as u32, pos: r.u(3), name: r.string(6) },
                None => File::Other(kind),
            },
            FD_PIPE => match m.msg(18).map_err(bad)? {
                Some(p) => File::Pipe { inode: p.u(2) as u32, flags: p.u(3) as u32 },
                None => File::Other(kind),
            },
            FD_EVENTFD => match m.msg(8).map_err(bad)? {
                Some(e) => File::EventFd { flags: e.u(2) as u32, counter: e.u(4) },
                None => File::Other(kind),
            },
            FD_TIMERFD => match m.msg(12).map_err(bad)? {
                Some(t) => File::TimerFd {
                    flags: t.u(2) as u32,
                    clock: t.u(4) as u32,
                    ticks: t.u(5),
                    settime_flags: t.u(6) as u32,
                    value: (t.u(7), t.u(8)),
                    interval: (t.u(9), t.u(10)),
                },
                None => File::Other(kind),
            },
            FD_SIGNALFD => match m.msg(10).map_err(bad)? {
                Some(g) => File::SignalFd { flags: g.u(2) as u32, mask: g.u(4) },
                None => File::Other(kind),
            },
            FD_EVENTPOLL => match m.msg(9).map_err(bad)? {
                Some(e) => File::EventPoll {
                    flags: e.u(2) as u32,
                    targets: e.msgs(4).map_err(bad)?.iter().map(|t| (t.u(2) as u32, t.u(3) as u32, t.u(4))).collect(),
                },
                None => File::Other(kind),
            },
            FD_UNIXSK => match m.msg(16).map_err(bad)? {
                Some(u) => File::Socket {
                    id: u.u(1) as u32,
                    ino: u.u(2) as u32,
                    family: 1,
                    kind: u.u(3) as u32,
                    state: u.u(4) as u32,
                    flags: u.u(5) as u32,
                    port: None,
                },
                None => File::Other(kind),
            },
            FD_INETSK => match m.msg(4).map_err(bad)? {
                Some(i) => File::Socket {
                    id: i.u(1) as u32,
                    ino: i.u(2) as u32,
                    family: i.u(3) as u32,
                    kind: i.u(4) as u32,
                    state: i.u(6) as u32,
                    flags: i.u(9) as u32,
                    port: Some(i.u(7) as u32),
                },
                None => File::Other(kind),
            },
            k => File::Other(k),
        };
        out.insert(m.u(2) as u32, f);
    }
    Ok(out)
}

/// The pipes (by inode) whose buffered data the dump kept. CRIU records every pipe of the tree
/// there, most with no bytes.
pub fn pipes_with_data(dir: &Path) -> Result<std::collections::BTreeSet<u64>> {
    let path = dir.join("pipes-data.img");
    let mut out = std::collections::BTreeSet::new();
    for e in entries(&path, PIPES_DATA_MAGIC)?.unwrap_or_default() {
        let m = decode(&path, &e)?;
        if m.u(2) > 0 {
            out.insert(m.u(1));
        }
    }
    Ok(out)
}

/// The sockets (by the id of their file) whose queued data the dump kept (`sk-queues.img`).
pub fn sockets_with_data(dir: &Path) -> Result<std::collections::BTreeSet<u32>> {
    let path = dir.join("sk-queues.img");
    let mut out = std::collections::BTreeSet::new();
    for e in entries(&path, SK_QUEUES_MAGIC)?.unwrap_or_default() {
        out.insert(decode(&path, &e)?.u(1) as u32);
    }
    Ok(out)
}

/// Whether the TCP connection of socket inode `ino` had bytes queued (to read, or to send) in the
/// dump (`tcp-stream-INO.img`, written only for established connections).
pub fn tcp_queued(dir: &Path, ino: u32) -> Result<bool> {
    let path = dir.join(format!("tcp-stream-{ino:x}.img"));
    let Some(e) = entries(&path, TCP_STREAM_MAGIC)? else { return Ok(false) };
    let Some(first) = e.first() else { return Ok(false) };
    let m = decode(&path, first)?;
    Ok(m.u(1) > 0 || m.u(3) > 0)
}

/// Where one page's content lies: a pages image (by device and inode, so hard links of one file
/// in a chain's copies compare equal) and the page's offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Location {
    pub dev: u64,
    pub ino: u64,
    pub offset: u64,
}

/// A run of pages whose contents are consecutive in one pages image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageRun {
    pub vaddr: u64,
    pub nr_pages: u64,
    pub file: PathBuf,
    pub loc: Location,
    /// CRIU marked these pages lazily restorable where they were dumped (`PE_LAZY`: a private
    /// anonymous mapping, not a thread's stack page).
    pub lazy: bool,
}

impl PageRun {
    pub fn end(&self) -> u64 {
        self.vaddr + self.nr_pages * PAGE_SIZE
    }
}

/// Every page of process `pid` that the dump in `dir` holds, with where its content lies,
/// following `parent` links for pages the dump left in its parent. Sorted by address.
pub fn memory(dir: &Path, pid: u32) -> Result<Vec<PageRun>> {
    let (pages_id, entries) = pagemap(dir, pid)?;
    let file = dir.join(format!("pages-{pages_id}.img"));
    let md = std::fs::metadata(&file);
    let mut parent: Option<Vec<PageRun>> = None;
    let mut out = Vec::new();
    let mut offset = 0u64;
    for e in entries {
        if e.flags & PE_PARENT != 0 {
            if parent.is_none() {
                let p = std::fs::canonicalize(dir.join("parent"))
                    .map_err(|source| ReadError::Io { path: dir.join("parent"), source })?;
                parent = Some(memory(&p, pid)?);
            }
            let from = parent.as_ref().unwrap();
            let (lo, hi) = (e.vaddr, e.vaddr + e.nr_pages * PAGE_SIZE);
            let mut covered = lo;
            let first = from.partition_point(|r| r.end() <= lo);
            for r in &from[first..] {
                if r.vaddr >= hi {
                    break;
                }
                let s = r.vaddr.max(lo);
                let t = r.end().min(hi);
                if s != covered {
                    break;
                }
                out.push(PageRun {
                    vaddr: s,
                    nr_pages: (t - s) / PAGE_SIZE,
                    file: r.file.clone(),
                    loc: Location { offset: r.loc.offset + (s - r.vaddr), ..r.loc },
                    lazy: r.lazy,
                });
                covered = t;
            }
            if covered != hi {
                return Err(ReadError::Content {
                    path: dir.to_path_buf(),
                    what: format!("pages {covered:#x}..{hi:#x} of process {pid} are in no parent image"),
                });
            }
        } else if e.flags & PE_PRESENT != 0 {
            let md = md.as_ref().map_err(|e| ReadError::Io {
                path: file.clone(),
                source: std::io::Error::new(e.kind(), e.to_string()),
            })?;
            out.push(PageRun {
                vaddr: e.vaddr,
                nr_pages: e.nr_pages,
                file: file.clone(),
                loc: Location { dev: md.dev(), ino: md.ino(), offset },
                lazy: e.flags & PE_LAZY != 0,
            });
            offset += e.nr_pages * PAGE_SIZE;
        }
    }
    out.sort_by_key(|r| r.vaddr);
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::write_varint;

    /// A protobuf encoder for the tests' images.
    #[derive(Default)]
    pub struct Enc(pub Vec<u8>);

    impl Enc {
        pub fn int(mut self, f: u64, v: u64) -> Enc {
            write_varint(&mut self.0, f << 3);
            write_varint(&mut self.0, v);
            self
        }
        pub fn bytes(mut self, f: u64, b: &[u8]) -> Enc {
            write_varint(&mut self.0, (f << 3) | 2);
            write_varint(&mut self.0, b.len() as u64);
            self.0.extend_from_slice(b);
            self
        }
    }

    pub fn image(path: &Path, magic: u32, entries: &[Vec<u8>]) {
        let mut out = Vec::new();
        out.extend_from_slice(&COMMON_MAGIC.to_le_bytes());
        out.extend_from_slice(&magic.to_le_bytes());
        for e in entries {
            out.extend_from_slice(&(e.len() as u32).to_le_bytes());
            out.extend_from_slice(e);
        }
        std::fs::write(path, out).unwrap();
    }

    fn pm(vaddr: u64, n: u64, flags: u32) -> Vec<u8> {
        Enc::default().int(1, vaddr).int(2, n).int(4, u64::from(flags)).0
    }

    /// A scratch directory (removed when the first is dropped) and a directory made in it.
    fn tmp(tag: &str) -> (tempfile::TempDir, PathBuf) {
        let scratch = tempfile::tempdir().unwrap();
        let d = scratch.path().join(tag);
        std::fs::create_dir_all(&d).unwrap();
        (scratch, d)
    }

    #[test]
    fn a_written_page_map_reads_back_with_its_flags() {
        let d = tempfile::tempdir().unwrap();
        let entries = [
            PagemapEntry { vaddr: 0x10000, nr_pages: 3, flags: PE_PARENT | PE_LAZY },
            PagemapEntry { vaddr: 0x7fff_0000_0000, nr_pages: 1, flags: PE_PRESENT },
        ];
        write_pagemap(&d.path().join("pagemap-7.img"), 9, &entries).unwrap();
        assert_eq!(pagemap(d.path(), 7).unwrap(), (9, entries.to_vec()));
    }

    #[test]
    fn memory_follows_parents_and_splits_runs() {
        let (_scratch, d) = tmp("chain");
        let (p, c) = (d.join("p"), d.join("c"));
        std::fs::create_dir_all(&p).unwrap();
        std::fs::create_dir_all(&c).unwrap();
        // Parent: 4 pages at 0x10000 present.
        image(&p.join("pagemap-1.img"), PAGEMAP_MAGIC, &[Enc::default().int(1, 3).0, pm(0x10000, 4, PE_PRESENT)]);
        std::fs::write(p.join("pages-3.img"), vec![0u8; 4 * 4096]).unwrap();
        // Child: page 0x11000 rewritten, the rest in the parent, plus a new page.
        std::os::unix::fs::symlink("../p", c.join("parent")).unwrap();
        image(
            &c.join("pagemap-1.img"),
            PAGEMAP_MAGIC,
            &[
                Enc::default().int(1, 5).0,
                pm(0x10000, 1, PE_PARENT),
                pm(0x11000, 1, PE_PRESENT),
                pm(0x12000, 2, PE_PARENT),
                pm(0x40000, 1, PE_PRESENT),
            ],
        );
        std::fs::write(c.join("pages-5.img"), vec![1u8; 2 * 4096]).unwrap();
        let m = memory(&c, 1).unwrap();
        let got: Vec<(u64, u64, u64, bool)> =
            m.iter().map(|r| (r.vaddr, r.nr_pages, r.loc.offset, r.file.ends_with("p/pages-3.img"))).collect();
        assert_eq!(
            got,
            vec![(0x10000, 1, 0, true), (0x11000, 1, 0, false), (0x12000, 2, 8192, true), (0x40000, 1, 4096, false)]
        );
        // A parent page that is not there is an error, not a hole.
        image(&c.join("pagemap-1.img"), PAGEMAP_MAGIC, &[Enc::default().int(1, 5).0, pm(0x20000, 1, PE_PARENT)]);
        assert!(memory(&c, 1).unwrap_err().to_string().contains("in no parent image"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn core_mm_pstree_and_files_decode() {
        let (_scratch, d) = tmp("decode");
        let regs: Vec<u64> = (1..=27).map(|i| i * 0x100).collect();
        let mut g = Enc::default();
        for (i, r) in regs.iter().enumerate() {
            g = g.int(i as u64 + 1, *r);
        }
        let f = Enc::default().int(1, 0x37f).int(7, 0x1f80).int(9, 5);
        let ti = Enc::default().int(1, 0).bytes(2, &g.0).bytes(3, &f.0);
        let siginfo = [0x11u8; 128];
        let queue = Enc::default().bytes(1, &Enc::default().bytes(1, &siginfo).0);
        let itimer = |v: u64| Enc::default().int(1, 0).int(2, 0).int(3, v).int(4, 0);
        let posix = Enc::default().int(1, 3).int(2, 1).int(3, 34).int(4, 4).int(5, 9).int(6, 0).int(7, 2).int(8, 0);
        let timers = Enc::default()
            .bytes(1, &itimer(100).0)
            .bytes(2, &itimer(0).0)
            .bytes(3, &itimer(0).0)
            .bytes(4, &posix.int(9, 5).int(10, 7).int(11, 12).0);
        let sa = Enc::default().int(1, 0x401000).int(2, 0x4000000).int(3, 0x402000).int(4, 1);
        let rl = |cur: u64, max: u64| Enc::default().int(1, cur).int(2, max).0;
        let rlimits = Enc::default().bytes(1, &rl(8 << 20, u64::MAX)).bytes(1, &rl(1024, 4096));
        let tc = Enc::default()
            .int(1, 1)
            .int(3, 0x0040_0000)
            .int(5, 0x4000)
            .bytes(6, b"python3")
            .bytes(7, &timers.0)
            .bytes(8, &rlimits.0)
            .int(14, (-500i64) as u64)
            .bytes(15, &sa.0)
            .int(18, 1);
        let sas = Enc::default().int(1, 0x7000).int(2, 8192).int(3, 0);
        let creds = Enc::default()
            .int(1, 1000)
            .int(2, 100)
            .int(3, 1001)
            .int(4, 101)
            .int(5, 1002)
            .int(6, 102)
            .int(7, 1003)
            .int(8, 103)
            .int(10, 0xffff_ffff)
            .int(10, 0x1ff)
            .int(14, 27)
            .int(18, 1);
        let th = Enc::default()
            .int(1, 0)
            .int(2, 0)
            .int(3, 9) // nice -5, zigzag
            .int(4, 0)
            .int(6, 0x2000)
            .bytes(7, &sas.0)
            .bytes(9, &queue.0)
            .bytes(10, &creds.0)
            .int(11, 2);
        let core_e = Enc::default()
            .int(1, 1)
            .bytes(2, &ti.0)
            .bytes(3, &tc.0)
            .bytes(4, &Enc::default().int(1, 1).int(2, 9).0)
            .bytes(5, &th.0);
        image(&d.join("core-7.img"), CORE_MAGIC, &[core_e.0]);
        let c = core(&d, 7).unwrap();
        assert_eq!(c.gpregs, regs);
        assert!(c.native);
        assert_eq!(
            (c.blocked, c.files_id, c.comm.as_str(), c.task_state, c.pending_signals),
            (0x2000, Some(9), "python3", Some(TASK_ALIVE), true)
        );
        assert_eq!((c.signals.len(), c.signals[0].as_slice(), c.shared_signals.len()), (1, &siginfo[..], 0));
        let it = c.itimers.unwrap();
        assert_eq!((it[0].value, it[0].armed(), it[1].armed()), ((100, 0), true, false));
        assert!(c.timers);
        assert_eq!(
            c.posix_timers,
            vec![PosixTimer {
                id: 3,
                clock: 1,
                signo: 34,
                notify: 4,
                sival: 9,
                overrun: 0,
                interval: (2, 0),
                value: (5, 7),
                thread: Some(12)
            }]
        );
        assert_eq!(
            c.sigactions,
            vec![SigAction { handler: 0x401000, flags: 0x4000000, restorer: 0x402000, mask: 1, compat: false }]
        );
        assert_eq!(c.altstack, Some((0x7000, 8192, 0)));
        assert_eq!(c.personality, 0x0040_0000);
        assert_eq!(c.rlimits, vec![(8 << 20, u64::MAX), (1024, 4096)]);
        assert_eq!(
            (c.oom_score_adj, c.child_subreaper, c.sched, c.seccomp_mode),
            (Some(-500), Some(true), Some((-5, 0, 0)), Some(2))
        );
        assert_eq!(
            c.creds,
            Some(Creds {
                uids: [1000, 1001, 1002, 1003],
                gids: [100, 101, 102, 103],
                caps: [0, 0x1ff_ffff_ffff, 0, 0, 0],
                groups: vec![27],
                no_new_privs: Some(true),
            })
        );
        let fs_e = Enc::default().int(1, 4).int(2, 5).int(3, 0o027);
        image(&d.join("fs-7.img"), FS_MAGIC, &[fs_e.0]);
        assert_eq!(fs(&d, 7).unwrap(), Fs { cwd_id: 4, root_id: 5, umask: Some(0o027) });
        assert_eq!(c.fpregs.fxsave.len(), 512);
        assert_eq!(&c.fpregs.fxsave[0..2], &0x37fu16.to_le_bytes());
        assert_eq!(&c.fpregs.fxsave[24..28], &0x1f80u32.to_le_bytes());
        assert_eq!(&c.fpregs.fxsave[32..36], &5u32.to_le_bytes());

        let vma = Enc::default()
            .int(1, 0x1000)
            .int(2, 0x3000)
            .int(3, 0)
            .int(4, 0)
            .int(5, 3)
            .int(6, 0x22)
            .int(7, VMA_AREA_REGULAR as u64 | VMA_ANON_PRIVATE as u64);
        image(&d.join("mm-7.img"), MM_MAGIC, &[Enc::default().int(6, 0x5000).int(7, 0x6000).bytes(14, &vma.0).0]);
        let m = mm(&d, 7).unwrap();
        assert_eq!(
            (m.brk, m.start_brk, m.vmas.len(), m.vmas[0].end, m.vmas[0].is(VMA_ANON_PRIVATE)),
            (0x6000, 0x5000, 1, 0x3000, true)
        );

        image(
            &d.join("pstree.img"),
            PSTREE_MAGIC,
            &[Enc::default().int(1, 1).int(2, 0).int(3, 1).int(4, 1).int(5, 1).int(5, 2).0],
        );
        assert_eq!(pstree(&d).unwrap(), vec![Process { pid: 1, ppid: 0, pgid: 1, sid: 1, threads: vec![1, 2] }]);

        let reg = Enc::default().int(1, 4).int(2, 0o2).int(3, 77).bytes(6, b"/tmp/x");
        let pipe = Enc::default().int(1, 5).int(2, 4242);
        image(
            &d.join("files.img"),
            FILES_MAGIC,
            &[
                Enc::default().int(1, 1).int(2, 4).bytes(3, &reg.0).0,
                Enc::default().int(1, 2).int(2, 5).bytes(18, &pipe.0).0,
            ],
        );
        let fs = files(&d).unwrap();
        assert_eq!(fs[&4], File::Regular { flags: 2, pos: 77, name: "/tmp/x".into() });
        assert_eq!(fs[&5], File::Pipe { inode: 4242, flags: 0 });
        assert!(pipes_with_data(&d).unwrap().is_empty());
        // An entry for every pipe, with or without bytes.
        image(
            &d.join("pipes-data.img"),
            PIPES_DATA_MAGIC,
            &[Enc::default().int(1, 4242).int(2, 3).0, Enc::default().int(1, 4243).int(2, 0).int(3, 65536).0],
        );
        // (the first entry's three bytes)
        let mut raw = std::fs::read(d.join("pipes-data.img")).unwrap();
        let first = 8 + 4 + u32::from_le_bytes(raw[8..12].try_into().unwrap()) as usize;
        raw.splice(first..first, *b"abc");
        std::fs::write(d.join("pipes-data.img"), raw).unwrap();
        assert_eq!(pipes_with_data(&d).unwrap().into_iter().collect::<Vec<_>>(), vec![4242]);
        // Another image's magic is refused.
        image(&d.join("pstree.img"), MM_MAGIC, &[]);
        assert!(pstree(&d).unwrap_err().to_string().contains("magic"));
        let _ = std::fs::remove_dir_all(&d);
    }
}
