//! CRIU's RPC (`criu swrk`), for what its command line cannot do: containers with a terminal.
//!
//! A terminal container's processes hold the slave of a pseudo-terminal whose master is conmon's.
//! CRIU dumps and restores such a slave only with `orphan_pts_master`, an RPC option: at restore
//! it makes a new pair and hands the master to the caller in the `orphan-pts-master`
//! notification, which planarian passes on to conmon's `--console-socket`, as crun does.
//!
//! In RPC mode CRIU runs no action scripts (the two modes exclude each other): the pre-resume step
//! of Algorithm 1 runs here, in-process, on the `pre-resume` notification, with the same code as
//! `planarian-criu-hooks`.
//!
//! Messages are criu_req / criu_resp of CRIU's rpc.proto (proto2), encoded by hand: a few
//! varints, strings and nested messages.

use super::{DumpPlan, Error, Opt, RestorePlan, Result};
use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
};
use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::{Command, Stdio};
use sys::Context;

const REQ_DUMP: u64 = 1;
const REQ_RESTORE: u64 = 2;
const REQ_NOTIFY: u64 = 6;

/// A protobuf message under construction.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn varint(&mut self, field: u64, v: u64) -> &mut Self {
        criu_hooks::write_varint(&mut self.0, field << 3);
        criu_hooks::write_varint(&mut self.0, v);
        self
    }
    fn int(&mut self, field: u64, v: i32) -> &mut Self {
        // int32: negative values are sign-extended to 64 bits.
        self.varint(field, v as i64 as u64)
    }
    fn flag(&mut self, field: u64, v: bool) -> &mut Self {
        self.varint(field, v as u64)
    }
    fn bytes(&mut self, field: u64, v: &[u8]) -> &mut Self {
        criu_hooks::write_varint(&mut self.0, (field << 3) | 2);
        criu_hooks::write_varint(&mut self.0, v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }
    fn string(&mut self, field: u64, v: &str) -> &mut Self {
        self.bytes(field, v.as_bytes())
    }
    fn msg(&mut self, field: u64, m: &Msg) -> &mut Self {
        self.bytes(field, &m.0)
    }
}

// criu_opts field numbers (rpc.proto).
const IMAGES_DIR_FD: u64 = 1;
const PID: u64 = 2;
const LEAVE_RUNNING: u64 = 3;
const TCP_ESTABLISHED: u64 = 5;
const FILE_LOCKS: u64 = 8;
const LOG_LEVEL: u64 = 9;
const LOG_FILE: u64 = 10;
const NOTIFY_SCRIPTS: u64 = 12;
const ROOT: u64 = 13;
const PARENT_IMG: u64 = 14;
const TRACK_MEM: u64 = 15;
const WORK_DIR_FD: u64 = 17;
const EXT_MNT: u64 = 23;
const MANAGE_CGROUPS: u64 = 24;
const CG_ROOT: u64 = 25;
const RST_SIBLING: u64 = 26;
const INHERIT_FD: u64 = 27;
const FREEZE_CGROUP: u64 = 44;
const LAZY_PAGES: u64 = 48;
const ORPHAN_PTS_MASTER: u64 = 50;
const NETWORK_LOCK: u64 = 64;
/// criu_network_lock_method values.
fn network_lock_method(m: &str) -> u64 {
    match m {
        "nftables" => 2,
        _ => 1,
    }
}

fn pair(key: &str, val: &str) -> Msg {
    let mut m = Msg::default();
    m.string(1, key).string(2, val);
    m
}

