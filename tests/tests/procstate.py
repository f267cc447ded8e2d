# The process-state suite's workload (tests/tests/procstate.rs), modelled on CRIU's zdtm: each
# case is a process of its own that sets up a state, then answers commands on a pipe:
#   mutate  changes the state (what an agent's processes do after a statepoint)
#   verify  checks that the state is the one it set up (consuming queued signals and data)
# The first process starts the cases named on its command line, then reads "SEQ VERB" from
# /tmp/cmd, hands VERB to every case and publishes "SEQ" and one line per case in /tmp/state.
import ctypes, fcntl, mmap, os, resource, select, signal, socket, struct, sys, threading, time

libc = ctypes.CDLL(None, use_errno=True)
RT = signal.SIGRTMIN


class SigInfo(ctypes.Structure):
    _fields_ = [("signo", ctypes.c_int), ("errno", ctypes.c_int), ("code", ctypes.c_int), ("pad", ctypes.c_int),
                ("pid", ctypes.c_int), ("uid", ctypes.c_uint), ("value", ctypes.c_uint64), ("rest", ctypes.c_char * 96)]


def sigset(*sigs):
    s = (ctypes.c_ubyte * 128)()
    libc.sigemptyset(s)
    for n in sigs:
        libc.sigaddset(s, int(n))
    return s


def take(sig):
    """Takes one queued signal without waiting: (code, pid, value), or None."""
    info = SigInfo()
    zero = (ctypes.c_long * 2)(0, 0)
    n = libc.sigtimedwait(sigset(sig), ctypes.byref(info), zero)
    return None if n < 0 else (info.code, info.pid, info.value)


def queue(sig, value):
    if libc.sigqueue(os.getpid(), int(sig), ctypes.c_void_p(value)) != 0:
        raise OSError(ctypes.get_errno(), "sigqueue")


def expect(what, got, want):
    if got != want:
        raise AssertionError("%s: %r, expected %r" % (what, got, want))


def within(what, got, lo, hi):
    if not lo < got <= hi:
        raise AssertionError("%s: %r, expected in (%r, %r]" % (what, got, lo, hi))


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1], 16)


def bit(sig):
    return 1 << (int(sig) - 1)


class Signals:
    """Queued signals: the process's (a standard one, two real-time ones with their values) and a
    thread's own (tgkill)."""
    def setup(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, RT + 2})
        self.go, self.answer = threading.Event(), []
        self.thread = threading.Thread(target=self.other, daemon=True)
        self.ready = threading.Event()
        self.thread.start()
        self.ready.wait()
        os.kill(os.getpid(), signal.SIGUSR1)
        queue(RT + 2, 7)
        queue(RT + 2, 8)
        signal.pthread_kill(self.thread.ident, signal.SIGUSR2)

    def other(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        self.ready.set()
        while True:
            self.go.wait()
            self.go.clear()
            try:
                if self.verb == "verify":
                    expect("the thread's pending signals", signal.sigpending(), {signal.SIGUSR1, RT + 2, signal.SIGUSR2})
                    expect("SIGUSR2's sender", take(signal.SIGUSR2)[1], os.getpid())
                else:
                    take(signal.SIGUSR2)
                self.answer.append(None)
            except Exception as e:
                self.answer.append(e)
            self.ready.set()

    def in_thread(self, verb):
        self.verb = verb
        self.ready.clear()
        self.go.set()
        self.ready.wait()
        e = self.answer.pop()
        if e:
            raise e

    def mutate(self):
        take(signal.SIGUSR1)
        queue(RT + 2, 99)
        self.in_thread("mutate")

    def verify(self):
        self.in_thread("verify")
        expect("pending", signal.sigpending(), {signal.SIGUSR1, RT + 2})
        code, pid, _ = take(signal.SIGUSR1)
        expect("SIGUSR1's sender and code", (code, pid), (0, os.getpid()))
        expect("the real-time queue", [take(RT + 2)[2], take(RT + 2)[2], take(RT + 2)], [7, 8, None])


class Dispositions:
    """Signal handlers, ignored signals and the signal mask."""
    def setup(self):
        signal.signal(signal.SIGTERM, lambda *a: None)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGQUIT})

    def mutate(self):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, lambda *a: None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGQUIT})
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def verify(self):
        expect("SIGTERM caught", status("SigCgt") & bit(signal.SIGTERM), bit(signal.SIGTERM))
        expect("SIGHUP ignored", status("SigIgn") & bit(signal.SIGHUP), bit(signal.SIGHUP))
        expect("blocked", status("SigBlk") & (bit(signal.SIGQUIT) | bit(signal.SIGINT)), bit(signal.SIGQUIT))


