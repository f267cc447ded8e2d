//! The runc/crun command line as Podman and conmon send it: global flags, then a verb.
//!
//! Only what planarian itself needs is read here (where to log, the verb); the argument vector is
//! kept untouched so that a pass-through verb reaches crun byte for byte, including flags this
//! parser has never heard of.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

pub use engine::log::LogFormat;

/// The flags of crun's command line that take a separate value (`--root /run/x`; `--flag=value`
/// works for every flag), before the verb and for each verb planarian reads operands of: the one
/// table every scan of crun's argument vector uses.
const VALUE_FLAGS: &[(Option<&str>, &[&str])] = &[
    (None, &["--root", "--log", "--log-format", "--log-level", "--cgroup-manager", "--criu"]),
    (Some("create"), &["--bundle", "-b", "--pid-file", "--console-socket", "--preserve-fds"]),
    (
        Some("exec"),
        &[
            "--apparmor",
            "--console-socket",
            "--cwd",
            "--cap",
            "--env",
            "-e",
            "--process",
            "-p",
            "--process-label",
            "--pid-file",
            "--preserve-fds",
            "--user",
            "-u",
            "--cgroup",
        ],
    ),
    (Some("delete"), &[]),
];

fn value_flags(verb: Option<&str>) -> &'static [&'static str] {
    VALUE_FLAGS.iter().find(|(v, _)| *v == verb).map_or(&[], |(_, f)| f)
}

/// A verb's arguments split by [`VALUE_FLAGS`]: its flags with their values, and its operands.
pub struct VerbArgs<'a> {
    pub flags: Vec<(&'a str, Option<&'a OsStr>)>,
    pub operands: Vec<&'a OsStr>,
}

impl<'a> VerbArgs<'a> {
    pub fn scan(verb: &str, args: &'a [OsString]) -> VerbArgs<'a> {
        let takes = value_flags(Some(verb));
        let (mut flags, mut operands) = (Vec::new(), Vec::new());
        let mut i = 0;
        while i < args.len() {
            let a = args[i].as_os_str();
            let bytes = a.as_bytes();
            if bytes == b"--" {
                operands.extend(args[i + 1..].iter().map(OsString::as_os_str));
                break;
            }
            match a.to_str().filter(|s| s.starts_with('-') && s.len() > 1) {
                Some(flag) => match flag.split_once('=') {
                    Some((name, _)) => flags.push((name, Some(OsStr::from_bytes(&bytes[name.len() + 1..])))),
                    None if takes.contains(&flag) => {
                        i += 1;
                        flags.push((flag, args.get(i).map(OsString::as_os_str)));
                    }
                    None => flags.push((flag, None)),
                },
                None => operands.push(a),
            }
            i += 1;
        }
        VerbArgs { flags, operands }
    }

    /// The value of the last of these flags given.
    pub fn value(&self, names: &[&str]) -> Option<&'a OsStr> {
        self.flags.iter().rev().find(|(n, _)| names.contains(n)).and_then(|(_, v)| *v)
    }
}

/// `create`'s bundle (default: the working directory) and container ID (its last operand).
pub fn create_args(args: &[OsString]) -> (PathBuf, Option<String>) {
    let v = VerbArgs::scan("create", args);
    let bundle = v.value(&["--bundle", "-b"]).map_or_else(|| PathBuf::from("."), PathBuf::from);
    (bundle, v.operands.last().and_then(|o| o.to_str()).map(String::from))
}

/// The container ID of an `exec` invocation: its first operand.
pub fn exec_container_id(args: &[OsString]) -> Option<&str> {
    VerbArgs::scan("exec", args).operands.first()?.to_str()
}

/// The process file of an `exec` invocation (`--process FILE`, `-p FILE`), if one was given.
pub fn exec_process_file(args: &[OsString]) -> Option<PathBuf> {
    VerbArgs::scan("exec", args).value(&["--process", "-p"]).map(PathBuf::from)
}

/// The `--pid-file` of a detached `exec` (conmon's: `--detach`, `-d`), if it is one.
pub fn exec_detached_pid_file(args: &[OsString]) -> Option<PathBuf> {
    let v = VerbArgs::scan("exec", args);
    v.flags.iter().any(|(n, _)| *n == "--detach" || *n == "-d").then(|| v.value(&["--pid-file"]).map(PathBuf::from))?
}