/// The options as criu_opts. The images and work directories go as descriptors the caller
/// opened (`criu swrk` reads them through /proc/<caller>/fd); `--restore-detached`, the pid file
/// and action scripts have no place here (the caller is CRIU's parent, gets the pid in the
/// answer, and is notified instead of scripts), and every RPC call asks for notifications and
/// for `orphan_pts_master`, which is why this path exists.
fn encode(opts: &[Opt], images_fd: RawFd, work_fd: RawFd) -> Msg {
    let mut o = Msg::default();
    o.int(IMAGES_DIR_FD, images_fd).int(WORK_DIR_FD, work_fd).flag(ORPHAN_PTS_MASTER, true).flag(NOTIFY_SCRIPTS, true);
    let mut inherit = Vec::new();
    for opt in opts {
        match opt {
            Opt::Tree(pid) => {
                o.int(PID, *pid);
            }
            Opt::ImagesDir(_) | Opt::WorkDir(_) | Opt::RestoreDetached | Opt::PidFile(_) | Opt::ActionScript(_) => {}
            Opt::LogFile(f) => {
                o.int(LOG_LEVEL, 4).string(LOG_FILE, f);
            }
            Opt::LeaveRunning => {
                o.flag(LEAVE_RUNNING, true);
            }
            Opt::TrackMem => {
                o.flag(TRACK_MEM, true);
            }
            Opt::ManageCgroups => {
                o.flag(MANAGE_CGROUPS, true);
            }
            Opt::Root(p) => {
                o.string(ROOT, &p.to_string_lossy());
            }
            Opt::FreezeCgroup(p) => {
                o.string(FREEZE_CGROUP, &p.to_string_lossy());
            }
            Opt::PrevImagesDir(p) => {
                o.string(PARENT_IMG, p);
            }
            Opt::ExtMount(k, v) => {
                o.msg(EXT_MNT, &pair(k, v));
            }
            Opt::NetworkLock(m) => {
                o.varint(NETWORK_LOCK, network_lock_method(m));
            }
            Opt::TcpEstablished(v) => {
                o.flag(TCP_ESTABLISHED, *v);
            }
            Opt::FileLocks(v) => {
                o.flag(FILE_LOCKS, *v);
            }
            Opt::RestoreSibling => {
                o.flag(RST_SIBLING, true);
            }
            Opt::LazyPages => {
                o.flag(LAZY_PAGES, true);
            }
            Opt::CgroupRoot(c) => {
                let mut m = Msg::default();
                m.string(2, c);
                o.msg(CG_ROOT, &m);
            }
            Opt::InheritFd(fd, key) => inherit.push((*fd, key)),
        }
    }
    for (fd, key) in inherit {
        let mut m = Msg::default();
        m.string(1, key).int(2, fd);
        o.msg(INHERIT_FD, &m);
    }
    o
}

/// What CRIU answered.
#[derive(Debug, Default, PartialEq)]
struct Resp {
    kind: u64,
    success: bool,
    script: Option<String>,
    notify_pid: Option<i32>,
    restored_pid: Option<i32>,
    errno: Option<i32>,
    errmsg: Option<String>,
}

fn varint_of(rec: &[u8]) -> u64 {
    let mut pos = 0;
    let _ = criu_hooks::read_varint(rec, &mut pos);
    criu_hooks::read_varint(rec, &mut pos).unwrap_or(0)
}

fn bytes_of(rec: &[u8]) -> &[u8] {
    let mut pos = 0;
    let _ = criu_hooks::read_varint(rec, &mut pos);
    let len = criu_hooks::read_varint(rec, &mut pos).unwrap_or(0) as usize;
    rec.get(pos..pos + len).unwrap_or_default()
}

fn decode(buf: &[u8]) -> Result<Resp> {
    let bad = |e: criu_hooks::ImageError| Error::Rpc(format!("malformed answer from criu: {e}"));
    let mut r = Resp::default();
    for (field, rec) in criu_hooks::records(buf).map_err(bad)? {
        match field {
            1 => r.kind = varint_of(rec),
            2 => r.success = varint_of(rec) != 0,
            4 => {
                for (f, x) in criu_hooks::records(bytes_of(rec)).map_err(bad)? {
                    if f == 1 {
                        r.restored_pid = Some(varint_of(x) as i32);
                    }
                }
            }
            5 => {
                for (f, x) in criu_hooks::records(bytes_of(rec)).map_err(bad)? {
                    match f {
                        1 => r.script = Some(String::from_utf8_lossy(bytes_of(x)).into_owned()),
                        2 => r.notify_pid = Some(varint_of(x) as i32),
                        _ => {}
                    }
                }
            }
            7 => r.errno = Some(varint_of(rec) as i32),
            9 => r.errmsg = Some(String::from_utf8_lossy(bytes_of(rec)).into_owned()),
            _ => {}
        }
    }
    Ok(r)
}

/// A notification from CRIU: the script name, the root task's pid when CRIU gives it, and the
/// file descriptor it passed along (orphan-pts-master).
pub struct Notify {
    pub script: String,
    pub pid: Option<i32>,
    pub fd: Option<OwnedFd>,
}