class StackT(ctypes.Structure):
    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]


class AltStack:
    """An alternate signal stack."""
    def setup(self):
        self.buf = ctypes.create_string_buffer(65536)
        self.set(StackT(ctypes.addressof(self.buf), 0, 65536))

    def set(self, st):
        if libc.sigaltstack(ctypes.byref(st), None) != 0:
            raise OSError(ctypes.get_errno(), "sigaltstack")

    def mutate(self):
        self.set(StackT(None, 2, 0))

    def verify(self):
        old = StackT()
        libc.sigaltstack(None, ctypes.byref(old))
        expect("the alternate stack", (old.sp, old.size, old.flags), (ctypes.addressof(self.buf), 65536, 0))


class ITimers:
    """Interval timers, real (with an interval) and virtual, with the time they had left."""
    def setup(self):
        signal.signal(signal.SIGALRM, lambda *a: None)
        signal.signal(signal.SIGVTALRM, lambda *a: None)
        signal.setitimer(signal.ITIMER_REAL, 1000, 500)
        signal.setitimer(signal.ITIMER_VIRTUAL, 2000)

    def mutate(self):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_VIRTUAL, 5, 1)

    def verify(self):
        left, every = signal.getitimer(signal.ITIMER_REAL)
        within("the real timer", left, 700, 1001)
        expect("its interval", every, 500.0)
        left, every = signal.getitimer(signal.ITIMER_VIRTUAL)
        within("the virtual timer", left, 1900, 2001)
        expect("its interval", every, 0.0)


class SigEvent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_uint64), ("signo", ctypes.c_int), ("notify", ctypes.c_int), ("pad", ctypes.c_char * 48)]


Spec = ctypes.c_long * 4