/// The container ID of a `delete` invocation: its last operand.
pub fn delete_container_id(args: &[OsString]) -> Option<&str> {
    last_operand("delete", args)
}

/// The last operand of verb `verb`'s arguments: the container ID of `delete`, `pause`, `resume`.
pub fn last_operand<'a>(verb: &str, args: &'a [OsString]) -> Option<&'a str> {
    VerbArgs::scan(verb, args).operands.last()?.to_str()
}

/// One invocation of the runtime.
#[derive(Debug)]
pub struct Invocation {
    /// `argv[1..]`, exactly as received.
    pub args: Vec<OsString>,
    /// Index in `args` of the verb, if there is one.
    pub verb_index: Option<usize>,
    pub log: Option<PathBuf>,
    pub log_format: LogFormat,
    pub root: Option<PathBuf>,
    pub debug: bool,
}

impl Invocation {
    pub fn parse(args: Vec<OsString>) -> Invocation {
        let mut inv =
            Invocation { args, verb_index: None, log: None, log_format: LogFormat::Text, root: None, debug: false };
        let mut i = 0;
        while i < inv.args.len() {
            let arg = inv.args[i].as_bytes();
            if !arg.starts_with(b"-") || arg == b"-" {
                inv.verb_index = Some(i);
                break;
            }
            if arg == b"--" {
                if i + 1 < inv.args.len() {
                    inv.verb_index = Some(i + 1);
                }
                break;
            }
            let (name, inline) = match arg.iter().position(|&b| b == b'=') {
                Some(eq) => (&arg[..eq], Some(OsStr::from_bytes(&arg[eq + 1..]).to_owned())),
                None => (arg, None),
            };
            let takes_value = value_flags(None).iter().any(|f| f.as_bytes() == name);
            let value = if takes_value && inline.is_none() {
                i += 1;
                inv.args.get(i).cloned()
            } else {
                inline
            };
            match name {
                b"--log" => inv.log = value.map(PathBuf::from),
                b"--log-format" => {
                    inv.log_format =
                        if value.as_deref() == Some(OsStr::new("json")) { LogFormat::Json } else { LogFormat::Text }
                }
                b"--root" => inv.root = value.map(PathBuf::from),
                b"--debug" => inv.debug = true,
                b"--log-level" => {
                    inv.debug |= matches!(value.as_deref().and_then(OsStr::to_str), Some("debug" | "info"));
                }
                _ => {}
            }
            i += 1;
        }
        inv
    }

    /// The verb as a string (`create`, `checkpoint`, …), if any and if it is valid UTF-8.
    pub fn verb(&self) -> Option<&str> {
        self.verb_index.and_then(|i| self.args[i].to_str())
    }

    /// The global flags before the verb (or all flags when there is no verb).
    pub fn global_args(&self) -> &[OsString] {
        &self.args[..self.verb_index.unwrap_or(self.args.len())]
    }

    /// The arguments after the verb.
    pub fn verb_args(&self) -> &[OsString] {
        match self.verb_index {
            Some(i) => &self.args[i + 1..],
            None => &[],
        }
    }

    /// Where this invocation's messages go ([`engine::log::Sink`]).
    pub fn sink(&self) -> engine::log::Sink {
        engine::log::Sink { path: self.log.clone(), format: self.log_format, debug: self.debug }
    }

    /// The global flags the engine acts on.
    pub fn globals(&self) -> engine::runtime::Globals {
        engine::runtime::Globals { root: self.root.clone(), systemd_cgroup: self.has_global_flag("--systemd-cgroup") }
    }

    /// The engine this invocation works with: the configuration read, these global flags.
    pub fn engine(&self) -> Result<engine::Engine, engine::config::ConfigError> {
        engine::Engine::load(self.globals())
    }

    /// Whether a global flag (before the verb) was given, e.g. `--version`.
    pub fn has_global_flag(&self, flag: &str) -> bool {
        self.global_args().iter().any(|a| a == flag)
    }
}

/// Parses the arguments of one of planarian's own verbs with clap. On `--help` or a usage error,
/// clap's text is printed and the exit code returned as `Err`.
pub fn parse_verb<T: clap::Parser>(verb: &str, args: &[OsString]) -> Result<T, i32> {
    T::try_parse_from(std::iter::once(OsString::from(verb)).chain(args.iter().cloned())).map_err(|e| {
        let _ = e.print();
        e.exit_code()
    })
}

