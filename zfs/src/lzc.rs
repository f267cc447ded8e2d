//! OpenZFS's libzfs_core — the stable library over the ZFS ioctls — loaded at run time where it
//! is installed, for the operations on a rollback's critical path: a snapshot, an
//! incremental send stream, whether a snapshot exists. Each `zfs` command costs a
//! process start on top of its work (about 110 ms of a 117–185 ms command in the emulated guest,
//! where `zfs version` alone takes 106–112); through the library the work is all that is left. Where the library or `/dev/zfs` is not
//! there (zfs-fuse has neither), [`Core::get`] is `None` and the command line is used.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

/// `nvlist_t`, never looked into here.
type NvList = c_void;

type InitFn = unsafe extern "C" fn() -> c_int;
type SnapshotFn = unsafe extern "C" fn(*mut NvList, *mut NvList, *mut *mut NvList) -> c_int;
type SendFn = unsafe extern "C" fn(*const c_char, *const c_char, c_int, c_int) -> c_int;
type ExistsFn = unsafe extern "C" fn(*const c_char) -> c_int;
type AllocFn = unsafe extern "C" fn(*mut *mut NvList, u32, c_int) -> c_int;
type AddBooleanFn = unsafe extern "C" fn(*mut NvList, *const c_char) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut NvList);

/// The functions used, from libzfs_core and libnvpair.
pub struct Core {
    snapshot: SnapshotFn,
    send: SendFn,
    exists: ExistsFn,
    nvlist_alloc: AllocFn,
    nvlist_add_boolean: AddBooleanFn,
    nvlist_free: FreeFn,
}

/// `NV_UNIQUE_NAME`: an nvlist whose names are unique.
const NV_UNIQUE_NAME: u32 = 1;

static CORE: OnceLock<Option<Core>> = OnceLock::new();

impl Core {
    /// The library, loaded and initialised once per process (`libzfs_core_init` opens
    /// `/dev/zfs`); `None` where it cannot be.
    pub fn get() -> Option<&'static Core> {
        CORE.get_or_init(load).as_ref()
    }

    /// Whether dataset or snapshot `name` exists: `false` for any error too (no permission, a
    /// suspended pool, a name it cannot take), so only a `true` is an answer.
    pub fn exists(&self, name: &str) -> bool {
        let Ok(name) = CString::new(name) else { return false };
        // SAFETY: a NUL-terminated name that outlives the call.
        unsafe { (self.exists)(name.as_ptr()) != 0 }
    }

    /// `zfs snapshot SNAP`: `Err(errno)`.
    pub fn snapshot(&self, snap: &str) -> Result<(), i32> {
        let name = CString::new(snap).map_err(|_| libc::EINVAL)?;
        // SAFETY (both closures): `list` is the live list `with_list` made; `name` outlives the
        // calls; the error list a snapshot returns is freed once.
        self.with_list(
            |list| unsafe { (self.nvlist_add_boolean)(list, name.as_ptr()) },
            |list| unsafe {
                let mut errors: *mut NvList = std::ptr::null_mut();
                let e = (self.snapshot)(list, std::ptr::null_mut(), &mut errors);
                if !errors.is_null() {
                    (self.nvlist_free)(errors);
                }
                e
            },
        )
    }

    /// A list made, filled by `fill` and handed to `call`, then freed: the first errno of the
    /// three.
    fn with_list(
        &self,
        fill: impl FnOnce(*mut NvList) -> c_int,
        call: impl FnOnce(*mut NvList) -> c_int,
    ) -> Result<(), i32> {
        let mut list: *mut NvList = std::ptr::null_mut();
        // SAFETY: nvlist_alloc has the C signature declared above and fills `list`, which is
        // freed once, after the last use.
        let e = unsafe { (self.nvlist_alloc)(&mut list, NV_UNIQUE_NAME, 0) };
        if e != 0 {
            return Err(e);
        }
        let e = match fill(list) {
            0 => call(list),
            e => e,
        };
        // SAFETY: as above.
        unsafe { (self.nvlist_free)(list) };
        if e == 0 {
            Ok(())
        } else {
            Err(e)
        }
    }

    /// `zfs send -i FROM SNAP`, the stream read by `read` as it comes (on this thread; the
    /// kernel writes it into a pipe from another). The stream's reading is `read`'s result; a
    /// send that failed is `Err(errno)` (the reading then failed too, at the stream's end).
    pub fn send<T, E>(
        &self,
        from: &str,
        snap: &str,
        read: impl FnOnce(std::fs::File) -> Result<T, E>,
    ) -> Result<Result<T, E>, i32> {
        let (from, snap) = (CString::new(from), CString::new(snap));
        let (Ok(from), Ok(snap)) = (from, snap) else { return Err(libc::EINVAL) };
        let mut fds = [0 as c_int; 2];
        // SAFETY: pipe2 fills the two descriptors, owned below.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO));
        }
        // SAFETY: two descriptors pipe2 just made, each owned once.
        let (r, w) = unsafe { (std::fs::File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        std::thread::scope(|s| {
            let sending = s.spawn(move || {
                // SAFETY: two C strings and a descriptor open for the call's length (the
                // writing end is closed when it returns: the reader then meets the end).
                let e = unsafe { (self.send)(snap.as_ptr(), from.as_ptr(), w.as_raw_fd(), 0) };
                drop(w);
                e
            });
            // (the reading end closed when `read` is done: a send still writing then ends)
            let got = read(r);
            let e = sending.join().unwrap_or(libc::EIO);
            match (got, e) {
                (Ok(t), 0) => Ok(Ok(t)),
                // (a reading that failed first ends the send with EPIPE: the reading's error)
                (Err(e), 0 | libc::EPIPE) => Ok(Err(e)),
                // (a send that failed ends the stream early: its own error, not the reading's)
                (_, e) => Err(e),
            }
        })
    }
}

fn load() -> Option<Core> {
    // SAFETY: dlopen and dlsym with NUL-terminated names; each symbol is cast to the signature
    // libzfs_core.h and libnvpair.h give it. The libraries stay loaded for the process's life.
    unsafe {
        let open = |name: &CStr| {
            let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            (!h.is_null()).then_some(h)
        };
        let core = open(c"libzfs_core.so.3")?;
        let nv = open(c"libnvpair.so.3")?;
        let sym = |h: *mut c_void, name: &CStr| {
            let p = libc::dlsym(h, name.as_ptr());
            (!p.is_null()).then_some(p)
        };
        use std::mem::transmute;
        type P = *mut c_void;
        let init = transmute::<P, InitFn>(sym(core, c"libzfs_core_init")?);
        let c = Core {
            snapshot: transmute::<P, SnapshotFn>(sym(core, c"lzc_snapshot")?),
            send: transmute::<P, SendFn>(sym(core, c"lzc_send")?),
            exists: transmute::<P, ExistsFn>(sym(core, c"lzc_exists")?),
            nvlist_alloc: transmute::<P, AllocFn>(sym(nv, c"nvlist_alloc")?),
            nvlist_add_boolean: transmute::<P, AddBooleanFn>(sym(nv, c"nvlist_add_boolean")?),
            nvlist_free: transmute::<P, FreeFn>(sym(nv, c"nvlist_free")?),
        };
        (init() == 0).then_some(c)
    }
}