class PosixTimer:
    """A POSIX timer on the monotonic clock, armed, its signal blocked."""
    def setup(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {RT + 4})
        self.id = ctypes.c_void_p()
        ev = SigEvent(42, int(RT + 4), 0)
        if libc.timer_create(1, ctypes.byref(ev), ctypes.byref(self.id)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create")
        self.arm(250, 1000)

    def arm(self, every, left):
        if libc.timer_settime(self.id, 0, ctypes.byref(Spec(every, 0, left, 0)), None) != 0:
            raise OSError(ctypes.get_errno(), "timer_settime")

    def mutate(self):
        self.arm(0, 1)

    def verify(self):
        cur = Spec()
        libc.timer_gettime(self.id, ctypes.byref(cur))
        expect("its interval", (cur[0], cur[1]), (250, 0))
        within("the POSIX timer", cur[2], 699, 1001)
        expect("its signal, queued", take(RT + 4), None)


class Files:
    """A file's offset, an append-only file."""
    def setup(self):
        self.f = open("/tmp/offset", "w+b")
        self.f.write(os.urandom(1000))
        self.f.seek(123)
        self.a = open("/tmp/appended", "ab")
        self.a.write(b"one\n")
        self.a.flush()

    def mutate(self):
        self.f.seek(5)
        self.a.write(b"two\n")
        self.a.flush()

    def verify(self):
        expect("the offset", self.f.tell(), 123)
        expect("O_APPEND", fcntl.fcntl(self.a.fileno(), fcntl.F_GETFL) & os.O_APPEND, os.O_APPEND)
        expect("the appended file", open("/tmp/appended", "rb").read(), b"one\n")


class Unlinked:
    """A file held open after its name was removed."""
    def setup(self):
        self.u = open("/tmp/unlinked", "w+b")
        self.u.write(b"kept")
        self.u.flush()
        os.unlink("/tmp/unlinked")

    def mutate(self):
        os.pwrite(self.u.fileno(), b"lost", 0)

    def verify(self):
        expect("the unlinked file", os.pread(self.u.fileno(), 4, 0), b"kept")


class Threads:
    """Threads with values of their own (thread-local storage) and floating-point results."""
    def setup(self):
        self.local = threading.local()
        self.cmd = [threading.Event() for _ in range(3)]
        self.done = [threading.Event() for _ in range(3)]
        self.seen = [None] * 3
        for i in range(3):
            threading.Thread(target=self.run, args=(i,), daemon=True).start()
            self.done[i].wait()

    def run(self, i):
        self.local.v = "thread %d" % i
        x = 1.0 / (i + 3)
        self.done[i].set()
        while True:
            self.cmd[i].wait()
            self.cmd[i].clear()
            if self.verb == "mutate":
                self.local.v = "changed"
                x = 2.5
            self.seen[i] = (self.local.v, x)
            self.done[i].set()

    def each(self, verb):
        self.verb = verb
        for i in range(3):
            self.done[i].clear()
            self.cmd[i].set()
            self.done[i].wait()

    def mutate(self):
        self.each("mutate")

    def verify(self):
        self.each("verify")
        expect("the threads' values", self.seen, [("thread %d" % i, 1.0 / (i + 3)) for i in range(3)])


class Session:
    """A child that leads a session of its own, and its child in the same process group."""
    def setup(self):
        r, w = os.pipe()
        self.leader = os.fork()
        if self.leader == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(w, b"x")
                signal.pause()
            while True:
                signal.pause()
        os.read(r, 1)
        os.close(r)
        os.close(w)

    def mutate(self):
        pass

    def verify(self):
        expect("the session", (os.getsid(self.leader), os.getpgid(self.leader)), (self.leader, self.leader))


class SocketData:
    """A socket pair with data queued (a rollback in place does not restore sockets)."""
    def setup(self):
        self.a, self.b = socket.socketpair()
        self.a.send(b"queued")

    def mutate(self):
        self.a.send(b"other")

    def verify(self):
        self.b.setblocking(False)
        expect("the queued data", self.b.recv(100), b"queued")


class Attrs:
    """A process's working directory, umask, a resource limit, its nice value and oom_score_adj
    (each changed after the statepoint in the direction a process may change it unprivileged)."""
    def setup(self):
        os.makedirs("/srv/work", exist_ok=True)
        os.chdir("/srv/work")
        os.umask(0o027)
        self.hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, self.hard))
        os.nice(5)
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.adj = int(open("/proc/self/oom_score_adj").read()) + 100
        open("/proc/self/oom_score_adj", "w").write(str(self.adj))

    def mutate(self):
        os.chdir("/tmp")
        os.umask(0o077)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, self.hard))
        os.nice(5)
        open("/proc/self/oom_score_adj", "w").write(str(self.adj + 100))

    def verify(self):
        expect("the working directory", os.getcwd(), "/srv/work")
        umask = os.umask(0o022)
        os.umask(umask)
        expect("the umask", oct(umask), oct(0o027))
        expect("the open-files limit", resource.getrlimit(resource.RLIMIT_NOFILE), (512, self.hard))
        expect("the nice value", os.getpriority(os.PRIO_PROCESS, 0), self.nice)
        expect("oom_score_adj", int(open("/proc/self/oom_score_adj").read()), self.adj)


class PipeData:
    """A pipe with data in it."""
    def setup(self):
        self.r, self.w = os.pipe()
        os.write(self.w, b"in the pipe")

    def mutate(self):
        os.write(self.w, b" and more")
        os.read(self.r, 3)

    def verify(self):
        os.set_blocking(self.r, False)
        expect("the pipe's data", os.read(self.r, 100), b"in the pipe")