/// The CRIU-related flags `checkpoint` and `restore` share (runc/crun spelling).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CriuFlags {
    #[arg(long)]
    pub tcp_established: bool,
    #[arg(long)]
    pub file_locks: bool,
    #[arg(long)]
    pub ext_unix_sk: bool,
    #[arg(long)]
    pub shell_job: bool,
    #[arg(long)]
    pub manage_cgroups_mode: Option<String>,
}

/// `checkpoint`, as Podman calls it.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian checkpoint",
    about = "Create a statepoint of a running container",
    args_override_self = true
)]
pub struct CheckpointArgs {
    /// Where Podman expects the checkpoint images.
    #[arg(long)]
    pub image_path: Option<PathBuf>,
    /// Where Podman expects logs and stats.
    #[arg(long)]
    pub work_path: Option<PathBuf>,
    #[arg(long)]
    pub leave_running: bool,
    #[command(flatten)]
    pub criu: CriuFlags,
    /// Podman's --pre-checkpoint: a memory pre-dump into --image-path, no statepoint.
    #[arg(long)]
    pub pre_dump: bool,
    /// Podman's --with-previous (relative to --image-path).
    #[arg(long)]
    pub parent_path: Option<PathBuf>,
    /// A name for the new statepoint (planarian's own flag).
    #[arg(long)]
    pub name: Option<String>,
    /// A description of the state (planarian's own flag).
    #[arg(long)]
    pub description: Option<String>,
    pub container_id: String,
}

/// The arguments with the long flags containerd's runc shim writes with one dash (`-no-subreaper`,
/// which runc's parser takes as the long flag) written with two.
pub fn single_dash_long(args: &[OsString]) -> Vec<OsString> {
    args.iter().map(|a| if a == "-no-subreaper" { "--no-subreaper".into() } else { a.clone() }).collect()
}

/// `restore`, as conmon and containerd's runc shim call it.
#[derive(clap::Parser, Debug)]
#[command(name = "planarian restore", about = "Restore a container from a statepoint", args_override_self = true)]
pub struct RestoreArgs {
    #[arg(long, short = 'b')]
    pub bundle: Option<PathBuf>,
    #[arg(long)]
    pub pid_file: Option<PathBuf>,
    #[arg(long, short = 'd')]
    pub detach: bool,
    #[arg(long)]
    pub image_path: Option<PathBuf>,
    #[arg(long)]
    pub work_path: Option<PathBuf>,
    #[arg(long)]
    pub no_pivot: bool,
    #[arg(long)]
    pub no_new_keyring: bool,
    /// runc's: the runtime does not stay as the restored tree's subreaper. Neither crun nor
    /// planarian ever does (the restore returns once the tree runs): accepted, nothing to do.
    #[arg(long)]
    pub no_subreaper: bool,
    #[arg(long)]
    pub preserve_fds: Option<u32>,
    #[command(flatten)]
    pub criu: CriuFlags,
    #[arg(long)]
    pub lsm_profile: Option<String>,
    #[arg(long)]
    pub lsm_mount_context: Option<String>,
    #[arg(long)]
    pub console_socket: Option<PathBuf>,
    pub container_id: String,
}

/// `planarian snapshot`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian snapshot",
    about = "Take a statepoint of a running container (it keeps running); prints its id"
)]
pub struct SnapshotArgs {
    /// The container (name, ID or ID prefix).
    pub container: String,
    /// A name for the statepoint (unique in the container).
    #[arg(long)]
    pub name: Option<String>,
    /// What the state is, for whoever rolls back to it.
    #[arg(long)]
    pub description: Option<String>,
    /// Dump established TCP connections too (CRIU's --tcp-established).
    #[arg(long)]
    pub tcp_established: bool,
    /// Dump file locks too (CRIU's --file-locks).
    #[arg(long)]
    pub file_locks: bool,
    /// Structured state to record with it (JSON, from FILE or - for stdin): task progress, a
    /// score, whatever the harness tracks.
    #[arg(long, value_name = "FILE|-")]
    pub state: Option<PathBuf>,
    /// Answer at once with the statepoint's id while it is taken in the background; tool
    /// calls wait for it (`planarian statepoint wait` says how it ended).
    #[arg(long = "async")]
    pub r#async: bool,
}