fn open_dir(p: &Path) -> Result<OwnedFd> {
    use nix::fcntl::{open, OFlag};
    // Without O_CLOEXEC: criu swrk is our child and opens it through /proc/<us>/fd.
    Ok(open(p, OFlag::O_RDONLY | OFlag::O_DIRECTORY, nix::sys::stat::Mode::empty())
        .map_err(std::io::Error::from)
        .at("open", p)?)
}

/// Runs one request through `criu swrk`, answering its notifications with `on_notify`.
/// Returns the restored root task's pid for a restore.
fn call(
    criu: &Path,
    kind: u64,
    opts: &Msg,
    log: &Path,
    netns: Option<RawFd>,
    mut on_notify: impl FnMut(Notify) -> Result<()>,
) -> Result<Option<i32>> {
    let (ours, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
        .map_err(|e| Error::Rpc(format!("cannot create a socket for criu: {e}")))?;
    // The child's end must survive exec: a dup without CLOEXEC, closed here once criu runs.
    let child_fd = nix::unistd::dup(&theirs).map_err(|e| Error::Rpc(format!("dup: {e}")))?;
    let mut cmd = Command::new(criu);
    cmd.arg("swrk").arg(child_fd.as_raw_fd().to_string()).stdin(Stdio::null());
    super::in_netns(&mut cmd, netns);
    let mut child = cmd.spawn().map_err(|source| Error::Run { tool: criu.to_path_buf(), source })?;
    drop(child_fd);
    drop(theirs);
    let mut req = Msg::default();
    req.varint(1, kind).msg(2, opts);
    let result = converse(&ours, kind, &req, log, &mut on_notify);
    drop(ours);
    let _ = child.wait();
    result
}

/// The conversation with `criu swrk` over `ours`: the request, then each notification answered
/// with `on_notify`, until the answer (the restored root's pid for a restore).
fn converse(
    ours: &OwnedFd,
    kind: u64,
    req: &Msg,
    log: &Path,
    on_notify: &mut impl FnMut(Notify) -> Result<()>,
) -> Result<Option<i32>> {
    nix::sys::socket::send(ours.as_raw_fd(), &req.0, MsgFlags::empty())
        .map_err(|e| Error::Rpc(format!("cannot talk to criu: {e}")))?;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let (n, fds) = receive(ours, &mut buf)?;
        if n == 0 {
            return Err(Error::Rpc("criu exited without an answer".into()));
        }
        let r = decode(&buf[..n])?;
        if r.kind == REQ_NOTIFY {
            let script = r.script.clone().unwrap_or_default();
            let outcome = on_notify(Notify { script: script.clone(), pid: r.notify_pid, fd: fds.into_iter().next() });
            let mut ack = Msg::default();
            ack.varint(1, REQ_NOTIFY).flag(3, outcome.is_ok());
            nix::sys::socket::send(ours.as_raw_fd(), &ack.0, MsgFlags::empty())
                .map_err(|e| Error::Rpc(format!("cannot talk to criu: {e}")))?;
            outcome.map_err(|e| Error::Notify { script, why: e.to_string() })?;
            continue;
        }
        if !r.success {
            let why = r
                .errmsg
                .filter(|m| !m.is_empty())
                .or_else(|| super::first_error(log))
                .unwrap_or_else(|| format!("errno {}", r.errno.unwrap_or(0)));
            let verb = if kind == REQ_DUMP { "dump" } else { "restore" };
            return Err(Error::Failed { verb, why, log: log.to_path_buf() });
        }
        return Ok(r.restored_pid);
    }
}