class EventFd:
    """An eventfd with a count."""
    def setup(self):
        self.fd = os.eventfd(5, os.EFD_NONBLOCK)

    def mutate(self):
        os.eventfd_write(self.fd, 9)

    def verify(self):
        expect("the count", os.eventfd_read(self.fd), 5)


class TimerFd:
    """A timerfd, armed."""
    def setup(self):
        self.fd = libc.timerfd_create(1, 0)
        libc.timerfd_settime(self.fd, 0, ctypes.byref(Spec(0, 0, 1000, 0)), None)

    def mutate(self):
        libc.timerfd_settime(self.fd, 0, ctypes.byref(Spec(0, 0, 0, 0)), None)

    def verify(self):
        cur = Spec()
        libc.timerfd_gettime(self.fd, ctypes.byref(cur))
        within("the timerfd", cur[2], 699, 1001)


class SignalFd:
    """A signalfd reading SIGUSR1 (blocked)."""
    def setup(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
        self.fd = libc.signalfd(-1, sigset(signal.SIGUSR1), os.O_NONBLOCK)

    def mutate(self):
        libc.signalfd(self.fd, sigset(signal.SIGUSR2), 0)

    def verify(self):
        mask = [l for l in open("/proc/self/fdinfo/%d" % self.fd) if l.startswith("sigmask:")][0].split()[1]
        expect("its mask", int(mask, 16), bit(signal.SIGUSR1))


class Epoll:
    """An epoll watching an eventfd and a socket: the interest list, and nothing ready."""
    def setup(self):
        self.ev = os.eventfd(0, os.EFD_NONBLOCK)
        self.a, self.b = socket.socketpair()
        self.ep = select.epoll()
        self.ep.register(self.ev, select.EPOLLIN)
        self.ep.register(self.b.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    def mutate(self):
        os.eventfd_write(self.ev, 3)
        self.a.send(b"x")
        self.b.recv(1)

    def verify(self):
        lines = [l.split() for l in open("/proc/self/fdinfo/%d" % self.ep.fileno()) if l.startswith("tfd:")]
        always = select.EPOLLERR | select.EPOLLHUP
        expect("the interest list", sorted((int(l[1]), int(l[3], 16)) for l in lines),
               sorted([(self.ev, select.EPOLLIN | always), (self.b.fileno(), select.EPOLLIN | select.EPOLLRDHUP | always)]))
        expect("ready", self.ep.poll(0), [])


class Sockets:
    """A listening TCP socket, a bound UDP socket, a listening Unix socket and a connected pair,
    nothing queued: what a development server holds."""
    def setup(self):
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind("/tmp/server.sock")
        self.unix.listen()
        self.a, self.b = socket.socketpair()
        self.ports = (self.tcp.getsockname(), self.udp.getsockname())

    def mutate(self):
        c = socket.create_connection(self.tcp.getsockname())
        s, _ = self.tcp.accept()
        s.close()
        c.close()
        self.a.send(b"x")
        self.b.recv(1)

    def verify(self):
        expect("the addresses", (self.tcp.getsockname(), self.udp.getsockname()), self.ports)
        c = socket.create_connection(self.tcp.getsockname())
        s, _ = self.tcp.accept()
        c.send(b"tcp")
        expect("through the listener", s.recv(3), b"tcp")
        s.close()
        c.close()
        u = socket.socket(socket.AF_UNIX)
        u.connect("/tmp/server.sock")
        s, _ = self.unix.accept()
        s.close()
        u.close()
        self.a.send(b"pair")
        expect("through the pair", self.b.recv(4), b"pair")


class SharedMemory:
    """Anonymous shared memory."""
    def setup(self):
        self.m = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
        self.m[:6] = b"shared"

    def mutate(self):
        self.m[:6] = b"change"

    def verify(self):
        expect("the shared page", self.m[:6], b"shared")


class Inotify:
    """An inotify watch on a directory."""
    def setup(self):
        self.fd = libc.inotify_init1(os.O_NONBLOCK)
        os.mkdir("/tmp/watched")
        self.wd = libc.inotify_add_watch(self.fd, b"/tmp/watched", 0x100)  # IN_CREATE

    def mutate(self):
        libc.inotify_rm_watch(self.fd, self.wd)

    def verify(self):
        open("/tmp/watched/%d" % time.time_ns(), "w").close()
        wd, mask = struct.unpack_from("iI", os.read(self.fd, 4096))
        expect("the first event: the file created, through the watch", (wd, mask & 0xffff), (self.wd, 0x100))


class MemFd:
    """A memfd's content."""
    def setup(self):
        self.fd = os.memfd_create("planarian-test")
        os.write(self.fd, b"memfd")

    def mutate(self):
        os.pwrite(self.fd, b"wrong", 0)

    def verify(self):
        expect("the memfd", os.pread(self.fd, 5, 0), b"memfd")


class SysvShm:
    """A System V shared memory segment, attached."""
    def setup(self):
        libc.shmat.restype = ctypes.c_void_p
        self.id = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        self.at = libc.shmat(self.id, None, 0)
        ctypes.memmove(self.at, b"sysv", 4)

    def mutate(self):
        ctypes.memmove(self.at, b"gone", 4)

    def verify(self):
        expect("the segment", ctypes.string_at(self.at, 4), b"sysv")


class Zombie:
    """A child that ended and was not waited for."""
    def setup(self):
        self.child = os.fork()
        if self.child == 0:
            os._exit(3)
        # (waits until it has ended, and leaves it unreaped)
        os.waitid(os.P_PID, self.child, os.WEXITED | os.WNOWAIT)

    def mutate(self):
        pass

    def verify(self):
        expect("the zombie's state", open("/proc/%d/stat" % self.child).read().split(") ")[1][0], "Z")
        expect("its exit status", os.waitstatus_to_exitcode(os.waitpid(self.child, 0)[1]), 3)


CASES = {"signals": Signals, "dispositions": Dispositions, "altstack": AltStack, "itimers": ITimers,
         "posix-timer": PosixTimer, "files": Files, "threads": Threads, "session": Session,
         "attrs": Attrs, "pipe-data": PipeData, "eventfd": EventFd, "timerfd": TimerFd, "signalfd": SignalFd, "epoll": Epoll, "sockets": Sockets,
         "socket-data": SocketData, "shared-memory": SharedMemory, "unlinked": Unlinked, "zombie": Zombie,
         "inotify": Inotify, "memfd": MemFd, "sysv-shm": SysvShm}


def case(name, cmd, res):
    c = CASES[name]()
    try:
        c.setup()
        os.write(res, b"ready\n")
    except Exception as e:
        os.write(res, ("setup failed: %r\n" % e).encode())
    while True:
        verb = os.read(cmd, 100).decode().strip()
        try:
            getattr(c, verb)()
            os.write(res, b"ok\n")
        except Exception as e:
            os.write(res, ("FAIL %s\n" % e).replace("\n", " ").strip().encode() + b"\n")


def publish(text):
    with open("/tmp/.state", "w") as f:
        f.write(text)
    os.rename("/tmp/.state", "/tmp/state")


pipes = {}
for name in sys.argv[1:]:
    cr, cw = os.pipe()
    rr, rw = os.pipe()
    if os.fork() == 0:
        case(name, cr, rw)
    pipes[name] = (cw, rr)


def answers():
    return "".join("%s %s\n" % (n, os.read(rr, 1000).decode().strip()) for n, (cw, rr) in pipes.items())


publish("0\n" + answers())
while True:
    try:
        seq, verb = open("/tmp/cmd").read().split()
    except (FileNotFoundError, ValueError):
        time.sleep(0.2)
        continue
    os.remove("/tmp/cmd")
    for cw, rr in pipes.values():
        os.write(cw, verb.encode())
    publish(seq + "\n" + answers())