/// Who is calling: one of the paper's three stakeholders (recorded with outcomes).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default)]
pub enum By {
    #[default]
    User,
    Harness,
    Agent,
}

impl From<By> for engine::store::Actor {
    fn from(b: By) -> Self {
        match b {
            By::User => engine::store::Actor::User,
            By::Harness => engine::store::Actor::Harness,
            By::Agent => engine::store::Actor::Agent,
        }
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, Default)]
pub enum OutcomeStatus {
    Success,
    Failure,
    Abandoned,
    #[default]
    Info,
}

impl From<OutcomeStatus> for engine::store::OutcomeStatus {
    fn from(s: OutcomeStatus) -> Self {
        match s {
            OutcomeStatus::Success => engine::store::OutcomeStatus::Success,
            OutcomeStatus::Failure => engine::store::OutcomeStatus::Failure,
            OutcomeStatus::Abandoned => engine::store::OutcomeStatus::Abandoned,
            OutcomeStatus::Info => engine::store::OutcomeStatus::Info,
        }
    }
}

/// `planarian rollback`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian rollback",
    about = "Return a container's processes, files and remote state to a statepoint"
)]
pub struct RollbackArgs {
    /// The container.
    pub container: String,
    /// Its statepoint (id or name).
    pub statepoint: String,
    /// Why (recorded with the `abandoned` outcome the statepoint gets, and in the restore context).
    #[arg(long)]
    pub reason: Option<String>,
    /// Who asks for it.
    #[arg(long, value_enum, default_value = "user")]
    pub by: By,
    /// Print the restore context as JSON (what a harness appends to the conversation).
    #[arg(long)]
    pub json: bool,
}

/// `planarian fork`.
#[derive(clap::Parser, Debug)]
#[command(name = "planarian fork", about = "Start a new container from a statepoint of a container")]
pub struct ForkArgs {
    /// The container to fork.
    pub container: String,
    /// Its statepoint (id or name).
    pub statepoint: String,
    /// The new container's name (once per fork with --count). Without it, a spare of the
    /// statepoint keeps its own name (a thaw, no rename), or the fork is made as CTR-fork-SP-K.
    #[arg(long)]
    pub name: Vec<String>,
    /// How many forks, made side by side (as many at once as the machine has CPUs).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub count: Option<u16>,
    /// Who asks for it.
    #[arg(long, value_enum, default_value = "user")]
    pub by: By,
    /// Print the new sandbox's restore context as JSON (with --count: an array, one per fork,
    /// or the error that fork ended with).
    #[arg(long)]
    pub json: bool,
}

/// `planarian spare`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian spare",
    about = "Keep forks of a statepoint ready, restored and frozen, so that `planarian fork` of it is a thaw (and a rename)"
)]
pub struct SpareArgs {
    /// The container.
    pub container: String,
    /// Its statepoint (id or name).
    pub statepoint: String,
    /// How many to keep (0 removes them).
    #[arg(long, default_value_t = 1)]
    pub count: usize,
}

/// `planarian mcp`.
#[derive(clap::Parser, Debug)]
#[command(name = "planarian mcp", about = "Statepoint tools for the agent in container CTR: an MCP server over stdio")]
pub struct McpArgs {
    pub container: String,
    /// Optional tools: fork (statepoint_fork), run (a shell command in the sandbox).
    #[arg(long, value_delimiter = ',')]
    pub allow: Vec<String>,
}

/// `planarian ledger`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian ledger",
    about = "A container's statepoints as a tree, with what is known of each (for people and for an LLM's context)"
)]
pub struct LedgerArgs {
    pub container: String,
    /// As JSON, for harnesses.
    #[arg(long)]
    pub json: bool,
    /// At most this many characters of text (the head and the statepoints with evidence stay).
    #[arg(long)]
    pub max_chars: Option<usize>,
}