/// One message from criu into `buf`: its length (0: criu is gone) and the descriptors it
/// passed.
fn receive(ours: &OwnedFd, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
    let mut cmsg = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(ours.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| Error::Rpc(format!("cannot read criu's answer: {e}")))?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(|e| Error::Rpc(format!("cannot read criu's answer: {e}")))? {
        if let ControlMessageOwned::ScmRights(v) = c {
            // SAFETY: SCM_RIGHTS descriptors are new ones of this process, owned by no one else.
            fds.extend(v.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    Ok((msg.bytes, fds))
}

pub fn dump(criu: &Path, p: &DumpPlan) -> Result<()> {
    let images = open_dir(p.images_dir)?;
    let opts = encode(&p.options(), images.as_raw_fd(), images.as_raw_fd());
    call(criu, REQ_DUMP, &opts, &p.images_dir.join("dump.log"), p.join_netns, |_| Ok(())).map(|_| ())
}

/// Restores; `on_notify` sees every notification (pre-resume, orphan-pts-master, …).
pub fn restore(criu: &Path, p: &RestorePlan, on_notify: impl FnMut(Notify) -> Result<()>) -> Result<i32> {
    let images = open_dir(p.images_dir)?;
    let work = open_dir(p.work_dir)?;
    let opts = encode(&p.options(), images.as_raw_fd(), work.as_raw_fd());
    call(criu, REQ_RESTORE, &opts, &p.work_dir.join("restore.log"), p.join_netns, on_notify)?
        .ok_or_else(|| Error::Rpc("criu restore reported no pid".into()))
}

/// Hands a terminal's master to conmon's console socket, as runc and crun do.
pub fn send_console(socket: &Path, master: &OwnedFd) -> Result<()> {
    let s = std::os::unix::net::UnixStream::connect(socket).at("connect to", socket)?;
    let fds = [master.as_raw_fd()];
    let iov = [std::io::IoSlice::new(b"console")];
    sendmsg::<()>(s.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
        .map_err(std::io::Error::from)
        .at("send the terminal to", socket)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_criu_opts_as_protobuf() {
        let mut m = Msg::default();
        m.int(IMAGES_DIR_FD, 5).flag(ORPHAN_PTS_MASTER, true).string(ROOT, "/r").int(PID, -1);
        // field 1 varint 5; field 50 (key 400 = 0x90 0x03) true; field 13 "/r"; field 2, -1 as 10 bytes.
        let mut want = vec![0x08, 0x05, 0x90, 0x03, 0x01, 0x6a, 0x02, b'/', b'r', 0x10];
        want.extend_from_slice(&[0xff; 9]);
        want.push(0x01);
        assert_eq!(m.0, want);
    }

    #[test]
    fn the_rpc_carries_what_the_command_line_carries() {
        let spec = crate::runtime::Spec {
            root: "/merged".into(),
            binds: vec![("/etc/hosts".into(), "/run/h".into())],
            ..Default::default()
        };
        let images = Path::new("/st/sp1/criu");
        let plan = DumpPlan {
            pid: 42,
            images_dir: images,
            spec: &spec,
            freeze_cgroup: None,
            prev_images_dir: Some("../../sp0/criu"),
            tcp_established: true,
            file_locks: false,
            masked_dirs: &[],
            network_lock: None,
            dev_external: true,
            join_netns: None,
        };
        let opts = plan.options();
        let m = encode(&opts, 5, 5);
        let fields: Vec<u64> = criu_hooks::records(&m.0).unwrap().into_iter().map(|(f, _)| f).collect();
        for (opt, field) in [
            (Opt::TrackMem, TRACK_MEM),
            (Opt::LeaveRunning, LEAVE_RUNNING),
            (Opt::PrevImagesDir("../../sp0/criu".into()), PARENT_IMG),
        ] {
            assert!(opts.contains(&opt) && fields.contains(&field), "{opt:?}");
        }
        assert_eq!(fields.iter().filter(|f| **f == EXT_MNT).count(), 2, "the bind and /dev, as on the command line");
        let line = super::super::cli_args("dump", &opts)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(line.matches("--ext-mount-map").count(), 2, "{line}");
        assert!(line.contains("--prev-images-dir ../../sp0/criu") && line.contains("--tcp-established"), "{line}");
    }

    #[test]
    fn decodes_notifications_restore_answers_and_errors() {
        let mut notify = Msg::default();
        notify.string(1, "orphan-pts-master").int(2, 4242);
        let mut resp = Msg::default();
        resp.varint(1, REQ_NOTIFY).flag(2, true).msg(5, &notify);
        let r = decode(&resp.0).unwrap();
        assert_eq!((r.kind, r.script.as_deref(), r.notify_pid), (REQ_NOTIFY, Some("orphan-pts-master"), Some(4242)));

        let mut pid = Msg::default();
        pid.int(1, 777);
        let mut done = Msg::default();
        done.varint(1, REQ_RESTORE).flag(2, true).msg(4, &pid);
        assert_eq!(decode(&done.0).unwrap().restored_pid, Some(777));

        let mut fail = Msg::default();
        fail.varint(1, REQ_DUMP).flag(2, false).int(7, 2).string(9, "tty: Unable to find a master");
        let r = decode(&fail.0).unwrap();
        assert!(!r.success);
        assert_eq!((r.errno, r.errmsg.as_deref()), (Some(2), Some("tty: Unable to find a master")));
    }
}