/// `planarian statepoint`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian statepoint",
    about = "The statepoints of a container: list, show, annotate, remove, export, import"
)]
pub struct StatepointArgs {
    #[command(subcommand)]
    pub command: StatepointCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum StatepointCommand {
    /// The committed statepoints, oldest first (* marks the one the container continues from).
    #[command(visible_alias = "ls")]
    List {
        container: String,
        /// As JSON (the manifests).
        #[arg(long)]
        json: bool,
    },
    /// One statepoint's manifest, as JSON.
    #[command(visible_alias = "inspect")]
    Show { container: String, statepoint: String },
    /// Name, describe, or add an outcome to a statepoint (its captured state never changes).
    Set {
        container: String,
        statepoint: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        description: Option<String>,
        /// What happened after this statepoint (may be given more than once).
        #[arg(long)]
        outcome: Vec<String>,
        /// The outcomes' status.
        #[arg(long, value_enum, default_value = "info")]
        status: OutcomeStatus,
        /// Who reports them.
        #[arg(long, value_enum, default_value = "user")]
        by: By,
        /// A score for them (tree search backs rewards up); may be negative.
        #[arg(long, allow_negative_numbers = true)]
        reward: Option<f64>,
    },
    /// Wait for an asynchronous snapshot to end; fails with its error if it was not committed.
    Wait { container: String, statepoint: String },
    /// The restore context of the last rollback or fork into this container.
    Context {
        container: String,
        #[arg(long)]
        json: bool,
    },
    /// Write a statepoint into one file that restores on another machine: its chain of memory
    /// images, its files (a ZFS stream, or a copy), its manifest, how to create the container.
    Export {
        container: String,
        statepoint: String,
        file: PathBuf,
        /// Files on ZFS as an incremental stream from this older statepoint (one the receiving
        /// machine imported before).
        #[arg(long)]
        since: Option<String>,
    },
    /// Create a container from a statepoint file and run it from that statepoint.
    Import {
        file: PathBuf,
        /// The new container's name (default: the exported container's).
        #[arg(long)]
        name: Option<String>,
        /// For files on ZFS: the dataset they go under on this machine (default: the exported
        /// container's setting, else this host's [zfs] parent_dataset).
        #[arg(long)]
        parent_dataset: Option<String>,
    },
    /// Remove statepoints (all are checked first: a bad one removes nothing).
    Rm {
        container: String,
        #[arg(required = true)]
        statepoints: Vec<String>,
    },
}

/// `planarian fsck`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian fsck",
    about = "Check the statepoint store: manifests, chains of images, files, ZFS snapshots, what a stopped planarian left"
)]
pub struct FsckArgs {
    /// The containers to check (names or IDs); all the store holds when none is given.
    pub containers: Vec<String>,
    /// Also put right what loses nothing committed: half-made statepoints, a sandbox left
    /// frozen, an interrupted compensation, a head naming no statepoint, unreachable images.
    #[arg(long)]
    pub repair: bool,
    /// Print the reports as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `planarian gc`.
#[derive(clap::Parser, Debug)]
#[command(name = "planarian gc", about = "Remove the ZFS datasets of containers Podman has removed")]
pub struct GcArgs {
    /// Only this container, once its bundle is gone (what `delete` starts in the background).
    #[arg(long)]
    pub wait: Option<String>,
}

/// `planarian zfs-base`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian zfs-base",
    about = "Copy an image into ZFS once, before its first container: the per-image base its containers' datasets are cloned from",
    long_about = "Copy an image into ZFS once, before its first container: the per-image base its containers' \
datasets are cloned from. The first `podman run` of an image does this itself when the base is missing, \
but inside Podman's fixed time limit for creating a container: on a slow machine or for a large image, \
run this first."
)]
pub struct ZfsBaseArgs {
    /// The image (any name or ID Podman knows).
    pub image: String,
    /// The parent dataset the containers get their datasets under (default: zfs.parent_dataset of
    /// the configuration).
    #[arg(long)]
    pub parent_dataset: Option<String>,
}

/// `planarian config`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "planarian config",
    about = "The effective configuration, optionally with a container's io.planarian.* annotations applied"
)]
pub struct ConfigArgs {
    /// A container ID crun knows.
    pub container: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv(args: &[&str]) -> Invocation {
        Invocation::parse(args.iter().map(OsString::from).collect())
    }

    #[test]
    fn restore_takes_containerds_arguments() {
        let argv = [
            "--image-path",
            "/r/ctrd-restore/checkpoint",
            "--work-path",
            "/s/k8s.io/abc/work",
            "--detach",
            "--pid-file",
            "/s/k8s.io/abc/init.pid",
            "-no-subreaper",
            "--bundle",
            "/s/k8s.io/abc",
            "abc",
        ];
        let args: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let a: RestoreArgs = parse_verb("restore", &single_dash_long(&args)).expect("parses");
        assert!(a.detach && a.no_subreaper);
        assert_eq!(a.container_id, "abc");
        assert_eq!(a.image_path.as_deref(), Some(std::path::Path::new("/r/ctrd-restore/checkpoint")));
    }
    #[test]
    fn conmon_create_line_is_read_and_kept() {
        let line = [
            "--systemd-cgroup",
            "--log-format=json",
            "--log",
            "/run/x/oci-log",
            "--root",
            "/run/crun",
            "create",
            "--bundle",
            "/b",
            "--pid-file",
            "/p",
            "ctr",
        ];
        let i = inv(&line);
        assert_eq!(i.verb(), Some("create"));
        assert_eq!(i.log_format, LogFormat::Json);
        assert_eq!(i.log.as_deref(), Some(std::path::Path::new("/run/x/oci-log")));
        assert_eq!(i.root.as_deref(), Some(std::path::Path::new("/run/crun")));
        assert_eq!(i.verb_args().len(), 5);
        // Nothing was dropped or reordered.
        assert_eq!(i.args, line.iter().map(OsString::from).collect::<Vec<_>>());
    }

    #[test]
    fn unknown_flags_are_passed_over() {
        let i = inv(&["--some-new-flag", "--other=1", "kill", "ctr", "15"]);
        assert_eq!(i.verb(), Some("kill"));
        assert_eq!(i.verb_args(), &[OsString::from("ctr"), OsString::from("15")]);
    }

    #[test]
    fn value_flag_value_is_not_the_verb() {
        let i = inv(&["--log-format", "json", "--log-level", "debug", "state", "c"]);
        assert_eq!(i.verb(), Some("state"));
        assert_eq!(i.log_format, LogFormat::Json);
    }

    #[test]
    fn version_without_verb() {
        let i = inv(&["--version"]);
        assert_eq!(i.verb(), None);
        assert!(i.has_global_flag("--version"));
    }

    #[test]
    fn exec_container_id_as_conmon_sends_it() {
        let a: Vec<OsString> = [
            "--detach",
            "--process",
            "/tmp/p.json",
            "--pid-file",
            "/x/pid",
            "--console-socket=/s",
            "-e",
            "A=1",
            "abc123",
            "sh",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        assert_eq!(exec_container_id(&a), Some("abc123"));
        assert_eq!(exec_container_id(&[OsString::from("-d")]), None);
        assert_eq!(exec_detached_pid_file(&a), Some(PathBuf::from("/x/pid")));
        assert_eq!(exec_detached_pid_file(&a[1..]), None, "not detached: crun itself waits");
    }

    #[test]
    fn create_and_delete_arguments_as_podman_sends_them() {
        let a: Vec<OsString> =
            ["--bundle", "/b/userdata", "--pid-file", "/r/pidfile", "--console-socket", "/tmp/s", "abc123"]
                .iter()
                .map(OsString::from)
                .collect();
        assert_eq!(create_args(&a), (PathBuf::from("/b/userdata"), Some("abc123".into())));
        let a: Vec<OsString> = ["--bundle=/x", "--no-pivot", "id2"].iter().map(OsString::from).collect();
        assert_eq!(create_args(&a), (PathBuf::from("/x"), Some("id2".into())));
        let a: Vec<OsString> = ["--force", "id3"].iter().map(OsString::from).collect();
        assert_eq!(delete_container_id(&a), Some("id3"));
        // (Podman's pause and resume: the ID alone; containerd's shim the same)
        assert_eq!(last_operand("pause", &os(&["id4"])), Some("id4"));
        assert_eq!(last_operand("resume", &os(&["id5"])), Some("id5"));
    }

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn accepts_exactly_what_podman_sends_to_checkpoint() {
        let a: CheckpointArgs = parse_verb(
            "checkpoint",
            &os(&[
                "--image-path",
                "/u/checkpoint",
                "--work-path",
                "/u",
                "--leave-running",
                "--tcp-established",
                "--file-locks",
                "--leave-running",
                "abc",
            ]),
        )
        .unwrap();
        assert!(a.leave_running && a.criu.tcp_established && a.criu.file_locks);
        assert_eq!(a.image_path.as_deref(), Some(std::path::Path::new("/u/checkpoint")));
        assert_eq!(a.container_id, "abc");
        let pre: CheckpointArgs = parse_verb(
            "checkpoint",
            &os(&["--image-path", "/u/pre-checkpoint", "--work-path", "/u", "--pre-dump", "abc"]),
        )
        .unwrap();
        assert!(pre.pre_dump);
        let prev: CheckpointArgs = parse_verb(
            "checkpoint",
            &os(&["--image-path", "/u/checkpoint", "--work-path", "/u", "--parent-path", "../pre-checkpoint", "abc"]),
        )
        .unwrap();
        assert_eq!(prev.parent_path.as_deref(), Some(std::path::Path::new("../pre-checkpoint")));
    }

    #[test]
    fn accepts_exactly_what_conmon_sends_to_restore() {
        let a: RestoreArgs = parse_verb(
            "restore",
            &os(&[
                "--bundle",
                "/u",
                "--pid-file",
                "/r/pidfile",
                "--no-new-keyring",
                "--detach",
                "--image-path",
                "/u/checkpoint",
                "--work-path",
                "/u",
                "--tcp-established",
                "--lsm-mount-context=system_u:object_r:x",
                "--console-socket",
                "/tmp/conmon-term.X",
                "abc",
            ]),
        )
        .unwrap();
        assert!(a.detach && a.criu.tcp_established);
        assert_eq!(a.console_socket.as_deref(), Some(std::path::Path::new("/tmp/conmon-term.X")));
        assert_eq!(a.container_id, "abc");
    }

    #[test]
    fn help_exits_zero_for_podmans_probe() {
        assert_eq!(parse_verb::<CheckpointArgs>("checkpoint", &os(&["--help"])).unwrap_err(), 0);
        assert_ne!(parse_verb::<CheckpointArgs>("checkpoint", &os(&["--bogus", "x"])).unwrap_err(), 0);
    }

    #[test]
    fn own_verbs_take_their_options_anywhere() {
        let a: StatepointArgs = parse_verb(
            "statepoint",
            &os(&["set", "c", "--name=x", "sp1", "--outcome", "failed: tests", "--outcome", "ok"]),
        )
        .unwrap();
        match a.command {
            StatepointCommand::Set { container, statepoint, name, outcome, .. } => {
                assert_eq!((container.as_str(), statepoint.as_str(), name.as_deref()), ("c", "sp1", Some("x")));
                assert_eq!(outcome, ["failed: tests", "ok"]);
            }
            other => panic!("{other:?}"),
        }
        assert!(parse_verb::<StatepointArgs>("statepoint", &os(&["rm", "c"])).is_err(), "rm needs a statepoint");
        let a: StatepointArgs =
            parse_verb("statepoint", &os(&["set", "c", "sp1", "--outcome", "x", "--reward", "-1"])).unwrap();
        assert!(matches!(a.command, StatepointCommand::Set { reward: Some(r), .. } if r == -1.0));
        let s: SnapshotArgs = parse_verb("snapshot", &os(&["--description", "d", "agent", "--name", "n"])).unwrap();
        assert_eq!(
            (s.container.as_str(), s.name.as_deref(), s.description.as_deref()),
            ("agent", Some("n"), Some("d"))
        );
        let f: ForkArgs = parse_verb("fork", &os(&["agent", "sp1", "--name", "b"])).unwrap();
        assert_eq!((f.name, f.count), (vec!["b".to_string()], None));
        let f: ForkArgs =
            parse_verb("fork", &os(&["agent", "sp1", "--count", "2", "--name", "b", "--name", "c"])).unwrap();
        assert_eq!((f.name, f.count), (vec!["b".to_string(), "c".to_string()], Some(2)));
        assert!(parse_verb::<ForkArgs>("fork", &os(&["agent", "sp1", "--count", "0"])).is_err(), "no fork is no call");
    }

    #[test]
    fn no_arguments() {
        let i = inv(&[]);
        assert_eq!(i.verb(), None);
        assert!(i.verb_args().is_empty());
    }
}
